"""The CLONE stages: collect, search, experts."""
