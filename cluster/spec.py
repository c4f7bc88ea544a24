"""BuildSpec: what a user asks for (YAML or JSON), validated before anything is written.

`spec_model(registry)` is the BuildSpec of one registry: `stages` has one optional field per
registered stage whose `settings` is that stage's pydantic Settings model, so an unknown stage,
an unknown setting or a bad value is an error at parse time, every one reported with its field
(`stages.elastify.settings.align`), and the OpenAPI document shows every stage's settings.
A plain `BuildSpec` (no registry) keeps settings as dicts; `cluster.dag.plan` checks them then.

`preset` (quick | default | full) picks the stage set and a few settings (PRESETS); what the spec's
own `stages` entry sets wins over the preset, field by field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_serializer,
    field_validator,
    model_serializer,
)
from sqlalchemy import select

from cluster.models import Build, Package
from device_sdk.format import DEFAULT_LEVELS, canonical_json
from pipeline.settings import DEFAULT_CALIBRATION, MAX_FILES, Levels

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
VERSION_PATTERN = r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$"


Preset = Literal["quick", "default", "full"]

# What each preset changes from the registry's defaults: per stage, whether it runs and settings that the
# spec's own stage settings override. quick: profile → elastify → a short recovery on the calibration text
# → evaluate → publish (no generated corpus, no latency or TLM); full: the default chain plus the LoRA-MoE
# experts and the GGUF/transformers export. CLONE stays opt-in everywhere: it needs latency budgets.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "quick": {
        **{name: {"enabled": False} for name in (
            "corpus-generate", "corpus", "latency", "tlm-score", "label", "label-derive", "tlm-decision")},
        "recover": {"settings": {"steps": 24, "eval_windows": 4}},
    },
    "default": {},
    "full": {"experts": {"enabled": True}, "export": {"enabled": True}},
}


class SpecError(ValueError):
    """An invalid build spec; `problems` lists (field, message) pairs, one per offending field."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("invalid build spec:\n" + "\n".join(f"  {where}: {what}" for where, what in problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(Strict):
    model: str = Field(min_length=1, description="HF model directory or .gguf file: an absolute path under the "
                       "server's source roots, or upload:<digest> from POST /v1/sources")
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
    # A dict in a plain BuildSpec; the stage's Settings model (None: the defaults) in a registry's (spec_model).
    settings: dict[str, Any] | BaseModel | None = Field(default_factory=dict)
    max_attempts: int | None = Field(default=None, ge=1, le=20)
    resources: ResourcesSpec | None = None

    @field_serializer("settings")
    def _settings_as_given(self, settings):
        """Only what the user set, so a spec's JSON and content hash are what was submitted (typed or not)."""
        if isinstance(settings, BaseModel):
            return settings.model_dump(mode="json", exclude_unset=True)
        return settings if settings is not None else {}


