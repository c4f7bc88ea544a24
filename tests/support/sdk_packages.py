"""Signed packages of random weights for the device-SDK tests, written with device_sdk alone (no pipeline,
no transformers), and what the tests do with them: adapters, a TLM, a registry directory, a server.

Random weights need no importance order (any order of a layer's units is a valid unit-major order),
so a package is written straight in the stored layout, and its levels keep a stated share of each
layer's units. Packages that the pipeline builds from HF models are tests/support/pipeline_packages.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from datetime import UTC, datetime
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from device_sdk.format import (
    MANIFEST,
    Architecture,
    Elastic,
    ElasticTensor,
    LevelShape,
    atomic_write_bytes,
    canonical_json,
    parse_levels,
    read_manifest,
    rewrite_manifest,
    sign_manifest,
)
from device_sdk.lora import ATTN_PROJECTIONS, PROJECTIONS, projection_key
from device_sdk.package import write_package
from device_sdk.tlm import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, slo_token_names
from tests.support.tiny import byte_level_tokenizer

LEVELS = [0.25, 0.5, 0.75, 1.0]


def signing_key(seed: int = 7) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign_package(package_dir: Path, key: Ed25519PrivateKey) -> None:
    manifest = read_manifest(package_dir)
    rewrite_manifest(package_dir, manifest)  # refresh the file table first
    sign_manifest(manifest, key)
    atomic_write_bytes(Path(package_dir) / MANIFEST, canonical_json(manifest.to_dict()))


# ----------------------------------------------------------------------------- random packages

# tests/support/tiny.py's shapes (hidden 64, 96 neurons, 256 byte tokens), one per family the SDK runs.
RANDOM_KINDS = {
    "llama_mha": dict(family="llama", heads=4, kv_heads=4, tie_word_embeddings=True),
    "llama_gqa": dict(family="llama", heads=8, kv_heads=4, tie_word_embeddings=True),
    "mistral": dict(family="mistral", heads=4, kv_heads=2, tie_word_embeddings=True),
    "qwen2_bias": dict(family="qwen2", heads=4, kv_heads=2, attention_bias=True),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ANCHORS = [0]  # layer 0 never shrinks, so every level has an anchor and a layer that does


def random_architecture(kind: str, layers: int = 4, **overrides) -> Architecture:
    """One of RANDOM_KINDS; `overrides` are Architecture fields (e.g. sliding_window, rope)."""
    shape = RANDOM_KINDS[kind]
    fields = dict(layers=layers, hidden=64, head_dim=64 // shape["heads"], intermediate=96, vocab=256,
                  norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 10000.0}, max_position=256)
    return Architecture(**{**fields, **shape, **overrides})


def unit_layout(arch: Architecture) -> dict[str, ElasticTensor]:
    """How every elastic tensor is cut into units: a KV group's q/k/v rows (o_proj's columns, stored
    transposed), one neuron's gate/up row (down_proj's column); q/k/v biases by group."""
    q_rows, hd = arch.n_rep * arch.head_dim, arch.head_dim
    rows = {"q_proj": q_rows, "k_proj": hd, "v_proj": hd, "o_proj": q_rows}
    layout = {}
    for layer in range(arch.layers):
        for proj in PROJECTIONS:
            attn, transposed = proj in ATTN_PROJECTIONS, proj in ("o_proj", "down_proj")
            spec = ElasticTensor(layer=layer, unit="attn" if attn else "mlp", rows_per_unit=rows.get(proj, 1),
                                 transposed=transposed)
            base = projection_key(layer, proj)
            layout[f"{base}.weight_t" if transposed else f"{base}.weight"] = spec
            if arch.attention_bias and attn and not transposed:
                layout[f"{base}.bias"] = spec
    return layout


def random_weights(arch: Architecture, layout: dict[str, ElasticTensor], seed: int) -> dict[str, torch.Tensor]:
    """HF's initialisation (N(0, 0.02) matrices, unit norms), biases N(0, 0.5) so that they matter."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    weights = {"model.embed_tokens.weight": normal(arch.vocab, arch.hidden), "model.norm.weight": torch.ones(arch.hidden)}
    if not arch.tie_word_embeddings:
        weights["lm_head.weight"] = normal(arch.vocab, arch.hidden)
    for layer in range(arch.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{layer}.{norm}.weight"] = torch.ones(arch.hidden)
    for name, spec in layout.items():
        rows = (arch.kv_heads if spec.unit == "attn" else arch.intermediate) * spec.rows_per_unit
        weights[name] = normal(rows, std=0.5) if name.endswith(".bias") else normal(rows, arch.hidden)
    return weights


def kept_units(total: int, ratio: float) -> int:
    """A level's share of one layer's units: `ratio` of them, at least one."""
    return total if ratio >= 1.0 else max(1, round(ratio * total))


def random_levels(arch: Architecture, layout: dict[str, ElasticTensor], weights: dict[str, torch.Tensor],
                  levels, anchors: list[int]) -> list[LevelShape]:
    """Each level keeps `kept_units` of every layer but the anchors, which stay whole; its active
    parameters are the kept rows of the elastic tensors plus the norms and the LM head."""

    def active(attn: list[int], mlp: list[int]) -> int:
        count = arch.vocab * arch.hidden + arch.hidden * (1 + 2 * arch.layers)
        for name, spec in layout.items():
            units = (attn if spec.unit == "attn" else mlp)[spec.layer]
            count += units * spec.rows_per_unit * weights[name][0].numel()
        return count

    full = active([arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers)
    shapes = []
    for level in parse_levels(levels):
        ratios = [1.0 if layer in anchors else level.ratio for layer in range(arch.layers)]
        attn = [kept_units(arch.kv_heads, ratio) for ratio in ratios]
        mlp = [kept_units(arch.intermediate, ratio) for ratio in ratios]
        count = active(attn, mlp)
        shapes.append(LevelShape(name=level.name, ratio=level.ratio, attn_units=attn, mlp_units=mlp,
                                 active_params=count, active_fraction=round(count / full, 6)))
    return shapes


def hf_config(arch: Architecture) -> dict:
    """The package's model/config.json, as the HF config of the same model would say it."""
    return {
        "architectures": [HF_CLASSES[arch.family]], "model_type": arch.family, "hidden_act": "silu",
        "hidden_size": arch.hidden, "intermediate_size": arch.intermediate, "num_hidden_layers": arch.layers,
        "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads, "head_dim": arch.head_dim,
        "vocab_size": arch.vocab, "rms_norm_eps": arch.norm_eps, "rope_parameters": dict(arch.rope),
        "max_position_embeddings": arch.max_position, "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias, "mlp_bias": arch.mlp_bias, "sliding_window": arch.sliding_window,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def byte_tokenizer_json() -> bytes:
    """tests/support/tiny.py's byte-level tokenizer, byte 0 its special end token, as tokenizer.json."""
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(["\x00"])
    return tokenizer.to_str().encode()


DTYPES = {"float32": torch.float32, "float16": torch.float16}


def random_package(kind: str, out_dir: Path, key: Ed25519PrivateKey | None, *, name: str = "tiny",
                   version: str = "1.0.0", levels=LEVELS, anchors: list[int] = ANCHORS, dtype: str = "float32",
                   seed: int = 1, tlm: Path | None = None, **arch_overrides) -> Path:
    """A package of random weights of one of RANDOM_KINDS, signed with `key` (None: unsigned);
    `tlm`: a TLM directory (`random_tlm`) to ship in the package's tlm/. (Seed 1 by default: under
    seed 0 the GQA model's runner-up after "abc" is byte 0, the end token, which decodes to nothing.)"""
    arch = random_architecture(kind, **arch_overrides)
    layout = unit_layout(arch)
    weights = random_weights(arch, layout, seed)
    elastic = Elastic(anchor_layers=list(anchors), attn_units=[arch.kv_heads] * arch.layers,
                      mlp_units=[arch.intermediate] * arch.layers,
                      levels=random_levels(arch, layout, weights, levels, anchors), tensors=layout,
                      importance={"method": "random"})
    fields = {"name": name, "version": version, "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "build_id": None, "source": {}}
    extra_files = {}
    if tlm is not None:
        fields["tlm"] = tlm_section(Path(tlm))
        extra_files = {f"tlm/{path.relative_to(tlm)}": path for path in sorted(Path(tlm).rglob("*")) if path.is_file()}
    write_package(out_dir, manifest_fields=fields, architecture=arch, elastic=elastic,
                  weights={k: v.to(DTYPES[dtype]) for k, v in weights.items()},
                  model_files={"config.json": json.dumps(hf_config(arch), indent=2).encode(),
                               "tokenizer.json": byte_tokenizer_json()},
                  extra_files=extra_files)
    if key is not None:
        sign_package(out_dir, key)
    return Path(out_dir)


# ----------------------------------------------------------------------------- random TLMs

TLM_HIDDEN = 32
TLM_RATIOS = [0.3, 0.5, 0.7, 1.0]
TLM_TTFT_BINS = [0.2, 0.4, 0.6, 0.8, 1.0]
TLM_TPOT_BINS = [0.5, 0.8, 1.0]
TLM_WORDS = "the a is of and to in which what one two three four five six seven eight nine ten ? .".split()


def _tlm_tokenizer(slo_tokens: list[str]) -> bytes:
    """A BERT-style word tokenizer ([CLS] … [SEP]; unknown words are [UNK]) with the SLO tokens whole."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + TLM_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.add_special_tokens(specials + slo_tokens)
    return tokenizer.to_str().encode()


def random_tlm(out_dir: Path, levels: list[str], *, heads: dict[str, torch.Tensor] | None = None, layers: int = 4,
               frozen_layers: int = 3, max_length: int = 64, seed: int = 0) -> Path:
    """A TLM directory (tlm_config.json, tlm.safetensors, tokenizer.json) with a random BERT encoder
    and heads; `heads` replaces tensors by name (e.g. "level_head.bias") to fix what it decides."""
    generator = torch.Generator().manual_seed(seed)
    slo_tokens = slo_token_names(TLM_TTFT_BINS, TLM_TPOT_BINS)
    vocab, width, inner = 4 + len(TLM_WORDS) + len(slo_tokens), TLM_HIDDEN, 2 * TLM_HIDDEN

    def linear(name: str, fan_out: int, fan_in: int) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": torch.randn(fan_out, fan_in, generator=generator) * 0.2,
                f"{name}.bias": torch.randn(fan_out, generator=generator) * 0.02}

    def norm(name: str) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": torch.ones(width), f"{name}.bias": torch.zeros(width)}

    tensors = {"embeddings.word_embeddings.weight": torch.randn(vocab, width, generator=generator),
               "embeddings.position_embeddings.weight": torch.randn(max_length, width, generator=generator),
               "embeddings.token_type_embeddings.weight": torch.randn(2, width, generator=generator),
               **norm("embeddings.LayerNorm")}
    branch = [*(f"trunk.{i}." for i in range(frozen_layers)),
              *(f"{stack}.{i}." for stack in ("score_layers", "decision_layers") for i in range(layers - frozen_layers))]
    for prefix in branch:
        for part in ("query", "key", "value"):
            tensors |= linear(f"{prefix}attention.self.{part}", width, width)
        tensors |= linear(f"{prefix}attention.output.dense", width, width) | norm(f"{prefix}attention.output.LayerNorm")
        tensors |= linear(f"{prefix}intermediate.dense", inner, width)
        tensors |= linear(f"{prefix}output.dense", width, inner) | norm(f"{prefix}output.LayerNorm")
    tensors |= linear("score_head", 2, width) | linear("ratio_head", len(TLM_RATIOS), width)
    tensors |= linear("level_head", len(levels), width) | dict(heads or {})
    config = {"backbone": {"model_type": "bert", "hidden_size": width, "num_hidden_layers": layers,
                           "num_attention_heads": 2, "intermediate_size": inner, "hidden_act": "gelu",
                           "max_position_embeddings": max_length, "vocab_size": vocab, "layer_norm_eps": 1e-12},
              "frozen_layers": frozen_layers, "max_length": max_length, "ratio_grid": TLM_RATIOS,
              "level_grid": list(levels), "ttft_bins": TLM_TTFT_BINS, "tpot_bins": TLM_TPOT_BINS,
              "slo_tokens": slo_tokens, "decision_head": "slo_token"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / WEIGHTS_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (out_dir / TOKENIZER_FILE).write_bytes(_tlm_tokenizer(slo_tokens))
    return out_dir


def tlm_section(tlm_dir: Path) -> dict:
    """The manifest's `tlm` field for a TLM shipped under the package's tlm/."""
    config = json.loads((tlm_dir / CONFIG_FILE).read_text())
    return {"config": f"tlm/{CONFIG_FILE}", "weights": f"tlm/{WEIGHTS_FILE}", "prompt_ratios": config["ratio_grid"],
            "levels": config["level_grid"], "slo_bins": {"ttft": config["ttft_bins"], "tpot": config["tpot_bins"]},
            "special_tokens": config["slo_tokens"], "frozen_layers": config["frozen_layers"],
            "decision_head": config["decision_head"]}

def fixed_profile_model(package_dir: Path):
    """The package's ElasticModel with a fixed latency profile (level i: TTFT base 10(i+1) ms, 0.1(i+1) ms
    a prompt token, TPOT i+1 ms), so SLO decisions do not depend on how busy the test machine is (nor
    recalibrate from the requests the test serves)."""
    from device_sdk.latency import Drift, LatencyProfile, LevelLatency
    from device_sdk.runtime import ElasticModel

    model = ElasticModel.load(package_dir, allow_unsigned=True)
    model.latency_profile = LatencyProfile(
        "fp32", 1, {name: LevelLatency(10.0 * (i + 1), 0.1 * (i + 1), 1.0 * (i + 1))
                    for i, name in enumerate(model.available_levels())}, drift=Drift(quantile=None))
    return model


def add_recovery_adapters(package_dir: Path, key: Ed25519PrivateKey, rank: int = 2, seed: int = 0) -> None:
    """A random LoRA per level (A [r, in_active], B [out_active, r]) on every projection."""
    manifest = read_manifest(package_dir)
    arch, generator = manifest.architecture, torch.Generator().manual_seed(seed)
    hd, q_rows = arch.head_dim, arch.n_rep * arch.head_dim
    for level in manifest.elastic.levels:
        tensors = {}
        for layer, (groups, neurons) in enumerate(zip(level.attn_units, level.mlp_units, strict=True)):
            shapes = {
                "self_attn.q_proj": (arch.hidden, groups * q_rows),
                "self_attn.k_proj": (arch.hidden, groups * hd),
                "self_attn.v_proj": (arch.hidden, groups * hd),
                "self_attn.o_proj": (groups * q_rows, arch.hidden),
                "mlp.gate_proj": (arch.hidden, neurons),
                "mlp.up_proj": (arch.hidden, neurons),
                "mlp.down_proj": (neurons, arch.hidden),
            }
            for proj, (fan_in, fan_out) in shapes.items():
                base = f"model.layers.{layer}.{proj}"
                tensors[f"{base}.lora_A"] = torch.randn(rank, fan_in, generator=generator) * 0.1
                tensors[f"{base}.lora_B"] = torch.randn(fan_out, rank, generator=generator) * 0.1
        level.adapter = f"adapters/recovery/{level.name}.safetensors"
        path = Path(package_dir) / level.adapter
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"alpha": "4", "rank": str(rank)})
    rewrite_manifest(package_dir, manifest)
    sign_package(package_dir, key)


def publish(package_dir: Path, registry: Path, name: str = "tiny", version: str = "1.0.0", alias: str = "latest") -> Path:
    """Lay a package out in a registry directory as pull expects it."""
    target = Path(registry) / "packages" / name / version
    shutil.copytree(package_dir, target)
    alias_file = Path(registry) / "packages" / name / "aliases" / alias
    alias_file.parent.mkdir(parents=True, exist_ok=True)
    alias_file.write_text(version)
    return target



@contextlib.contextmanager
def serving(model, **options):
    """`elastify-device serve`'s server for `model` on a free port in a thread; yields the port."""
    from device_sdk.serve import make_server

    server = make_server(model, port=0, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- running a model


def token_ids(vocab: int, length: int = 24, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode_both_ways(model, ids, prefill: int):
    """Logits of ids[:, prefill:] decoded one token at a time (native step when the model has
    one), and the same positions from the reference forward over the whole sequence."""
    transformer, decoder = model.transformer, model.transformer.decoder
    with torch.inference_mode():
        cache = transformer.new_cache(ids.shape[1])
        transformer(ids[:, :prefill], cache)
        steps = torch.cat([transformer(ids[:, i : i + 1], cache) for i in range(prefill, ids.shape[1])], dim=1)
        transformer.decoder = None
        try:
            reference = transformer(ids)[:, prefill:]
        finally:
            transformer.decoder = decoder
    return steps, reference
