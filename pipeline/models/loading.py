"""Model adapter: load a Llama-family causal LM from a local HF directory or a GGUF file.

Only Llama, Mistral and Qwen2 (MHA or GQA, tied or untied embeddings, Qwen2's q/k/v biases)
are accepted; anything else is refused before any weight is read.

Models load in the source's own dtype when it is bf16 or fp16 (`dtype="auto"`, the default: a 7B
model is 14 GB in bf16, 27 GB in fp32), else in fp32. `open_weights` reads an HF directory's
safetensors one tensor at a time, for stages that never need the whole model in memory (elastify).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from device_sdk.format import Architecture, safetensors_layout
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
# The half-precision dtypes a source may be stored in that stages keep (anything else loads as fp32).
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_HALF = {"BF16": torch.bfloat16, "F16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, **SAFETENSORS_HALF}
LoadDType = torch.dtype | Literal["auto"]


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
    except (LookupError, ValueError, OSError, OverflowError, MemoryError) as err:
        # gguf's reader trusts the header's counts and lengths: a truncated file or an absurd count
        # surfaces as numpy's IndexError/ValueError, a short read as OSError. All are permanent.
        raise ModelLoadError(f"{path} is not a readable GGUF file: {type(err).__name__}: {err}") from None
    if family not in GGUF_FAMILIES:
        raise ModelLoadError(f"unsupported GGUF architecture {family!r}; {supported_message()}")
    return GGUF_FAMILIES[family]


def source_dtype(source: str | Path) -> torch.dtype:
    """The dtype a source is stored in when that is bf16 or fp16, else fp32.

    An HF directory says it in config.json (`dtype`, or `torch_dtype` before transformers 5), else
    its first safetensors header does. A GGUF file is quantized or fp32: it dequantizes to fp32.
    """
    path = Path(source)
    if not path.is_dir():
        return torch.float32
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str):
        return HALF_DTYPES.get(named.removeprefix("torch."), torch.float32)
    files = safetensors_files(path)
    if files:
        stored = {info["dtype"] for info in safetensors_layout(files[0])[1].values()}
        if len(stored) == 1 and (only := stored.pop()) in SAFETENSORS_HALF:
            return SAFETENSORS_HALF[only]
    return torch.float32


def resolve_dtype(source: str | Path, dtype: LoadDType) -> torch.dtype:
    return source_dtype(source) if dtype == "auto" else dtype


def load_model(source: str | Path, dtype: LoadDType = "auto") -> LoadedModel:
    """Load model and tokenizer in eval mode, in the source's dtype when it is bf16/fp16, else fp32
    (`dtype="auto"`); a torch dtype pins it. Never touches a model hub."""
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
    dtype = resolve_dtype(path, dtype)
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


@dataclass
class SourceWeights:
    """An HF directory's safetensors weights, read one tensor at a time: the whole model is never in memory.

    Tensors are read with plain file reads at the header's offsets into one reused buffer, not through a
    memory map: every page of a map that has been read stays resident (RSS) until it is unmapped, so
    mapping would bring the whole file into the stage's resident memory by the last tensor.
    """

    config: Any  # the transformers config
    tokenizer: Any
    architecture: Architecture
    source: dict[str, Any]  # as LoadedModel.source
    dtype: torch.dtype  # what `source_dtype` says the weights are stored in
    shapes: dict[str, list[int]]  # every tensor the model uses, by its state-dict name
    _where: dict[str, tuple[Any, int, int, str]]  # name -> (open file, absolute begin, end, safetensors dtype)
    _buffer: torch.Tensor | None = None

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read into this object's buffer: valid until the next call (copy it to keep it)."""
        handle, begin, end, stored = self._where[name]
        size = end - begin
        if self._buffer is None or self._buffer.numel() < size:
            largest = max(e - b for _, b, e, _ in self._where.values())
            self._buffer = torch.empty(largest, dtype=torch.uint8)
        view = memoryview(self._buffer.numpy())[:size]
        handle.seek(begin)
        done = 0
        while done < size:
            count = handle.readinto(view[done:])
            if not count:
                raise ModelLoadError(f"{handle.name} ends inside tensor {name}")
            done += count
        return self._buffer[:size].view(SAFETENSORS_DTYPES[stored]).reshape(self.shapes[name])


def safetensors_files(path: Path) -> list[Path]:
    """The directory's safetensors weight files: model.safetensors, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [path / name for name in sorted(set(weight_map.values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []


@contextmanager
def open_weights(source: str | Path) -> Iterator[SourceWeights | None]:
    """The source's weights as `SourceWeights`, or None where they cannot be read tensor by tensor (a GGUF
    file, pickled .bin weights, or safetensors whose names, shapes or dtypes are not the model's own):
    load_model it then."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


    path = Path(source)
    if not path.is_dir():
        yield None
        return
    check_hf_dir(path)
    files = safetensors_files(path)
    if not files:
        yield None
        return
    try:
        config = AutoConfig.from_pretrained(str(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        with torch.device("meta"):  # the names and shapes the model expects, without allocating it
            expected = {k: list(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    except Exception as err:  # transformers raises its own kinds
        raise ModelLoadError(f"could not read {path}: {type(err).__name__}: {err}") from None
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    where: dict[str, tuple[Any, int, int, str]] = {}
    shapes: dict[str, list[int]] = {}
    with ExitStack() as files_open:
        for file in files:
            data_start, header = safetensors_layout(file)
            handle = files_open.enter_context(open(file, "rb", buffering=0))
            for name, info in header.items():
                if name in expected and info["dtype"] in SAFETENSORS_DTYPES:
                    begin, end = (data_start + offset for offset in info["data_offsets"])
                    where[name] = (handle, begin, end, info["dtype"])
                    shapes[name] = list(info["shape"])
        if shapes != expected:  # renamed, missing or reshaped tensors: transformers' loader knows better
            yield None
            return
        yield SourceWeights(
            config=config,
            tokenizer=tokenizer,
            architecture=describe_architecture(config),
            source={"model": str(path), "revision": None, "sha256": weights_digest(path)},
            dtype=source_dtype(path),
            shapes=shapes,
            _where=where,
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
