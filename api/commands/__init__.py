"""One module per group of `elastify` commands; api/cli.py mounts them."""