class StagesSpec(Strict):
    """Base of a registry's `stages` model: one optional field per stage, named as the stage is."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True, validate_by_name=False)

    def given(self) -> dict[str, StageSpec]:
        """The stages the spec names, by stage name."""
        return {field.alias or name: getattr(self, name) for name, field in type(self).model_fields.items()
                if getattr(self, name) is not None}

    @model_serializer(mode="wrap")
    def _named_only(self, handler) -> dict[str, Any]:
        """The stages the spec names, nothing else, so the JSON is what was submitted."""
        return {name: value for name, value in handler(self).items() if value is not None}


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
    calibration: list[str] = Field(default_factory=lambda: list(DEFAULT_CALIBRATION), min_length=1,
                                   max_length=MAX_FILES)
    levels: Levels = Field(default_factory=lambda: [level.ratio for level in DEFAULT_LEVELS])
    stages: dict[str, StageSpec] = Field(default_factory=dict)
    publish: PublishSpec
    preset: Preset = Field(default="default", description="the stage set to start from: quick (profile, "
                           "elastify, a short recovery, evaluate), default (the ElastiLM chain), full (plus "
                           "experts and export); `stages` entries override it")
    cache: bool = True
    # Where the stages that run a model compute (cluster.accelerator): "auto" gives each one GPU when the
    # Ray cluster has GPUs, else CPUs; "cuda" insists on a GPU; "cpu" never asks for one.
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"

    def given_stages(self) -> dict[str, StageSpec]:
        """The stages the spec names (enabled or not) and those its preset changes, by stage name."""
        given = self.stages.given() if isinstance(self.stages, StagesSpec) else dict(self.stages)
        return {**given, **{name: _with_preset(given.get(name), preset)
                            for name, preset in PRESETS[self.preset].items()}}

    def content_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()


def _with_preset(own: StageSpec | None, preset: dict[str, Any]) -> StageSpec:
    """A stage's spec entry over its preset: `enabled` if the spec set it, settings key by key."""
    if own is None:
        return StageSpec(enabled=preset.get("enabled", True), settings=dict(preset.get("settings", {})))
    settings = own.settings
    given = (settings.model_dump(include=settings.model_fields_set) if isinstance(settings, BaseModel)
             else dict(settings or {}))
    enabled = own.enabled if "enabled" in own.model_fields_set else preset.get("enabled", own.enabled)
    # model_copy: `own` may be a registry's typed StageSpec; the merged settings are a dict that
    # Stage.settings_for validates as it does a plain spec's.
    return own.model_copy(update={"enabled": enabled, "settings": {**preset.get("settings", {}), **given}})


def spec_model(registry) -> type[BuildSpec]:
    """The BuildSpec of `registry` (a cluster.registry.Registry): every stage's settings typed."""
    fields = {}
    for stage in registry:
        stage_spec = create_model(
            f"{_camel(stage.name)}StageSpec", __base__=StageSpec,
            settings=(stage.settings | None, Field(default=None, description=f"settings of stage {stage.name}")),
        )
        fields[stage.name.replace("-", "_")] = (stage_spec | None, Field(default=None, alias=stage.name))
    stages = create_model("Stages", __base__=StagesSpec, **fields)
    return create_model("BuildSpec", __base__=BuildSpec, stages=(stages, Field(default_factory=stages)))


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("_", "-").split("-"))


def parse_spec(data: dict | str | bytes | Path, registry=None) -> BuildSpec:
    """Parse a spec from a dict, YAML/JSON text, or a file; raise SpecError naming every bad field.

    With a registry, stage names and every stage's settings are checked too (spec_model)."""
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
        return (BuildSpec if registry is None else spec_model(registry)).model_validate(data)
    except ValidationError as err:
        raise SpecError(validation_problems(err.errors(), registry=registry)) from None


def validation_problems(errors: list[dict], prefix: tuple = (), registry=None) -> list[tuple[str, str]]:
    """(field, message) per pydantic error; the field is dotted, e.g. `stages.elastify.settings.align`.

    An unknown stage or setting is described with what the registry allows. A leading `body`
    (FastAPI's location of a request body) is kept in the field name.
    """
    problems = []
    for error in errors:
        loc = (*prefix, *error["loc"])
        where = loc[1:] if loc[:1] == ("body",) else loc
        message = error["msg"]
        if error["type"] == "extra_forbidden" and registry is not None and where[:1] == ("stages",):
            if len(where) == 2:
                message = f"unknown stage; registered stages: {sorted(stage.name for stage in registry)}"
            elif len(where) == 4 and where[2] == "settings" and where[1] in registry:
                message = f"unknown setting; allowed: {sorted(registry.get(where[1]).settings.model_fields)}"
        problems.append((".".join(map(str, loc)) or "(document)", message))
    return problems


def published_build(session, publish: PublishSpec, tenant: str) -> str | None:
    """The id of `tenant`'s build that already published `publish.name` `publish.version`, if one did
    (another tenant's name is refused by cluster.service.submit, without saying which versions exist).

    A published version is immutable (its manifest is signed and pinned by devices), so a second build of
    it is refused at submit rather than after hours of compute, at publish."""
    return session.scalar(select(Package.build_id).join(Build, Build.id == Package.build_id).where(
        Package.name == publish.name, Package.version == publish.version, Build.tenant_id == tenant))


def dump_spec(spec: BuildSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), indent=2)
