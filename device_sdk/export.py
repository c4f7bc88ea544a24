"""Export one level (or CLONE profile) of a package as a plain dense model other runtimes load.

A level is a prefix of every unit-major tensor, so exporting it is slicing: q/k/v/gate/up keep
their first rows, the transposed o_proj/down_proj (stored `[in, out]`) keep their first rows and
are turned back to HF's `[out, in]`. A level keeps whole KV groups, each with its `n_rep` query
heads, so the GQA ratio never changes. The level's recovery LoRA is merged in (W += scale·B·A),
or kept apart and written as a peft adapter (`export_peft`).

A layer of width 0 (the SDK skips the sub-layer) is written as one unit of zeros with a zero
output bias, which adds exactly nothing, because neither transformers nor llama.cpp runs a
Llama block without heads or neurons.

Formats: `export_hf` here (transformers' `from_pretrained`), `device_sdk.export_gguf` (llama.cpp).

An export replaces nothing but an earlier export of its own format, and that only with `force`
(`check_target`): directory exports carry `elastify_export.json`, GGUF files an `elastify.export` key.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from device_sdk.format import (
    CONFIG,
    MANIFEST,
    WEIGHTS,
    Level,
    Manifest,
    PackageError,
    clone_profiles,
    read_manifest,
    staged_directory,
)
from device_sdk.lora import PROJECTIONS, LoRA, adapter_scale, projection_key, read_adapter
from device_sdk.registry import read_local_state
from device_sdk.runtime import map_weights

# Files of the package's model/ directory that an HF export carries over unchanged.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
HF_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
MODELING_FILE = "modeling_elastify.py"
PEFT_DIR = "peft"  # where an unmerged HF export keeps the level's adapter
EXPORT_MARK = "elastify_export.json"  # in every directory export: what wrote it, so that --force can tell


class ExportError(PackageError):
    """What was asked cannot be exported (an unknown level or profile, an unsupported model)."""


@dataclass
class Selection:
    """The per-layer widths to export and the adapter that belongs to them."""

    label: str  # "level-0.5" or "profile-<name>"
    attn_units: list[int]  # KV groups per layer, as the level keeps them (0 allowed)
    mlp_units: list[int]  # neurons per layer
    adapter: Path | None  # the level's recovery adapter; CLONE profiles carry none

    @property
    def written_attn(self) -> list[int]:
        """Widths as written: a layer of width 0 becomes one unit of zeros."""
        return [max(units, 1) for units in self.attn_units]

    @property
    def written_mlp(self) -> list[int]:
        return [max(units, 1) for units in self.mlp_units]


def select(package_dir: Path, manifest: Manifest, level: Level | float | str | None = None,
           profile: str | None = None) -> Selection:
    """The widths of `level` or of the CLONE `profile` (exactly one of them)."""
    if (level is None) == (profile is None):
        raise ExportError("give exactly one of a level or a CLONE profile")
    if profile is not None:
        profiles = clone_profiles(manifest)
        if profile not in profiles:
            raise ExportError(f"no CLONE profile {profile!r}; the package has {sorted(profiles) or 'none'}")
        chosen = profiles[profile]
        selection = Selection(f"profile-{profile}", list(chosen.attn_units), list(chosen.mlp_units), None)
    else:
        shape = manifest.elastic.level(level)
        adapter = None if shape.adapter is None else Path(package_dir) / shape.adapter
        selection = Selection(f"level-{shape.name}", list(shape.attn_units), list(shape.mlp_units), adapter)
    state = read_local_state(package_dir)
    if state and state.get("max_level") is not None:  # a partial pull holds the bytes of levels up to this one
        held = manifest.elastic.level(state["max_level"])
        if any(w > h for w, h in zip(selection.attn_units + selection.mlp_units, held.attn_units + held.mlp_units,
                                     strict=True)):
            raise ExportError(f"{selection.label} needs weights above level {held.name}, the most this partial "
                              "copy holds; pull it again with a higher --max-level")
    return selection


def level_tensors(package_dir: Path, manifest: Manifest, selection: Selection, *, merge: bool = True
                  ) -> dict[str, torch.Tensor]:
    """The selection's dense weights in fp32 under HF names, its LoRA merged in when `merge`."""
    arch = manifest.architecture
    stored = map_weights(Path(package_dir) / WEIGHTS)
    lora = read_adapter(selection.adapter) if merge and selection.adapter is not None else {}
    rows = {"q_proj": arch.n_rep * arch.head_dim, "k_proj": arch.head_dim, "v_proj": arch.head_dim,
            "o_proj": arch.n_rep * arch.head_dim, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
    out = {name: stored[name].float().clone() for name in ("model.embed_tokens.weight", "model.norm.weight")}
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = stored["lm_head.weight"].float().clone()
    for layer in range(arch.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{layer}.{norm}.weight"
            out[name] = stored[name].float().clone()
        for proj in PROJECTIONS:
            is_attn = proj in PROJECTIONS[:4]
            units = (selection.attn_units if is_attn else selection.mlp_units)[layer]
            keep = units * rows[proj]
            written = max(units, 1) * rows[proj]
            base = projection_key(layer, proj)
            if f"{base}.weight_t" in stored:  # unit axis = inputs: back to HF's [out, in]
                weight = stored[f"{base}.weight_t"][:keep].float().T.contiguous()
                bias = stored.get(f"{base}.bias")
                bias = None if bias is None else bias.float().clone() * (1.0 if units else 0.0)
                if base in lora:
                    weight += merged_delta(lora[base], weight.shape, base)
                out[f"{base}.weight"] = _pad(weight, 1, written)
            else:
                weight = stored[f"{base}.weight"][:keep].float().clone()
                bias = stored.get(f"{base}.bias")
                bias = None if bias is None else _pad(bias[:keep].float().clone(), 0, written)
                if base in lora:
                    weight += merged_delta(lora[base], weight.shape, base)
                out[f"{base}.weight"] = _pad(weight, 0, written)
            if bias is not None:
                out[f"{base}.bias"] = bias
    return out


def merged_delta(lora: LoRA, shape: torch.Size, key: str) -> torch.Tensor:
    a, b, scale = lora
    delta = (b @ a) * scale
    if delta.shape != shape:
        raise ExportError(f"the adapter's {key} is {tuple(delta.shape)}, the level's weight {tuple(shape)}")
    return delta


def _pad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zeros appended along `dim` up to `size` (a width-0 layer's one unit of zeros)."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def parameter_count(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


# --------------------------------------------------------------------------- where an export may go


def check_target(package_dir: Path, out: Path, fmt: str, *, force: bool = False, is_export=None) -> None:
    """ExportError unless a `fmt` export may be written at `out`: a new path, an empty directory (or empty
    file, for a file format), or, with `force`, an earlier export of the same format. Never the package,
    a path inside it, or any other package. `is_export(path)` says whether an existing file is a `fmt`
    export (file formats); directories are recognised by their EXPORT_MARK."""
    package, target = Path(package_dir).resolve(), Path(out).resolve()
    if target == package or package in target.parents:
        raise ExportError(f"{out} is the package or inside it; write the export somewhere else")
    if target in package.parents:
        raise ExportError(f"{out} holds the package {package_dir}; write the export somewhere else")
    if not target.exists():
        return
    if is_export is not None:  # a file format
        if target.is_dir():
            raise ExportError(f"{out} is a directory; give the path of the {fmt} file to write")
        if target.stat().st_size == 0:
            return
        if not is_export(target):
            raise ExportError(f"{out} exists and is not an Elastify {fmt} export; remove it yourself or choose "
                              "another path")
    else:
        if not target.is_dir():
            raise ExportError(f"{out} exists and is not a directory")
        if not any(target.iterdir()):
            return
        if (target / MANIFEST).exists():
            raise ExportError(f"{out} is a package; an export never replaces one")
        if export_format(target) != fmt:
            raise ExportError(f"{out} is not empty and is not an earlier {fmt} export; choose a new or empty "
                              "directory")
    if not force:
        raise ExportError(f"{out} holds an earlier {fmt} export; pass --force to replace it")


def export_format(directory: Path) -> str | None:
    """The format of the export in `directory` by its EXPORT_MARK (None: not an export)."""
    try:
        mark = json.loads((Path(directory) / EXPORT_MARK).read_text())
    except (OSError, ValueError):
        return None
    return mark.get("format") if isinstance(mark, dict) else None


def write_mark(directory: Path, fmt: str, manifest: Manifest, selection: str | None = None) -> None:
    mark = {"format": fmt, "package": manifest.name, "version": manifest.version, "selection": selection}
    (Path(directory) / EXPORT_MARK).write_text(json.dumps(mark, indent=2) + "\n")


# --------------------------------------------------------------------------- Hugging Face


def hf_config(package_dir: Path, manifest: Manifest, selection: Selection) -> tuple[dict, bool]:
    """(config.json of the export, whether it needs the remote-code modeling file).

    Uniform widths give the family's own config at the level's head, KV-head and FFN counts;
    per-layer widths keep the full counts (so n_rep is unchanged) and list each layer's.
    """
    arch = manifest.architecture
    config = json.loads((Path(package_dir) / CONFIG).read_text())
    for key in ("_name_or_path", "_model_name_or_path", "auto_map", "quantization_config"):
        config.pop(key, None)
    groups, neurons = selection.written_attn, selection.written_mlp
    config["head_dim"] = arch.head_dim
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = "float32"
    uniform = len(set(groups)) == 1 and len(set(neurons)) == 1
    if uniform:
        config["num_attention_heads"] = groups[0] * arch.n_rep
        config["num_key_value_heads"] = groups[0]
        config["intermediate_size"] = neurons[0]
        return config, False
    family = config["model_type"]
    config["model_type"] = f"elastify_{family}"
    config["elastify_family"] = family
    config["layer_heads"] = [g * arch.n_rep for g in groups]
    config["layer_kv_heads"] = list(groups)
    config["layer_intermediate"] = list(neurons)
    config["architectures"] = ["ElastifyForCausalLM"]
    config["auto_map"] = {"AutoConfig": f"{MODELING_FILE[:-3]}.ElastifyConfig",
                          "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.ElastifyForCausalLM"}
    return config, True


# The remote-code model of per-layer widths: the family's own model with each layer's projections
# resized. Written into the export as modeling_elastify.py (a string here: device_sdk itself never
# imports transformers).
MODELING_SOURCE = '''"""{family} with per-layer head, KV-head and FFN widths (an Elastify level export).

The family's own transformers model, each layer's projections resized to `layer_heads`,
`layer_kv_heads` and `layer_intermediate`; every layer keeps the model's query heads per KV head.
"""

from torch import nn
from transformers import {config_class} as BaseConfig
from transformers import {model_class} as BaseForCausalLM


class ElastifyConfig(BaseConfig):
    model_type = "elastify_{family}"

    def __init__(self, layer_heads=None, layer_kv_heads=None, layer_intermediate=None, **kwargs):
        self.layer_heads = layer_heads
        self.layer_kv_heads = layer_kv_heads
        self.layer_intermediate = layer_intermediate
        super().__init__(**kwargs)


class ElastifyForCausalLM(BaseForCausalLM):
    config_class = ElastifyConfig

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        for layer, heads, kv_heads, ffn in zip(self.model.layers, config.layer_heads, config.layer_kv_heads,
                                               config.layer_intermediate, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            head_dim = attn.head_dim
            attn.q_proj = _like(attn.q_proj, hidden, heads * head_dim)
            attn.k_proj = _like(attn.k_proj, hidden, kv_heads * head_dim)
            attn.v_proj = _like(attn.v_proj, hidden, kv_heads * head_dim)
            attn.o_proj = _like(attn.o_proj, heads * head_dim, hidden)
            mlp.gate_proj = _like(mlp.gate_proj, hidden, ffn)
            mlp.up_proj = _like(mlp.up_proj, hidden, ffn)
            mlp.down_proj = _like(mlp.down_proj, ffn, hidden)
        self.post_init()


def _like(linear, fan_in, fan_out):
    return nn.Linear(fan_in, fan_out, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)
'''

FAMILY_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                  "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def export_hf(package_dir: Path, out_dir: Path, *, level: Level | float | str | None = None,
              profile: str | None = None, dtype: str = "f32", merge: bool = True, force: bool = False) -> Path:
    """Write a directory `AutoModelForCausalLM.from_pretrained` loads (per-layer widths need
    `trust_remote_code=True`). With `merge=False` the level's LoRA is left out of the weights and
    written as a peft adapter under `out_dir/peft`. `out_dir` must be new or empty, or with `force`
    an earlier HF export (check_target); a failure leaves it as it was."""
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    if dtype not in HF_DTYPES:
        raise ExportError(f"HF export type must be one of {sorted(HF_DTYPES)}, not {dtype!r}")
    check_target(package_dir, out_dir, "hf", force=force)
    manifest = read_manifest(package_dir)
    selection = select(package_dir, manifest, level, profile)
    tensors = level_tensors(package_dir, manifest, selection, merge=merge)
    config, remote = hf_config(package_dir, manifest, selection)
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(HF_DTYPES[dtype]).removeprefix("torch.")
    config["elastify"] = {"package": manifest.name, "version": manifest.version, "selection": selection.label,
                          "lora_merged": merge and selection.adapter is not None}
    with staged_directory(out_dir) as stage:
        weights = {name: t.to(HF_DTYPES[dtype]).contiguous() for name, t in tensors.items()}
        if manifest.architecture.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        save_file(weights, str(stage / "model.safetensors"), metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if remote:
            family = config["elastify_family"]
            if family not in FAMILY_CLASSES:
                raise ExportError(f"no remote-code model for family {family!r}")
            config_class, model_class = FAMILY_CLASSES[family]
            (stage / MODELING_FILE).write_text(MODELING_SOURCE.format(family=family, config_class=config_class,
                                                                      model_class=model_class))
        for filename in TOKENIZER_FILES:
            source = package_dir / "model" / filename
            if source.is_file():
                shutil.copyfile(source, stage / filename)
        if not merge and selection.adapter is not None:
            write_peft_adapter(manifest, selection, stage / PEFT_DIR, base=out_dir)  # the final path, not the stage
        write_mark(stage, "hf", manifest, selection.label)
    return out_dir


# --------------------------------------------------------------------------- peft


def write_peft_adapter(manifest: Manifest, selection: Selection, out_dir: Path, base: Path | None = None) -> Path:
    """The selection's recovery adapter as a peft LoRA adapter (adapter_config.json and
    adapter_model.safetensors) for the selection's HF export: peft key names, the export's shapes.
    `base`: that export's directory, named as the adapter's base_model_name_or_path (None: not written yet)."""
    if selection.adapter is None:
        raise ExportError(f"{selection.label} has no recovery adapter")
    from safetensors import safe_open

    arch = manifest.architecture
    lora = read_adapter(selection.adapter)
    with safe_open(str(selection.adapter), framework="pt") as handle:
        meta = handle.metadata() or {}
    scale = adapter_scale(meta, selection.adapter.name)
    ranks = {a.shape[0] for a, _, _ in lora.values()}
    if len(ranks) != 1:
        raise ExportError(f"{selection.adapter.name} mixes LoRA ranks {sorted(ranks)}; peft needs one")
    rank = ranks.pop()
    q_rows, hd = arch.n_rep * arch.head_dim, arch.head_dim
    out_rows = {"q_proj": q_rows, "k_proj": hd, "v_proj": hd, "gate_proj": 1, "up_proj": 1}
    in_rows = {"o_proj": q_rows, "down_proj": 1}
    tensors = {}
    for key, (a, b, _) in lora.items():
        layer, proj = int(key.split(".")[2]), key.rsplit(".", 1)[1]
        width = (selection.written_attn if proj in PROJECTIONS[:4] else selection.written_mlp)[layer]
        if proj in out_rows:
            b = _pad(b, 0, width * out_rows[proj])
        else:
            a = _pad(a, 1, width * in_rows[proj])
        tensors[f"base_model.model.{key}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{key}.lora_B.weight"] = b.contiguous()
    targets = sorted({key.rsplit(".", 1)[1] for key in lora})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": None if base is None else str(base.resolve()),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def export_peft_adapters(package_dir: Path, out_dir: Path, *, force: bool = False) -> dict[str, Path]:
    """Every level's recovery adapter as a peft adapter under `out_dir/<level>/`, each for that
    level's unmerged HF export (`export_hf(..., merge=False)`). `out_dir` is written whole, as
    export_hf's is (check_target); a package without adapters writes nothing."""
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    check_target(package_dir, out_dir, "peft", force=force)
    manifest = read_manifest(package_dir)
    levels = [shape.name for shape in manifest.elastic.levels if shape.adapter is not None]
    if not levels:
        return {}
    with staged_directory(out_dir) as stage:
        for name in levels:
            write_peft_adapter(manifest, select(package_dir, manifest, level=name), stage / name)
        write_mark(stage, "peft", manifest)
    return {name: out_dir / name for name in levels}
