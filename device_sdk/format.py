"""The elastic package format (v1): manifest schema, canonical JSON, hashing, byte ranges, signing.

This module is the single definition of the format, and it needs only the standard library
(plus `cryptography` to verify a signature), so the API and the control plane read manifests
without importing torch. The weights side (writing tensors, reading a tensor's prefix) is
`device_sdk.package`; the SDK reads packages with `read_manifest`, and `device_sdk.trust.verify_package`
checks one against its signature and file hashes.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import numbers
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Exported levels (llama.cpp, transformers) published beside a package, outside its manifest, with an
# index of every file's size and sha256 and the manifest digest they were exported from.
EXPORTS_DIR = "exports"
EXPORTS_INDEX = f"{EXPORTS_DIR}/index.json"
WEIGHTS = "model/weights.safetensors"
CONFIG = "model/config.json"
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")  # package names and versions become cache paths and URLs


class PackageError(ValueError):
    """A package is malformed, incomplete, tampered with or of an unknown format."""


# --------------------------------------------------------------------------- schema


@dataclass
class Architecture:
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    norm_eps: float
    rope: dict[str, Any]
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position: int = 2048
    sliding_window: int | None = None

    @property
    def n_rep(self) -> int:
        return self.heads // self.kv_heads

    def validate(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise PackageError(f"architecture.family {self.family!r} is not one of {SUPPORTED_FAMILIES}")
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) <= 0:
                raise PackageError(f"architecture.{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise PackageError(f"architecture.heads ({self.heads}) is not a multiple of kv_heads ({self.kv_heads})")


# --------------------------------------------------------------------------- levels

LEVEL_DECIMALS = 6  # a level's ratio is kept to this many decimals; its name is that ratio's repr


@functools.total_ordering
class Level:
    """One whole-model width: a ratio in (0, 1] and its one canonical name ("0.5", "1.0").

    Built from a ratio or from a name; two levels are equal when their ratios agree to
    `LEVEL_DECIMALS` decimals, they order by ratio and hash by it, so levels compare, sort and
    key dicts without any float/string round trip. The name is the level's key in the manifest
    (byte ranges, adapters, latency profiles) and in stage shards.
    """

    __slots__ = ("name", "ratio")
    name: str
    ratio: float

    def __init__(self, value: Level | float | str) -> None:
        ratio = value.ratio if isinstance(value, Level) else _level_ratio(value)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "name", repr(ratio))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("a Level is immutable")

    def __reduce__(self):
        return (Level, (self.ratio,))

    def __eq__(self, other: object) -> bool:
        return self.ratio == other.ratio if isinstance(other, Level) else NotImplemented

    def __lt__(self, other: Level) -> bool:
        return self.ratio < other.ratio if isinstance(other, Level) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.ratio)

    def __repr__(self) -> str:
        return f"Level({self.name})"

    def __str__(self) -> str:
        return self.name


def _level_ratio(value: float | str) -> float:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"a level is a ratio in (0, 1] or its name; got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"level {value!r} is not a number") from None
    if math.isnan(number) or not 0.0 < number <= 1.0:
        raise ValueError(f"a level must be in (0, 1]; got {value!r}")
    ratio = round(number, LEVEL_DECIMALS)
    if ratio == 0.0:
        raise ValueError(f"level {value!r} rounds to 0.0 at {LEVEL_DECIMALS} decimals, so it would have no name of its own")
    return ratio


def parse_levels(values: Iterable[Level | float | str]) -> tuple[Level, ...]:
    """A build's levels, checked: not empty, each a valid level, no two with one name, increasing."""
    given = list(values)
    levels = tuple(Level(value) for value in given)
    if not levels:
        raise ValueError("levels must not be empty")
    first_of: dict[Level, float | str] = {}
    for value, level in zip(given, levels, strict=True):
        if level in first_of:
            raise ValueError(f"levels {first_of[level]!r} and {value!r} are both level {level.name} "
                             f"(ratios are kept to {LEVEL_DECIMALS} decimals)")
        first_of[level] = value
    for below, above in zip(levels, levels[1:], strict=False):
        if not below < above:
            raise ValueError(f"levels must be strictly increasing; {above.name} comes after {below.name}")
    return levels


