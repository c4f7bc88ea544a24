"""What the tests share: tiny models, packages, a live API, the real services they start, the probe."""
