"""A level (or CLONE profile) of a package as one GGUF file that llama.cpp runs at its real widths.

Uniform widths are written as a plain `llama` model. Per-layer widths use llama.cpp's `deci`
architecture (made for per-layer-pruned Llamas): its graph reads each layer's head, KV-head and
FFN count from per-layer arrays in `head_count`, `head_count_kv` and `feed_forward_length`,
where `llama`'s graph uses layer 0's counts for every layer. Both run rotary embeddings on
interleaved pairs, so q/k rows are permuted from HF's rotate-half layout, as llama.cpp's own
converter does. The writer is llama.cpp's `gguf` package, an optional dependency
(`pip install 'elastify-device[export]'`), imported only here.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch

from device_sdk.export import ExportError, check_target, level_tensors, select
from device_sdk.format import CONFIG, Level, read_manifest
from device_sdk.llama import rope_inv_freq

GGUF_TYPES = ("f32", "f16", "q8_0")
QK8_0 = 32  # Q8_0 quantizes rows in blocks of 32; a row of another length stays F16
EXPORT_KEY = "elastify.export"  # marks the files this module writes, so that --force can tell them apart

# HF tensor name (after `model.layers.<i>.`) -> llama.cpp's.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}

# Pre-tokenizer regexes of tokenizer.json, by llama.cpp's name for them.
SPLIT_REGEX_PRE = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def _gguf():
    try:
        import gguf  # lazy: the optional `export` extra, needed only to write GGUF
    except ImportError:
        raise ExportError("GGUF export needs llama.cpp's `gguf` package: pip install 'elastify-device[export]' "
                          "(or `pip install gguf`)") from None
    return gguf


def export_gguf(package_dir: Path, out_path: Path, *, level: Level | float | str | None = None,
                profile: str | None = None, dtype: str = "f16", force: bool = False) -> Path:
    """Write the level's (or profile's) dense weights, LoRA merged in, and the tokenizer as GGUF.
    `out_path` must be new, or with `force` an earlier GGUF export (check_target). It is written as a
    hidden .partial file renamed into place, which a failure removes."""
    gguf = _gguf()
    if dtype not in GGUF_TYPES:
        raise ExportError(f"GGUF type must be one of {GGUF_TYPES}, not {dtype!r}")
    package_dir, out_path = Path(package_dir), Path(out_path)
    check_target(package_dir, out_path, "gguf", force=force, is_export=lambda path: is_gguf_export(gguf, path))
    manifest = read_manifest(package_dir)
    selection = select(package_dir, manifest, level, profile)
    arch = manifest.architecture
    config = json.loads((package_dir / CONFIG).read_text())
    tensors = level_tensors(package_dir, manifest, selection)
    heads = [groups * arch.n_rep for groups in selection.written_attn]
    kv_heads = list(selection.written_attn)
    ffn = list(selection.written_mlp)
    uniform = len(set(heads)) == 1 and len(set(ffn)) == 1
    arch_name = "llama" if uniform else "deci"

    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(f".{out_path.name}.partial")
    writer = None
    try:
        writer = gguf.GGUFWriter(str(partial), arch_name)
        writer.add_name(f"{manifest.name} {manifest.version} {selection.label}")
        writer.add_string(EXPORT_KEY, json.dumps({"package": manifest.name, "version": manifest.version,
                                                  "selection": selection.label}))
        writer.add_context_length(arch.max_position)
        writer.add_embedding_length(arch.hidden)
        writer.add_block_count(arch.layers)
        writer.add_head_count(heads[0] if uniform else heads)
        writer.add_head_count_kv(kv_heads[0] if uniform else kv_heads)
        writer.add_feed_forward_length(ffn[0] if uniform else ffn)
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
        writer.add_rope_dimension_count(arch.head_dim)
        writer.add_rope_freq_base(float(arch.rope.get("rope_theta", 10000.0)))
        writer.add_layer_norm_rms_eps(arch.norm_eps)
        writer.add_vocab_size(arch.vocab)
        file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        rope_kind = arch.rope.get("rope_type", arch.rope.get("type", "default"))
        if rope_kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(arch.rope["factor"]))
        elif rope_kind == "llama3":  # llama.cpp divides each frequency by its factor from this tensor
            base = 1.0 / (float(arch.rope.get("rope_theta", 10000.0))
                          ** (torch.arange(0, arch.head_dim, 2, dtype=torch.int64).float() / arch.head_dim))
            tensors["rope_freqs.weight"] = base / rope_inv_freq(arch)
        _add_tokenizer(gguf, writer, package_dir, config, arch.vocab)

        for name, tensor in tensors.items():
            gguf_name, array = _gguf_tensor(name, tensor, heads, kv_heads, arch.head_dim)
            _add_tensor(gguf, writer, gguf_name, array, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        if writer is not None:
            with contextlib.suppress(Exception):  # the error being raised is the one to report
                writer.close()
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out_path)
    return out_path


def is_gguf_export(gguf, path: Path) -> bool:
    """Whether `path` is a GGUF file this module wrote (its EXPORT_KEY); anything unreadable is not."""
    try:
        return EXPORT_KEY in gguf.GGUFReader(str(path)).fields
    except Exception:  # GGUFReader raises ValueError, IndexError, KeyError or OSError on foreign bytes
        return False


def _gguf_tensor(name: str, tensor: torch.Tensor, heads: list[int], kv_heads: list[int], head_dim: int):
    """(llama.cpp's name, the fp32 array) of one HF tensor; q/k permuted to interleaved rotary pairs."""
    if name in TOP_NAMES:
        return TOP_NAMES[name], tensor.numpy()
    if name == "rope_freqs.weight":
        return name, tensor.float().numpy()
    _, _, layer, rest = name.split(".", 3)
    layer = int(layer)
    base, kind = rest.rsplit(".", 1)
    mapped = LAYER_NAMES.get(rest) or f"{LAYER_NAMES[base]}.{kind}"
    if base in ("self_attn.q_proj", "self_attn.k_proj"):
        tensor = _rotary_pairs(tensor, heads[layer] if base.endswith("q_proj") else kv_heads[layer], head_dim)
    return f"blk.{layer}.{mapped}", tensor.contiguous().numpy()


def _rotary_pairs(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Within each head, rows (x0..x_{d/2-1}, y0..) become (x0, y0, x1, y1, …)."""
    shape = rows.shape
    return rows.reshape(heads, 2, head_dim // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _add_tensor(gguf, writer, name: str, array: np.ndarray, dtype: str) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 1 or dtype == "f32":  # norms, biases and rope factors stay F32, as llama.cpp expects
        writer.add_tensor(name, array)
    elif dtype == "q8_0" and array.shape[-1] % QK8_0 == 0:
        quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor(name, array.astype(np.float16))


def _add_tokenizer(gguf, writer, package_dir: Path, config: dict, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's `gpt2` tokenizer (the one SmolLM, Llama 3 and
    Qwen2 use); other tokenizers are refused rather than written wrong."""
    path = package_dir / "model" / "tokenizer.json"
    data = json.loads(path.read_text())
    model = data.get("model", {})
    if model.get("type") != "BPE" or not _is_byte_level(data.get("pre_tokenizer")):
        raise ExportError(f"{path.name}: only byte-level BPE tokenizers export to GGUF so far "
                          f"(this one is {model.get('type')} with pre-tokenizer {_kind(data.get('pre_tokenizer'))})")
    tokens: list[str | None] = [None] * vocab_size
    types = [gguf.TokenType.NORMAL] * vocab_size
    for token, index in model["vocab"].items():
        if index < vocab_size:
            tokens[index] = token
    for added in data.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    for index, token in enumerate(tokens):
        if token is None:  # embedding rows the tokenizer never produces
            tokens[index] = f"[PAD{index}]"
            types[index] = gguf.TokenType.UNUSED
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(data.get("pre_tokenizer"), path.name))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            add(value)
    writer.add_add_bos_token(_adds_bos(data.get("post_processor")))
    template = package_dir / "model" / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def _kind(node) -> str:
    return "none" if not node else node.get("type", "?")


def _is_byte_level(pre) -> bool:
    if not pre:
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers", []))


def _pre_tokenizer(pre: dict, where: str) -> str:
    """llama.cpp's name for the text splitting a byte-level tokenizer does before BPE."""
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = pre.get("pretokenizers", [])
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and kinds[-1] == "ByteLevel" and not parts[-1].get("use_regex", True):
        name = SPLIT_REGEX_PRE.get(splits[0].get("pattern", {}).get("Regex"))
        if name:
            return name
    raise ExportError(f"{where}: llama.cpp has no pre-tokenizer known to match {json.dumps(pre)[:200]}")


def _adds_bos(post) -> bool:
    """Whether the tokenizer puts a special token before every single sequence it encodes."""
    if not post:
        return False
    if post.get("type") == "Sequence":
        return any(_adds_bos(p) for p in post.get("processors", []))
    if post.get("type") == "TemplateProcessing":
        single = post.get("single", [])
        return bool(single) and "SpecialToken" in single[0]
    return False