# The default widths of a build: 20% to 100% of the model in steps of 10%.
DEFAULT_LEVELS: tuple[Level, ...] = tuple(Level(round(0.2 + 0.1 * i, 1)) for i in range(9))


@dataclass
class LevelShape:
    """What one level keeps: units per layer, and what that costs. One entry of `elastic.levels`."""

    name: str  # the level's canonical name, e.g. "0.5"; also the key in byte_ranges
    ratio: float
    attn_units: list[int]  # kept KV groups per layer
    mlp_units: list[int]  # kept MLP neurons per layer
    active_params: int  # parameters multiplied per token (decoder linears + norms + LM head)
    active_fraction: float  # active_params / the full model's active_params
    adapter: str | None = None  # adapters/recovery/<name>.safetensors once recovery ran
    quality: dict[str, float] = field(default_factory=dict)
    # The report card's verdict (pipeline.elastilm.evaluate): False when its quality is below the build's
    # thresholds, so the SLO decision never picks it (a forced level still may). Packages from
    # before the verdict existed read as usable.
    usable: bool = True

    @property
    def level(self) -> Level:
        return Level(self.ratio)


@dataclass
class ElasticTensor:
    """How one stored tensor is cut into units along its first axis."""

    layer: int
    unit: str  # "attn" or "mlp"
    rows_per_unit: int
    transposed: bool  # stored [in, out] (o_proj, down_proj) so the unit axis comes first


@dataclass
class Elastic:
    anchor_layers: list[int]
    attn_units: list[int]  # total KV groups per layer
    mlp_units: list[int]  # total neurons per layer
    levels: list[LevelShape]
    tensors: dict[str, ElasticTensor]
    importance: dict[str, Any] = field(default_factory=dict)  # method, calibration, layer scores

    def level(self, key: Level | float | str) -> LevelShape:
        """The shape of one level, given as a Level, a ratio or a name."""
        try:
            wanted = Level(key)
        except ValueError as bad:
            raise PackageError(str(bad)) from None
        for shape in self.levels:
            if shape.level == wanted:
                return shape
        raise PackageError(f"no level {wanted.name}; the package has {[shape.name for shape in self.levels]}")


