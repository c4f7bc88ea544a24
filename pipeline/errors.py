"""The base class of every error a pipeline stage raises on purpose, and the retry rule it carries."""

from __future__ import annotations


class PipelineError(ValueError):
    """Bad input, bad settings, or a gate that failed: permanent, never retried.

    The same inputs fail the same way on every attempt, so workers/runner.py gives up at once
    (it treats every ValueError as permanent, see its PERMANENT_ERRORS). Anything else (an OSError,
    a RuntimeError from a device, a store outage) is transient and retried. Each stage's own error
    subclasses this one. pipeline.assets.AssetError (an asset package not installed) is a
    RuntimeError, not one of these, and so is retried: another node may have the package.
    See docs/design.md, 'Errors: permanent and retried'.
    """
