"""Stage `recover`: one LoRA per level, trained on that level's zero-copy sub-model (DESIGN §5.3).

The sub-model is the package's HF skeleton whose seven projections are plain `nn.Linear`
modules whose weights are *views* of the unit-major storage prefix (o/down: the transposed
view), so peft wraps ordinary linears and no weight is copied. Because the kept units are
already the storage prefix, the LoRA is born in the package layout: A [r, in_active],
B [out_active, r], exactly what `adapters/recovery/<level>.safetensors` holds.

Data is an LM corpus (plain next-token loss) or instruction data in alpaca
(`instruction`/`input`/`output`) or chat (`messages`) JSONL, with loss on responses only.
The torch loop is the default; `backend: deepspeed` runs the same step under ZeRO.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from device_sdk.elastic import ElasticLinear
from device_sdk.format import atomic_write_bytes, read_manifest, rewrite_manifest
from pipeline.calibration import make_windows
from pipeline.contract import StageSettings
from pipeline.elastic_model import ATTN_PROJ, MLP_PROJ, ElasticCausalLM
from pipeline.settings import RecoverSettings
from pipeline.stage import StageContext

PROJECTIONS = ATTN_PROJ + MLP_PROJ
IGNORE = -100  # label of prompt and padding tokens: no loss
ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)


class RecoverError(ValueError):
    """Recovery settings or data that cannot train a level's LoRA."""


# --------------------------------------------------------------------------- the sub-model


def linear_view(module: ElasticLinear) -> nn.Linear:
    """An `nn.Linear` over the active prefix of an ElasticLinear's storage: a view, never a copy."""
    weight = module.active_weight if module.unit_axis == "out" else module.active_weight.t()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if module.active_bias is not None:
        linear.bias = nn.Parameter(module.active_bias, requires_grad=False)
    return linear


def level_submodel(model: ElasticCausalLM, level: str) -> nn.Module:
    """The HF model at `level` with plain-linear views in place of the elastic projections.

    Consumes `model`: its layers now hold fixed-width views (the storage is still shared).
    """
    model.set_level(level)
    for layer in model.hf.model.layers:
        attn = layer.self_attn.inner
        for proj in ATTN_PROJ:
            setattr(attn, proj, linear_view(getattr(attn, proj)))
        for proj in MLP_PROJ:
            setattr(layer.mlp, proj, linear_view(getattr(layer.mlp, proj)))
    for param in model.hf.parameters():
        param.requires_grad_(False)
    return model.hf


def lora_target_names(hf: nn.Module, targets: list[str]) -> list[str]:
    """Full module names of the targeted projections that have a non-zero width at this level."""
    names = []
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and module.weight.numel() > 0:
            names.append(name)
    return names


