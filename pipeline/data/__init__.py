"""Data the stages read: calibration windows, recovery-corpus prompts and texts, multiple-choice tasks."""
