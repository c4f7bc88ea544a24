"""Screens and diagnoses: one-off studies that chose or explained a setting; each runs as `python -m experiments.NAME`."""