@dataclass
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass
class Manifest:
    format_version: int
    name: str
    version: str
    created_at: str
    build_id: str | None
    source: dict[str, Any]
    architecture: Architecture
    elastic: Elastic
    files: list[FileEntry]
    byte_ranges: dict[str, Any]
    tlm: dict[str, Any] | None = None
    latency_profile: dict[str, Any] | None = None
    clone: dict[str, Any] | None = None
    experts: dict[str, Any] | None = None
    # Rollback and freeze protection (section 3 of docs/design.md): `sequence` is one more than the highest
    # sequence published for this name before it, so a device can refuse an older release however it is
    # served; `expires_at` (ISO 8601 with a zone) bounds how long a registry may keep serving this manifest.
    # Both are signed. A manifest from before them reads as sequence 0, never expiring.
    sequence: int = 0
    expires_at: str | None = None
    # Extra precisions, each a weights file of its own: {"int4": {"file", "quantised", "formats", "unquantised"}}
    # (`formats`: each quantised tensor's block format, see precision_formats); their byte ranges are
    # byte_ranges["precisions"][<precision>] (precision_byte_ranges).
    precisions: dict[str, Any] | None = None
    signature: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        # Left out at their defaults, so that a manifest signed before these fields existed still has the
        # signed bytes it was signed over.
        for name, default in (("sequence", 0), ("expires_at", None), ("precisions", None)):
            if data[name] == default:
                del data[name]
        return data

    def expires(self) -> datetime | None:
        """`expires_at` as an aware datetime (None: never)."""
        return None if self.expires_at is None else _aware_time(self.expires_at, "expires_at")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        if not isinstance(data, Mapping):
            raise PackageError("manifest must be a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise PackageError(f"manifest format_version is {version!r}; this SDK reads format {FORMAT_VERSION}")
        try:
            arch = _build(Architecture, data["architecture"], "architecture")
            el = data["elastic"]
            elastic = Elastic(
                anchor_layers=list(el["anchor_layers"]),
                attn_units=list(el["attn_units"]),
                mlp_units=list(el["mlp_units"]),
                levels=[_build(LevelShape, lv, "elastic.levels[]") for lv in el["levels"]],
                tensors={k: _build(ElasticTensor, v, f"elastic.tensors[{k}]") for k, v in el["tensors"].items()},
                importance=dict(el.get("importance", {})),
            )
            top = {f.name for f in fields(cls)} - {"architecture", "elastic", "files"}
            unknown = set(data) - top - {"architecture", "elastic", "files"}
            if unknown:
                raise PackageError(f"manifest has unknown fields: {sorted(unknown)}")
            manifest = cls(
                architecture=arch,
                elastic=elastic,
                files=[_build(FileEntry, f, "files[]") for f in data["files"]],
                **{k: data[k] for k in top if k in data},
            )
        except KeyError as missing:
            raise PackageError(f"manifest is missing the field {missing}") from None
        except TypeError as bad:
            raise PackageError(f"manifest is malformed: {bad}") from None
        manifest.validate()
        return manifest

    def validate(self) -> None:
        if isinstance(self.sequence, bool) or not isinstance(self.sequence, int) or self.sequence < 0:
            raise PackageError(f"manifest sequence must be a non-negative integer, not {self.sequence!r}")
        self.expires()
        for precision, entry in (self.precisions or {}).items():
            if precision not in PRECISION_BLOCK_BYTES or not isinstance(entry, Mapping) or entry.get("file") != (
                precision_file(precision)
            ) or precision not in self.byte_ranges.get("precisions", {}):
                raise PackageError(f"precisions.{precision}: expected one of {sorted(PRECISION_BLOCK_BYTES)} with its "
                                   f"file {precision_file(precision)!r} and its byte ranges")
            formats = entry.get("formats", {})
            if not isinstance(formats, Mapping) or not set(formats) <= set(entry.get("quantised", ())) or any(
                value not in PRECISION_BLOCK_BYTES for value in formats.values()
            ):
                raise PackageError(f"precisions.{precision}.formats must map quantised tensors to one of "
                                   f"{sorted(PRECISION_BLOCK_BYTES)}")
        self.architecture.validate()
        arch, el = self.architecture, self.elastic
        if len(el.attn_units) != arch.layers or len(el.mlp_units) != arch.layers:
            raise PackageError("elastic unit counts must have one entry per layer")
        if not el.levels:
            raise PackageError("elastic.levels is empty")
        below = None
        for level in el.levels:
            try:
                value = level.level
            except ValueError as bad:
                raise PackageError(f"elastic.levels: {bad}") from None
            if level.name != value.name:
                raise PackageError(f"level name {level.name!r} is not the canonical name {value.name!r} of its ratio")
            if not isinstance(level.usable, bool):
                raise PackageError(f"level {level.name}: usable must be true or false, not {level.usable!r}")
            if below is not None and value == below.level:
                raise PackageError(f"two levels are both level {value.name}")
            if below is not None and not below.level < value:
                raise PackageError(f"levels must increase; {value.name} comes after {below.name}")
            if below is not None and any(
                a < b for a, b in zip(level.attn_units + level.mlp_units, below.attn_units + below.mlp_units, strict=True)
            ):
                raise PackageError(f"level {level.name} keeps fewer units than level {below.name} in some layer")
            below = level
            for layer, (a, m) in enumerate(zip(level.attn_units, level.mlp_units, strict=True)):
                if not (0 <= a <= el.attn_units[layer] and 0 <= m <= el.mlp_units[layer]):
                    raise PackageError(f"level {level.name} keeps more units than layer {layer} has")
        for anchor in el.anchor_layers:
            if not 0 <= anchor < arch.layers:
                raise PackageError(f"anchor layer {anchor} is out of range")
        clone_profiles(self)
        expert_entries(self)


@dataclass
class CloneProfile:
    """A named per-layer width profile found by the CLONE search, with what was measured for it."""

    attn_units: list[int]
    mlp_units: list[int]
    ppl: float  # held-out perplexity, no LoRA
    latency_ms: float  # predicted latency of the cost model's reference request
    energy_j: float  # predicted energy of that request
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    ratios: list[float] = field(default_factory=list)
    active_fraction: float | None = None
    origin: str = "search"  # "search", or the collection heuristic that found it
    budget: dict[str, float] = field(default_factory=dict)  # the (latency_ms, energy_j) it was chosen for


def clone_profiles(manifest: Manifest) -> dict[str, CloneProfile]:
    """`clone.profiles` parsed and checked against the architecture; {} when the package has none."""
    if manifest.clone is None:
        return {}
    if not isinstance(manifest.clone, Mapping) or not isinstance(manifest.clone.get("profiles"), Mapping):
        raise PackageError("clone must be an object with a `profiles` object")
    arch, el = manifest.architecture, manifest.elastic
    profiles = {}
    for name, entry in manifest.clone["profiles"].items():
        if not isinstance(entry, Mapping):
            raise PackageError(f"clone.profiles[{name}] must be an object")
        profile = _build(CloneProfile, entry, f"clone.profiles[{name}]")
        if len(profile.attn_units) != arch.layers or len(profile.mlp_units) != arch.layers:
            raise PackageError(f"clone.profiles[{name}] needs one width per layer ({arch.layers})")
        for layer, (a, m) in enumerate(zip(profile.attn_units, profile.mlp_units, strict=True)):
            if not (0 <= a <= el.attn_units[layer] and 0 <= m <= el.mlp_units[layer]):
                raise PackageError(f"clone.profiles[{name}] keeps more units than layer {layer} has")
        if not all(isinstance(v, (int, float)) and v >= 0 for v in (profile.ppl, profile.latency_ms, profile.energy_j)):
            raise PackageError(f"clone.profiles[{name}]: ppl, latency_ms and energy_j must be non-negative numbers")
        profiles[name] = profile
    return profiles


@dataclass
class ExpertEntry:
    """One CLONE LoRA-MoE expert: its adapter file and the centroid of its task's prompt embeddings."""

    name: str
    adapter: str  # adapters/experts/<name>.safetensors (unit-major, full width)
    centroid: list[float]


def expert_entries(manifest: Manifest) -> list[ExpertEntry]:
    """`experts.experts` parsed and checked; [] when the package has none."""
    if manifest.experts is None:
        return []
    data = manifest.experts
    if not isinstance(data, Mapping) or not isinstance(data.get("experts"), list):
        raise PackageError("experts must be an object with an `experts` list")
    entries = [_build(ExpertEntry, e, "experts.experts[]") for e in data["experts"]]
    if not entries:
        raise PackageError("experts.experts is empty; omit `experts` for a package without experts")
    sizes = {len(e.centroid) for e in entries}
    if len(sizes) != 1 or 0 in sizes:
        raise PackageError("every expert centroid must have the same, non-zero dimension")
    if len({e.name for e in entries}) != len(entries):
        raise PackageError("expert names must be unique")
    if not data.get("temperature", 1.0) > 0:
        raise PackageError("experts.temperature must be positive")
    return entries


def _aware_time(text: Any, where: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text) if isinstance(text, str) else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise PackageError(f"manifest {where} must be an ISO 8601 time with a zone (e.g. 2027-01-01T00:00:00+00:00), "
                           f"not {text!r}")
    return moment


def _build(kind, data: Mapping[str, Any], where: str):
    names = {f.name for f in fields(kind)}
    unknown = set(data) - names
    if unknown:
        raise PackageError(f"{where} has unknown fields: {sorted(unknown)}")
    try:
        return kind(**data)
    except TypeError as err:
        raise PackageError(f"{where} is malformed: {err}") from None


# --------------------------------------------------------------------------- canonical JSON and signing


def canonical_json(data: Any) -> bytes:
    """The exact bytes that are hashed and signed: sorted keys, no whitespace, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def signed_bytes(manifest: Manifest | Mapping[str, Any]) -> bytes:
    data = manifest.to_dict() if isinstance(manifest, Manifest) else dict(manifest)
    data.pop("signature", None)
    return canonical_json(data)


def sign_manifest(manifest: Manifest, private_key) -> Manifest:
    """Sign in place with an Ed25519 private key (cryptography's Ed25519PrivateKey)."""
    manifest.signature = base64.b64encode(private_key.sign(signed_bytes(manifest))).decode()
    return manifest


def load_public_key(public_key):
    """An Ed25519PublicKey from a key object, its 32 raw bytes or their base64; PackageError for anything else."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:  # a mistyped --public-key is the user's error to fix, not a traceback
        if isinstance(public_key, str):
            public_key = base64.b64decode(public_key.strip(), validate=True)
        if isinstance(public_key, bytes | bytearray):
            public_key = Ed25519PublicKey.from_public_bytes(bytes(public_key))
    except ValueError:  # binascii.Error is one
        public_key = None
    if not isinstance(public_key, Ed25519PublicKey):
        raise PackageError("the public key is not an Ed25519 public key: give its 32 raw bytes as base64 "
                           "(44 characters, as GET /v1/keys/signing shows it)")
    return public_key


def public_key_b64(public_key) -> str:
    """The base64 of a public key's 32 raw bytes: the form keys are shown, passed and pinned in."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return base64.b64encode(load_public_key(public_key).public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def verify_signature(manifest: Manifest, public_key) -> None:
    """Raise PackageError unless the manifest carries a valid signature by `public_key`.

    `public_key` is an Ed25519PublicKey or its 32 raw bytes (or their base64).
    """
    from cryptography.exceptions import InvalidSignature

    public_key = load_public_key(public_key)
    if not manifest.signature:
        raise PackageError("manifest is not signed")
    try:
        public_key.verify(base64.b64decode(manifest.signature), signed_bytes(manifest))
    except (InvalidSignature, ValueError):
        raise PackageError("manifest signature does not verify against the pinned public key") from None


# --------------------------------------------------------------------------- hashing and safetensors layout


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def safetensors_layout(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """Return (data_start, header) of a safetensors file; header offsets are relative to data_start."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise PackageError(f"{path} is not a safetensors file (truncated header)")
        (header_len,) = struct.unpack("<Q", raw)
        header = json.loads(handle.read(header_len))
    header.pop("__metadata__", None)
    return 8 + header_len, header


def byte_ranges_for(path: Path, elastic: Elastic, element_size: int) -> dict[str, Any]:
    """Absolute [start, end) byte range of every tensor for every level.

    Elastic tensors are unit-major, so a level's bytes are a prefix of the tensor's bytes;
    every other tensor (embeddings, norms) is needed whole by every level.
    """
    data_start, header = safetensors_layout(path)
    tensors: dict[str, dict[str, list[int]]] = {}
    for name, info in header.items():
        begin, end = (data_start + offset for offset in info["data_offsets"])
        spec = elastic.tensors.get(name)
        per_level = {}
        for level in elastic.levels:
            if spec is None:
                per_level[level.name] = [begin, end]
                continue
            units = (level.attn_units if spec.unit == "attn" else level.mlp_units)[spec.layer]
            row_bytes = element_size * _row_elements(info["shape"])
            per_level[level.name] = [begin, begin + units * spec.rows_per_unit * row_bytes]
        tensors[name] = per_level
    ranges = {"file": WEIGHTS, "header": [0, data_start], "tensors": tensors}
    ranges["sha256"] = range_digests(path, ranges)
    return ranges


def range_digests(path: Path, ranges: Mapping[str, Any]) -> dict[str, Any]:
    """sha256 of the header and of every tensor's per-level prefix, so a partial pull is verifiable.

    Prefixes of one tensor nest, so each tensor is read once and the hash is snapshotted at
    every level's end.
    """
    digests: dict[str, Any] = {"header": None, "tensors": {}}
    with open(path, "rb") as handle:
        digests["header"] = hashlib.sha256(handle.read(ranges["header"][1])).hexdigest()
        for name, per_level in ranges["tensors"].items():
            begin = min(start for start, _ in per_level.values())
            handle.seek(begin)
            hasher, position, per_name = hashlib.sha256(), begin, {}
            for level, (_, end) in sorted(per_level.items(), key=lambda item: item[1][1]):
                hasher.update(handle.read(end - position))
                position = end
                per_name[level] = hasher.copy().hexdigest()
            digests["tensors"][name] = per_name
    return digests


def _row_elements(shape: list[int]) -> int:
    count = 1
    for dim in shape[1:]:
        count *= dim
    return count


# Extra precisions: llama.cpp's Q8_0 / Q4_0 blocks of 32 values (device_sdk.quant lays them out so that
# every width is a prefix); bytes per block, fp16 scale included.
PRECISION_BLOCK = 32
PRECISION_BLOCK_BYTES = {"int8": 2 + PRECISION_BLOCK, "int4": 2 + PRECISION_BLOCK // 2}
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}


def precision_file(precision: str) -> str:
    return f"model/weights.{precision}.safetensors"


# The LM head's block format in each precision's file: Q8_0 in the int4 file too, as llama.cpp's Q4_0 keeps its
# output tensor (for SmolLM2-135M a 4-bit head alone cost most of the int4 perplexity increase). The head is
# the tied embedding (then the lookup table reads the same blocks) or `lm_head.weight`; no level cuts it.
HEAD_FORMATS = {"int8": "int8", "int4": "int8"}


def head_tensor(architecture: Architecture) -> str:
    """The stored name of the LM head's matrix."""
    return "model.embed_tokens.weight" if architecture.tie_word_embeddings else "lm_head.weight"


def precision_formats(manifest: Manifest, precision: str) -> dict[str, str]:
    """The block format of each tensor quantised in `precision`'s file: its entry's `formats` map; a package
    written before the map has every quantised tensor at the precision itself."""
    weights_ranges(manifest, precision)  # refuses a precision the package does not carry
    entry = manifest.precisions[precision]
    formats = entry.get("formats", {})
    return {name: formats.get(name, precision) for name in entry["quantised"]}


def precision_byte_ranges(package_dir: Path, precision: str, elastic: Elastic, quantised: Iterable[str]) -> dict[str, Any]:
    """`byte_ranges_for` of a precision's weights file: per tensor and level, the prefix that level needs.

    A quantised tensor of row units (stored [rows, in]) is packed one row of blocks per row, so a
    level's rows are its first rows; one of column units (stored transposed, [in, out]) is packed
    one block-row per 32 units, so a level needs its first ceil(units / 32) block-rows (the last
    one whole: its scales are the full model's). Unquantised tensors are cut as in the main file; the
    LM head, quantised but no elastic tensor, is needed whole by every level.
    """
    quantised = set(quantised)
    path = Path(package_dir) / precision_file(precision)
    data_start, header = safetensors_layout(path)
    tensors: dict[str, dict[str, list[int]]] = {}
    for name, info in header.items():
        begin, end = (data_start + offset for offset in info["data_offsets"])
        spec = elastic.tensors.get(name)
        row_bytes = _DTYPE_BYTES[info["dtype"]] * _row_elements(info["shape"])
        per_level = {}
        for level in elastic.levels:
            if spec is None:
                per_level[level.name] = [begin, end]
                continue
            rows = (level.attn_units if spec.unit == "attn" else level.mlp_units)[spec.layer] * spec.rows_per_unit
            if name in quantised and spec.transposed:
                rows = -(-rows // PRECISION_BLOCK)
            per_level[level.name] = [begin, begin + rows * row_bytes]
        tensors[name] = per_level
    ranges = {"file": precision_file(precision), "header": [0, data_start], "tensors": tensors}
    ranges["sha256"] = range_digests(path, ranges)
    return ranges


def weights_ranges(manifest: Manifest, precision: str | None = None) -> Mapping[str, Any]:
    """The byte ranges of the main weights file (None) or of a precision's file."""
    if precision is None:
        return manifest.byte_ranges
    if precision not in (manifest.precisions or {}):
        raise PackageError(f"{manifest.name} {manifest.version} carries no {precision} weights; it has "
                           f"{sorted(manifest.precisions or {}) or 'only its stored precision'}")
    return manifest.byte_ranges["precisions"][precision]


def level_byte_ranges(manifest: Manifest, level: Level | float | str,
                      precision: str | None = None) -> list[tuple[int, int]]:
    """Merged, sorted byte ranges of the weights file (or a precision's file) that `level` (and every
    smaller level) needs."""
    name = Level(level).name
    ranges = weights_ranges(manifest, precision)
    spans = [tuple(ranges["header"])]
    spans += [tuple(per_level[name]) for per_level in ranges["tensors"].values()]
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


# --------------------------------------------------------------------------- reading and verifying


def read_manifest(package_dir: Path) -> Manifest:
    return parse_manifest(read_manifest_bytes(package_dir), Path(package_dir) / MANIFEST)


def read_manifest_bytes(package_dir: Path) -> bytes:
    path = Path(package_dir) / MANIFEST
    if not path.is_file():
        raise PackageError(f"{package_dir} has no {MANIFEST}")
    return path.read_bytes()


def parse_manifest(raw: bytes, where: Path | str) -> Manifest:
    """A manifest from its bytes: what was parsed is exactly what a caller may hash."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise PackageError(f"{where} is not valid JSON: {err}") from None
    return Manifest.from_dict(data)


def check_files(package_dir: Path, manifest: Manifest, files: Iterable[str] | None = None) -> None:
    """Check the size and sha256 of every file the manifest lists (or of those named in `files`)."""
    wanted = set(files) if files is not None else None
    for entry in manifest.files:
        if wanted is not None and entry.path not in wanted:
            continue
        path = package_dir / entry.path
        if not path.is_file():
            raise PackageError(f"{entry.path} is missing from the package")
        if path.stat().st_size != entry.size:
            raise PackageError(f"{entry.path} has {path.stat().st_size} bytes, the manifest says {entry.size}")
        if sha256_file(path) != entry.sha256:
            raise PackageError(f"{entry.path} does not match its sha256 in the manifest")


# --------------------------------------------------------------------------- writing


def rewrite_manifest(package_dir: Path, manifest: Manifest) -> None:
    """Refresh the file table and write the manifest atomically (after adding files to a package)."""
    manifest.files = file_entries(Path(package_dir))
    manifest.validate()
    atomic_write_bytes(Path(package_dir) / MANIFEST, canonical_json(manifest.to_dict()))


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A fresh directory beside `target` that replaces it whole when the block succeeds and is
    removed when it fails, so a reader never sees a half-written `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def swap_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing `target` is retired first and then deleted."""
    if not target.exists():
        os.rename(staging, target)
        return
    retired = target.with_name(f".{target.name}.retired")
    shutil.rmtree(retired, ignore_errors=True)
    os.rename(target, retired)
    os.rename(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def atomic_write_bytes(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_entries(root: Path) -> list[FileEntry]:
    """The file table of a package directory: every file but the manifest, sorted, sized and hashed."""
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if relative == MANIFEST:
            continue
        entries.append(FileEntry(relative, path.stat().st_size, sha256_file(path)))
    return entries
