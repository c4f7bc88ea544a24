"""Model adapter: load a Llama-family causal LM from a local HF directory or a GGUF file.

Only Llama, Mistral and Qwen2 (MHA or GQA, tied or untied embeddings, Qwen2's q/k/v biases)
are accepted; anything else is refused before any weight is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from device_sdk.format import Architecture
from pipeline.errors import PipelineError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# GGUF names its family in general.architecture; Mistral GGUFs say "llama".
GGUF_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Any one of these sets is a tokenizer transformers can load offline (fast JSON, SentencePiece, BPE vocab + merges).
# Without one, AutoTokenizer says "You need to have sentencepiece or tiktoken installed" and calibration counts 0 tokens.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


class ModelLoadError(PipelineError):
    """The source model is missing, unreadable or not a supported architecture."""


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel in eval mode
    tokenizer: Any
    architecture: Architecture
    source: dict[str, Any]  # model id, revision, sha256 of the weights


def supported_message() -> str:
    return "supported architectures: " + ", ".join(sorted(SUPPORTED_ARCHITECTURES))


def check_hf_dir(path: Path) -> str:
    """Validate an HF model directory without loading weights; return its architecture class name."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; expected an HF model directory or a .gguf file")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{config_path} is not valid JSON: {err}") from None
    architectures = config.get("architectures") or []
    name = architectures[0] if architectures else f"model_type={config.get('model_type')!r}"
    if name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {name}; {supported_message()}")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ModelLoadError(f"{path} has no weights (looked for {', '.join(WEIGHT_FILES)})")
    if not any(all((path / f).is_file() for f in files) for files in TOKENIZER_FILES):
        looked = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise ModelLoadError(f"{path} has no tokenizer (looked for {looked}); copy the model's tokenizer files into it")
    return name


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        family = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, OSError) as err:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {err}") from None
    if family not in GGUF_FAMILIES:
        raise ModelLoadError(f"unsupported GGUF architecture {family!r}; {supported_message()}")
    return GGUF_FAMILIES[family]


def load_model(source: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load model and tokenizer in eval mode, fp32 by default. Never touches a model hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        arch_name = gguf_architecture(path)
        kwargs = {"gguf_file": path.name}
        directory = path.parent
    elif path.is_dir():
        arch_name = check_hf_dir(path)
        kwargs = {}
        directory = path
    else:
        raise ModelLoadError(f"{path} is neither an HF model directory nor a .gguf file")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **kwargs)
    except Exception as err:  # safetensors, torch and transformers each raise their own kinds
        raise ModelLoadError(f"could not load weights from {path}: {type(err).__name__}: {err}") from None
    if type(model).__name__ != arch_name:
        raise ModelLoadError(f"{path} loaded as {type(model).__name__}, expected {arch_name}")
    if "gguf_file" in kwargs:
        # A dequantized GGUF model is a plain fp model; drop the quantizer so it saves as safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        architecture=describe_architecture(model.config),
        source={"model": str(path), "revision": None, "sha256": weights_digest(path)},
    )


def describe_architecture(config) -> Architecture:
    arch_name = (config.architectures or [None])[0] or {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }.get(config.model_type)
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch_name}; {supported_message()}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    family = SUPPORTED_ARCHITECTURES[arch_name]
    return Architecture(
        family=family,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        norm_eps=float(config.rms_norm_eps),
        rope=rope,
        attention_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position=int(config.max_position_embeddings),
        sliding_window=getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None,
    )


def weights_digest(path: Path) -> str:
    """sha256 over the weight files (one GGUF, or every weight shard of an HF dir, in name order)."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")
    )
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def decoder_layers(model) -> list:
    return list(model.model.layers)


def save_hf(model, tokenizer, out_dir: Path) -> None:
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
