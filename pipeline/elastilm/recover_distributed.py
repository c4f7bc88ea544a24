"""One level's recovery on N data-parallel workers: Ray Train's `TorchTrainer`, torch DDP over the LoRA.

Every worker builds the same level (`recover.prepare_level`: seeded data, the sub-model on its own
device, the LoRA) and takes an equal, fixed slice of the rows of every batch: worker r of N the rows
[r·B/N, (r+1)·B/N) of each batch of B = `batch_size` rows. DDP averages the LoRA's gradients over the
workers; each worker's loss is weighted by its share of the batch's labelled tokens, so the average
is the gradient of the mean over the whole batch, as one worker computes it. The global batch, the
data order and the optimiser are those of one worker, and the trained adapter matches the one-worker
run up to the order of floating-point sums (tests/unit/pipeline/test_recover_data_parallel.py). Two
exceptions: LoRA dropout draws its masks per worker, and on-policy rollouts of instruction data
weight rows by their rollout's tokens; both are off by default.

The base weights are not sharded: each worker holds the whole model, so N workers shorten a level's
wall time but do not make a larger model fit (docs/usage/, 'Several workers for one level').

Ray Train's process group is gloo on CPU and NCCL on CUDA. The workers are placed on the node where
the stage runs (a `ray.io/node-id` label selector), where the stage fetched its inputs; rank 0 hands
the adapter back as a Ray Train checkpoint under the stage's work directory. Outside a Ray cluster
(`ray.is_initialized()` false) a local Ray is started for the run and shut down after it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeline.elastilm import recover
from pipeline.elastilm.recover import IGNORE, LevelTraining, RecoverError, prepare_level
from pipeline.models.precision import autocast, training_dtype
from pipeline.settings import RecoverSettings
from pipeline.stage import StageContext

METRICS_FILE = "recover.json"  # in rank 0's checkpoint, beside `<level>.safetensors` and `peft/`
log = logging.getLogger("elastify.recover")


class BatchLoss(nn.Module):
    """The level's training loss as a module, so that DDP sees each step's forward (its gradient hooks
    are armed in `forward`); the teacher's passes inside it run under no_grad."""

    def __init__(self, training: LevelTraining) -> None:
        super().__init__()
        self.peft_model = training.peft_model
        self.loss_fn = training.loss_fn

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(ids, labels)


def labelled(labels: torch.Tensor) -> int:
    """Positions whose next token carries a loss."""
    return int((labels[:, 1:] != IGNORE).sum())


def train_data_parallel(training: LevelTraining, rank: int, world: int, ctx: StageContext) -> list[float]:
    """`recover.train_torch`'s AdamW steps, each batch's rows split over `world` DDP workers; returns the
    loss of every step over the whole batch (the same on every worker)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    settings = training.settings
    share = settings.batch_size // world
    rows = slice(rank * share, (rank + 1) * share)
    peft_model = training.peft_model
    device = next(peft_model.parameters()).device
    loss_module = BatchLoss(training)
    # Only the LoRA is synchronised: every worker loaded the same base weights from the package, and the
    # views of the shared storage must not be broadcast (nor, for a large model, sent at all).
    frozen = [name for name, param in loss_module.named_parameters() if not param.requires_grad]
    frozen += [name for name, _ in loss_module.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(loss_module, frozen)
    # init_sync broadcasts rank 0's LoRA, so every worker starts from the same adapter.
    ddp = DistributedDataParallel(loss_module, device_ids=[device.index] if device.type == "cuda" else None)
    dtype = training_dtype(settings.precision, device)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, recover._schedule(settings))
    peft_model.train()
    losses = []
    for step, (ids, labels) in enumerate(training.batches, 1):
        ids, labels = ids[rows].to(device), labels[rows].to(device)
        with autocast(device, dtype):
            loss = ddp(ids, labels)
        # DDP averages over workers: weighted by its share of the labelled tokens, each worker's mean
        # becomes its part of the whole batch's mean.
        weighted = loss * (labelled(labels) * world / max(labelled(training.batches[step - 1][1]), 1))
        weighted.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # after the all-reduce: the same gradients on every worker
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        total = weighted.detach().float() / world
        dist.all_reduce(total)
        losses.append(total.item())
        ctx.report(f"recover {settings.level} (rank {rank} of {world})", step, len(training.batches))
    peft_model.eval()
    return losses


def train_worker(config: dict) -> None:
    """Ray Train's loop on one worker: build the level, train its slice, and (rank 0) hand back the adapter."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    settings = RecoverSettings.model_validate(config["settings"])
    init_adapter, corpus_dir = (Path(config[key]) if config[key] else None for key in ("init_adapter", "corpus_dir"))
    training = prepare_level(Path(config["package"]), settings, ray.train.torch.get_device(), init_adapter, corpus_dir)
    before = training.evaluate(with_lora=False) if rank == 0 else None
    with tempfile.TemporaryDirectory(prefix=f"recover-{settings.level}-") as scratch:
        ctx = StageContext(work_dir=Path(scratch), logger=log)
        losses = train_data_parallel(training, rank, world, ctx)
        if rank != 0:
            ray.train.report({}, checkpoint=None)  # a barrier: every worker reports once
            return
        out = Path(scratch) / "out"
        out.mkdir()
        metrics = recover.write_level(training, out, before, training.evaluate(with_lora=True), losses)
        metrics["workers"] = world
        (out / METRICS_FILE).write_text(json.dumps(metrics))
        ray.train.report({"steps": len(losses)}, checkpoint=ray.train.Checkpoint.from_directory(str(out)))


