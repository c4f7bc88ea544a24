"""User-facing surface: the REST API, the dashboard and the `elastify` command line."""