def add_lora(hf: nn.Module, settings: RecoverSettings):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=lora_target_names(hf, settings.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(hf, config)


# --------------------------------------------------------------------------- data


def _alpaca_prompt(row: dict) -> str:
    extra = str(row.get("input") or "").strip()
    return ALPACA_PROMPT.format(
        with_input=", paired with an input that provides further context" if extra else "",
        instruction=str(row["instruction"]).strip(),
        input_block=f"### Input:\n{extra}\n\n" if extra else "",
    )


def instruction_example(tokenizer, row: dict, max_len: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one alpaca or chat row; prompt tokens are labelled IGNORE.

    Chat rows train on their last assistant turn, conditioned on everything before it.
    """
    if "messages" in row:
        messages = row["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise RecoverError("a chat row's last message must be the assistant's response")
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise RecoverError("the chat template does not render the prompt as a prefix of the conversation")
        response = full[len(prompt):]
    elif "instruction" in row and "output" in row:
        prompt, response = _alpaca_prompt(row), str(row["output"]) + (tokenizer.eos_token or "")
    else:
        raise RecoverError("an instruction row needs `messages` (chat) or `instruction` and `output` (alpaca)")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    ids = (prompt_ids + response_ids)[:max_len]
    labels = ([IGNORE] * len(prompt_ids) + response_ids)[:max_len]
    return ids, labels


def instruction_batches(tokenizer, path: Path, settings: RecoverSettings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise RecoverError(f"{path}:{number} is not JSON") from None
    examples = [instruction_example(tokenizer, row, settings.seq_len) for row in rows]
    examples = [e for e in examples if any(label != IGNORE for label in e[1][1:])]
    if not examples:
        raise RecoverError(f"{path} holds no example with response tokens inside seq_len={settings.seq_len}")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for step in range(settings.steps):
        chosen = [examples[order[(step * settings.batch_size + i) % len(order)]] for i in range(settings.batch_size)]
        width = max(len(ids) for ids, _ in chosen)
        # Right padding under causal attention never changes the real tokens' outputs.
        ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chosen])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in chosen])
        batches.append((ids, labels))
    return batches


def corpus_batches(tokenizer, settings: RecoverSettings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    windows = make_windows(tokenizer, settings.corpus, settings.steps * settings.batch_size, settings.seq_len,
                           settings.seed)
    return [(w, w) for w in windows.split(settings.batch_size)]


# --------------------------------------------------------------------------- loss and training


def lm_loss(hf: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over labelled positions; logits in chunks (see pipeline.lm)."""
    from pipeline.lm import LOGIT_CHUNK

    hidden = hf.model(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    keep = targets != IGNORE
    hidden, targets = hidden[keep], targets[keep]
    total = hidden.new_zeros(())
    for start in range(0, targets.numel(), LOGIT_CHUNK):
        logits = hf.lm_head(hidden[start : start + LOGIT_CHUNK]).float()
        total = total + F.cross_entropy(logits, targets[start : start + LOGIT_CHUNK], reduction="sum")
    return total / max(targets.numel(), 1)


@torch.no_grad()
def eval_loss(hf: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    was_training = hf.training
    hf.eval()
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        total += lm_loss(hf, batch, batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    hf.train(was_training)
    return total / count


def _schedule(settings: RecoverSettings):
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(settings.steps - settings.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def train_torch(peft_model, hf, batches, settings: RecoverSettings, ctx: StageContext) -> list[float]:
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(settings))
    peft_model.train()
    losses = []
    for step, (ids, labels) in enumerate(batches, 1):
        loss = lm_loss(hf, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ctx.report(f"recover {settings.level}", step, len(batches))
    peft_model.eval()
    return losses


def init_deepspeed_single_process() -> None:
    """One-process gloo group on CPU; never JIT-compile the shm-comm op (minutes, unused here)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")


def train_deepspeed(peft_model, hf, batches, settings: RecoverSettings, ctx: StageContext) -> list[float]:
    """The same step under DeepSpeed ZeRO, with a client torch optimizer (no fused-op build)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        init_deepspeed_single_process()
    # DeepSpeed broadcasts every parameter as a flat byte view, which needs a unit last stride:
    # the transposed o/down views get a contiguous copy of this level's prefix (the rest stay views).
    for module in hf.modules():
        if isinstance(module, nn.Linear) and module.weight.dim() == 2 and module.weight.stride(-1) != 1:
            module.weight = nn.Parameter(module.weight.contiguous(), requires_grad=False)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(settings))
    world = torch.distributed.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": settings.batch_size,
        "train_batch_size": settings.batch_size * world,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": settings.zero_stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=peft_model, optimizer=optimizer, lr_scheduler=scheduler,
                                           model_parameters=params, config=config)
    engine.train()
    losses = []
    for step, (ids, labels) in enumerate(batches, 1):
        loss = lm_loss(hf, ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ctx.report(f"recover {settings.level} (deepspeed)", step, len(batches))
    engine.eval()
    return losses


# --------------------------------------------------------------------------- saving


def unit_major_adapter(peft_model) -> dict[str, torch.Tensor]:
    """peft's A/B per projection under the package's names: `model.layers.N.….q_proj.lora_A|lora_B`."""
    tensors = {}
    for name, module in peft_model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        base = name[name.index("model.layers."):].replace(".self_attn.inner.", ".self_attn.")
        tensors[f"{base}.lora_A"] = module.lora_A["default"].weight.detach().contiguous().clone()
        tensors[f"{base}.lora_B"] = module.lora_B["default"].weight.detach().contiguous().clone()
    if not tensors:
        raise RecoverError("the model carries no LoRA layers to save")
    return tensors


def save_adapter(tensors: dict[str, torch.Tensor], path: Path, settings: RecoverSettings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    meta = {"rank": str(settings.rank), "alpha": str(settings.alpha), "scale": str(settings.alpha / settings.rank),
            "level": settings.level}
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def recover_level(package_dir: Path, settings: RecoverSettings, out_dir: Path, ctx: StageContext) -> dict:
    """Train the level's LoRA; write peft format and the unit-major adapter; return metrics."""
    from transformers import AutoTokenizer

    if settings.level is None:
        raise RecoverError("recover trains one level: set `level` (the chain's fan-out sets one per shard)")
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(package_dir) / "model"))
    if settings.instructions:
        batches = instruction_batches(tokenizer, Path(settings.instructions), settings)
    else:
        batches = corpus_batches(tokenizer, settings)
    eval_windows = make_windows(tokenizer, settings.eval_corpus, settings.eval_windows, settings.seq_len,
                                settings.seed + 1)
    hf = level_submodel(ElasticCausalLM.from_package(package_dir), settings.level)
    before = eval_loss(hf, eval_windows, settings.batch_size)
    peft_model = add_lora(hf, settings)
    trainer = train_deepspeed if settings.backend == "deepspeed" else train_torch
    losses = trainer(peft_model, hf, batches, settings, ctx)
    after = eval_loss(hf, eval_windows, settings.batch_size)

    peft_dir = out_dir / "peft"
    staging = out_dir / ".peft.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    peft_model.save_pretrained(str(staging))
    shutil.rmtree(peft_dir, ignore_errors=True)
    os.replace(staging, peft_dir)
    save_adapter(unit_major_adapter(peft_model), out_dir / f"{settings.level}.safetensors", settings)
    return {
        "level": settings.level,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "steps": len(losses),
        "settings": settings.model_dump(mode="json"),
    }


# --------------------------------------------------------------------------- serving level adapters in the pipeline


class LevelLoRALinear(nn.Module):
    """An ElasticLinear plus one LoRA per level; the active pair follows the level, no weight moves.

    Row-unit layers see the full input and emit the active rows; column-unit layers see the
    active inputs; either way A is [r, in_active] and B is [out_active, r], as stored.
    """

    def __init__(self, base: ElasticLinear):
        super().__init__()
        self.base = base
        self.max_units = base.max_units
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.active: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def set_width(self, units: int) -> None:
        self.base.set_width(units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.active is None:
            return y
        a, b, scale = self.active
        return y + scale * F.linear(F.linear(x, a), b)


def attach_level_adapters(model: ElasticCausalLM, package_dir: Path) -> list[str]:
    """Wrap every projection and load the package's recovery adapters; returns levels that have one."""
    from safetensors import safe_open

    manifest = read_manifest(package_dir)
    wrappers: dict[str, LevelLoRALinear] = {}
    for index, layer in enumerate(model.hf.model.layers):
        for parent, names, kind in ((layer.self_attn.inner, ATTN_PROJ, "self_attn"), (layer.mlp, MLP_PROJ, "mlp")):
            for proj in names:
                module = getattr(parent, proj)
                if not isinstance(module, LevelLoRALinear):
                    module = LevelLoRALinear(module)
                    setattr(parent, proj, module)
                wrappers[f"model.layers.{index}.{kind}.{proj}"] = module
    loaded = []
    for level in manifest.elastic.levels:
        if level.adapter is None:
            continue
        with safe_open(str(Path(package_dir) / level.adapter), "pt") as handle:
            scale = adapter_scale(handle.metadata() or {}, level.adapter)
            for key in handle.keys():
                if key.endswith(".lora_A"):
                    base = key.removesuffix(".lora_A")
                    wrappers[base].adapters[level.name] = (handle.get_tensor(key), handle.get_tensor(f"{base}.lora_B"),
                                                           scale)
        loaded.append(level.name)
    model.lora_wrappers = list(wrappers.values())
    return loaded


def adapter_scale(meta: dict[str, str], where: str) -> float:
    """LoRA scale from an adapter's metadata: `scale`, else `alpha / rank` (both are what we write)."""
    if "scale" in meta:
        return float(meta["scale"])
    if "alpha" in meta and "rank" in meta:
        return float(meta["alpha"]) / float(meta["rank"])
    raise RecoverError(f"{where} has neither `scale` nor `alpha` and `rank` in its metadata")


def set_level_with_adapter(model: ElasticCausalLM, level: str) -> None:
    """Switch widths (views only) and make the level's LoRA, if any, the active one."""
    model.set_level(level)
    for wrapper in getattr(model, "lora_wrappers", []):
        wrapper.active = wrapper.adapters.get(model.level)


# --------------------------------------------------------------------------- into the package


def install_adapters(package_dir: Path, adapters: dict[str, Path]) -> None:
    """Copy level adapters to adapters/recovery/<level>.safetensors and record them in the manifest."""
    package_dir = Path(package_dir)
    manifest = read_manifest(package_dir)
    for level_key, source in adapters.items():
        level = manifest.elastic.level(level_key)
        relative = f"adapters/recovery/{level.name}.safetensors"
        atomic_write_bytes(package_dir / relative, Path(source).read_bytes())
        level.adapter = relative
    rewrite_manifest(package_dir, manifest)


def run(inputs: dict[str, Path], options: RecoverSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package": dir} -> {"adapter": <level>.safetensors, "peft": dir, "metrics": json}."""
    out = ctx.work_dir
    out.mkdir(parents=True, exist_ok=True)
    metrics = recover_level(Path(inputs["package"]), options, out, ctx)
    metrics_path = out / "recover.json"
    atomic_write_bytes(metrics_path, json.dumps(metrics, indent=2).encode())
    ctx.logger.info("recover %s: eval loss %.4f -> %.4f", options.level, metrics["eval_loss_before"],
                    metrics["eval_loss_after"])
    return {"adapter": out / f"{options.level}.safetensors", "peft": out / "peft", "metrics": metrics_path}


def run_install(inputs: dict[str, Path], settings: StageSettings, ctx: StageContext) -> dict[str, Path]:
    """Fan-in entry: inputs {"package": dir, "adapter.<level>": file, …} -> {"package": dir with adapters}.

    The package is copied (weights hard-linked where the filesystem allows) so the input stays immutable.
    """
    adapters = {key.split(".", 1)[1]: Path(path) for key, path in inputs.items() if key.startswith("adapter.")}
    if not adapters:
        raise RecoverError("install needs at least one `adapter.<level>` input (one per recover shard)")
    out = ctx.work_dir / "package"
    copy_package(Path(inputs["package"]), out)
    install_adapters(out, adapters)
    return {"package": out}


def copy_package(source: Path, target: Path) -> None:
    """Copy a package directory, hard-linking files when possible (the weights are large and immutable)."""
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, staging, copy_function=link_or_copy)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
