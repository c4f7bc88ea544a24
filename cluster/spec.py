"""BuildSpec: what a user asks for (YAML or JSON), validated before anything is written.

Structural checks come from pydantic; stage names and stage settings are checked against the
registry by `cluster.dag.validate_spec`, and every problem is reported at once with its field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from device_sdk.format import canonical_json

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
VERSION_PATTERN = r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$"


class SpecError(ValueError):
    """An invalid build spec; `problems` lists (field, message) pairs, one per offending field."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("invalid build spec:\n" + "\n".join(f"  {where}: {what}" for where, what in problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(Strict):
    model: str = Field(min_length=1, description="HF model directory or .gguf file readable by the workers")
    compression_data: str | None = Field(
        default=None, min_length=1,
        description="JSONL of {original, compressed} pairs for the TLM score head; default: labels from the model",
    )


class ResourcesSpec(Strict):
    num_cpus: float | None = Field(default=None, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, ge=0, description="bytes")
    custom: dict[str, float] | None = None


class StageSpec(Strict):
    enabled: bool = True
    settings: dict[str, Any] = Field(default_factory=dict)
    max_attempts: int | None = Field(default=None, ge=1, le=20)
    resources: ResourcesSpec | None = None


class PublishSpec(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    version: str = Field(pattern=VERSION_PATTERN)
    aliases: list[str] = Field(default_factory=lambda: ["latest"])

    @field_validator("version")
    @classmethod
    def _version(cls, version: str) -> str:
        if version == "aliases":
            raise ValueError("'aliases' is reserved (packages/<name>/aliases/ holds the aliases)")
        return version

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, aliases: list[str]) -> list[str]:
        import re

        bad = [a for a in aliases if not re.match(NAME_PATTERN, a)]
        if bad:
            raise ValueError(f"aliases must match {NAME_PATTERN}: {bad}")
        return aliases


class BuildSpec(Strict):
    source: SourceSpec
    calibration: list[str] = Field(default_factory=lambda: ["ptb:train"], min_length=1)
    levels: list[float] = Field(default_factory=lambda: [round(0.2 + 0.1 * i, 1) for i in range(9)], min_length=1)
    stages: dict[str, StageSpec] = Field(default_factory=dict)
    publish: PublishSpec
    cache: bool = True

    @field_validator("levels")
    @classmethod
    def _levels(cls, levels: list[float]) -> list[float]:
        if any(not 0.0 < m <= 1.0 for m in levels):
            raise ValueError("every level must be in (0, 1]")
        if any(b <= a for a, b in zip(levels, levels[1:], strict=False)):
            raise ValueError("levels must be strictly increasing")
        return levels

    def stage(self, name: str) -> StageSpec:
        return self.stages.get(name) or StageSpec()

    def content_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()


def parse_spec(data: dict | str | bytes | Path) -> BuildSpec:
    """Parse a spec from a dict, YAML/JSON text, or a file; raise SpecError naming every bad field."""
    if isinstance(data, Path):
        data = data.read_text()
    if isinstance(data, (str, bytes)):
        try:
            data = yaml.safe_load(data)  # JSON is YAML
        except yaml.YAMLError as err:
            raise SpecError([("(document)", f"not valid YAML or JSON: {err}")]) from None
    if not isinstance(data, dict):
        raise SpecError([("(document)", "a build spec must be a mapping")])
    try:
        return BuildSpec.model_validate(data)
    except ValidationError as err:
        problems = [(".".join(str(p) for p in e["loc"]) or "(document)", e["msg"]) for e in err.errors()]
        raise SpecError(problems) from None


def dump_spec(spec: BuildSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), indent=2)