def _start_local_ray():
    """A Ray of this machine alone, for a run outside a cluster; None when this process is in one already."""
    import ray

    if ray.is_initialized():
        return None
    return ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                    _node_ip_address="127.0.0.1")


def recover_level_data_parallel(package_dir: Path, settings: RecoverSettings, out_dir: Path, ctx: StageContext,
                                init_adapter: Path | None = None, corpus_dir: Path | None = None) -> dict:
    """`recover.recover_level` on `settings.workers` Ray Train workers (one GPU each when `ctx.device` is cuda)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.placement_group import NODE_ID_LABEL_KEY

    if settings.workers < 2:
        raise RecoverError("data-parallel recovery needs workers >= 2; one worker trains in process (recover_level)")
    started = _start_local_ray()
    storage = Path(out_dir) / ".ray-train"  # a local path: the workers run on this node
    try:
        cuda = ctx.device == "cuda"
        scaling = ScalingConfig(num_workers=settings.workers, use_gpu=cuda,
                                resources_per_worker={"CPU": 1, **({"GPU": 1} if cuda else {})},
                                label_selector={NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()})
        config = {"package": str(package_dir), "settings": settings.model_dump(mode="json"),
                  "init_adapter": str(init_adapter) if init_adapter else None,
                  "corpus_dir": str(corpus_dir) if corpus_dir else None}
        ctx.logger.info("recover %s: %d data-parallel workers (%s)", settings.level, settings.workers, ctx.device)
        trainer = TorchTrainer(train_worker, train_loop_config=config, scaling_config=scaling,
                               run_config=RunConfig(name=f"recover-{settings.level}", storage_path=str(storage)))
        result = trainer.fit()
        if result.checkpoint is None:
            raise RecoverError(f"recover {settings.level}: rank 0 handed back no adapter")
        with result.checkpoint.as_directory() as checkpoint:
            install_outputs(Path(checkpoint), Path(out_dir), settings.level)
        return json.loads((Path(out_dir) / METRICS_FILE).read_text())
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        if started is not None:
            ray.shutdown()


def install_outputs(checkpoint: Path, out_dir: Path, level: str) -> None:
    """Move rank 0's adapter, peft directory and metrics into the stage's work directory, each atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (f"{level}.safetensors", METRICS_FILE):
        staging = out_dir / f".{name}.tmp"
        shutil.copyfile(checkpoint / name, staging)
        os.replace(staging, out_dir / name)
    staging = out_dir / ".peft.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint / "peft", staging)
    shutil.rmtree(out_dir / "peft", ignore_errors=True)
    os.replace(staging, out_dir / "peft")


def run(inputs: dict[str, Path], options: RecoverSettings, ctx: StageContext) -> dict[str, Path]:
    """The recover stage with `workers > 1`: `recover.run`, its level trained on Ray Train workers."""
    return recover.run(inputs, options, ctx, train=recover_level_data_parallel)
