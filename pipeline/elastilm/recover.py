"""Stage `recover`: one LoRA per level, trained on that level's zero-copy sub-model.

The sub-model is the package's HF skeleton whose seven projections are plain `nn.Linear`
modules whose weights are *views* of the unit-major storage prefix (o/down: the transposed
view), so peft wraps ordinary linears and no weight is copied. Because the kept units are
already the storage prefix, the LoRA is born in the package layout: A [r, in_active],
B [out_active, r], exactly what `adapters/recovery/<level>.safetensors` holds.

The loss is by default distillation: the teacher is the same weights at level 1.0 (the views
re-pointed at the whole storage, the LoRA bypassed), under no_grad; the student is the level
with its LoRA; KL(teacher || student) at a temperature, optionally over the teacher's top-k.
`loss: lm` is the plain next-token loss. With `warm_start`, the LoRA starts from a larger level's
(the next larger, or the top level's under `schedule: shared-top`), cut to this level's prefix. Other divergences, an added LM loss and on-policy steps are
research levers under `experimental` (pipeline.settings.RecoverExperiments), off by default.

Data is an LM corpus (named sources, or a recovery corpus directory from pipeline.elastilm.corpus) or
instruction data in alpaca (`instruction`/`input`/`output`) or chat (`messages`) JSONL, with
loss on responses only. The torch loop is the default; `backend: deepspeed` runs the same step
under ZeRO. Training runs under bf16 autocast on CUDA and on CPUs with native bf16 (`precision`), on
the stage's device (`ctx.device`). With `workers > 1` the level trains data-parallel through Ray Train
(pipeline.elastilm.recover_distributed), its workers building the level with `prepare_level`.

Design: docs/design.md, 'recover'.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from device_sdk.elastic import ElasticLinear
from device_sdk.format import atomic_write_bytes, read_manifest, rewrite_manifest
from device_sdk.lora import adapter_metadata, canonical_key, lora_scale, read_adapter
from device_sdk.lora import tensor_names as lora_tensor_names
from pipeline.contract import StageSettings
from pipeline.data.calibration import make_windows, mixed_windows
from pipeline.data.recovery_text import load_recovery_kinds
from pipeline.elastilm.evaluate import repeated_ngram_starts
from pipeline.errors import PipelineError
from pipeline.models.elastic import ATTN_PROJ, MLP_PROJ, ElasticCausalLM
from pipeline.models.precision import autocast, training_dtype
from pipeline.models.scoring import LOGIT_CHUNK
from pipeline.settings import Divergence, RecoverSettings
from pipeline.stage import StageContext

IGNORE = -100  # label of prompt and padding tokens: no loss
ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)


class RecoverError(PipelineError):
    """Recovery settings or data that cannot train a level's LoRA."""


# --------------------------------------------------------------------------- the sub-model


def point_at_active(linear: nn.Linear, module: ElasticLinear) -> nn.Linear:
    """Make `linear` compute over `module`'s active prefix at its current width: a view, never a copy."""
    weight = module.active_weight if module.unit_axis == "out" else module.active_weight.t()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.in_features, linear.out_features = weight.shape[1], weight.shape[0]
    if module.active_bias is not None:
        linear.bias = nn.Parameter(module.active_bias, requires_grad=False)
    return linear


def linear_view(module: ElasticLinear) -> nn.Linear:
    """An `nn.Linear` over the active prefix of an ElasticLinear's storage: a view, never a copy."""
    return point_at_active(nn.Linear(module.in_features, module.out_features, bias=False, device="meta"), module)


class LevelViews:
    """The sub-model's plain-linear views, each tied to the ElasticLinear it views.

    `use(level)` moves the model's cursor and re-points every view at that level's prefix of the
    same storage, so the teacher (level 1.0) and the student (level m) are one set of weights.
    peft wraps these very `nn.Linear` objects as its base layers, so re-pointing reaches them too.
    """

    def __init__(self, model: ElasticCausalLM, level: str) -> None:
        self.model = model
        self.hf = model.hf
        self.pairs: list[tuple[ElasticLinear, nn.Linear]] = []
        model.set_level(level)
        self.level = model.level
        for layer in model.hf.model.layers:
            for parent, names in ((layer.self_attn.inner, ATTN_PROJ), (layer.mlp, MLP_PROJ)):
                for proj in names:
                    source = getattr(parent, proj)
                    view = linear_view(source)
                    setattr(parent, proj, view)
                    self.pairs.append((source, view))
        for param in model.hf.parameters():
            param.requires_grad_(False)

    def use(self, level: str) -> None:
        self.model.set_level(level)
        for source, view in self.pairs:
            point_at_active(view, source)

    @contextmanager
    def at(self, level: str) -> Iterator[None]:
        """Run at `level` inside the block, then return to the student's level."""
        self.use(level)
        try:
            yield
        finally:
            self.use(self.level)


def level_submodel(model: ElasticCausalLM, level: str) -> nn.Module:
    """The HF model at `level` with plain-linear views in place of the elastic projections.

    Consumes `model`: its layers now hold fixed-width views (the storage is still shared).
    """
    return LevelViews(model, level).hf


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
    return padded_batches(examples, tokenizer, settings.steps, settings.batch_size, settings.seed)


def padded_batches(examples: list[tuple[list[int], list[int]]], tokenizer, steps: int, batch_size: int,
                   seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (ids, labels) batches of `batch_size` examples, cycling through one seeded permutation, each
    batch right-padded to its longest example (padding labelled IGNORE)."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for step in range(steps):
        chosen = [examples[order[(step * batch_size + i) % len(order)]] for i in range(batch_size)]
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


def mixed_batches(tokenizer, texts_by_kind: dict[str, list[str]], settings: RecoverSettings
                  ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, dict]]:
    """Batches of seeded windows over a recovery corpus's kinds of text in `settings.mix` proportions."""
    windows, stats = mixed_windows(tokenizer, texts_by_kind, settings.mix, settings.steps * settings.batch_size,
                                   settings.seq_len, settings.seed)
    return [(w, w) for w in windows.split(settings.batch_size)], stats


# --------------------------------------------------------------------------- loss and training

# Log of "no probability": keeps exp() at exactly 0 where a bucket is empty, without inf - inf = nan.
LOG_FLOOR = -1e4


def training_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def decoding_precision(hf: nn.Module):
    """Rollouts decode in the weights' own fp32, as the device serves, whatever the training precision:
    the level is corrected on the text it would write when served."""
    return torch.autocast(_model_device(hf).type, enabled=False)


def labelled_hidden(hf: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states [n, hidden] at the positions whose next token is labelled, and those tokens [n]."""
    hidden = hf.model(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    keep = targets != IGNORE
    return hidden[keep], targets[keep]


def lm_loss(hf: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over labelled positions; logits in chunks (see pipeline.models.scoring)."""
    hidden, targets = labelled_hidden(hf, input_ids, labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), LOGIT_CHUNK):
        logits = hf.lm_head(hidden[start : start + LOGIT_CHUNK]).float()
        total = total + F.cross_entropy(logits, targets[start : start + LOGIT_CHUNK], reduction="sum")
    return total / max(targets.numel(), 1)


@dataclass
class TeacherTargets:
    """The full model's next-token log-probabilities at temperature T on one batch's labelled positions.

    Either the full vocabulary ([n, vocab]) or, with top-k, [n, k + 1] buckets: the teacher's k
    most likely tokens (`indices` [n, k]) and, last, all other tokens together. The bucketed KL is
    the exact KL between the two distributions coarsened to those k + 1 events, so it is zero when
    student equals teacher and still pushes the student's mass off the teacher's unlikely tokens.
    """

    logprobs: torch.Tensor
    indices: torch.Tensor | None = None


def bucket_logprobs(logprobs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[n, vocab] log-probs -> [n, k + 1]: those of `indices`, then the log of the remaining mass."""
    top = logprobs.gather(-1, indices)
    rest = torch.logsumexp(logprobs.scatter(-1, indices, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([top, rest.clamp_min(LOG_FLOOR)], dim=-1)


@contextmanager
def teacher_mode(views: LevelViews, full: str, peft_model=None) -> Iterator[None]:
    """The full model: the same storage re-viewed at `full`, the LoRA bypassed (peft's disable_adapter)."""
    with (peft_model.disable_adapter() if peft_model is not None else nullcontext()), views.at(full):
        yield


@torch.no_grad()
def teacher_targets(views: LevelViews, full: str, peft_model, input_ids: torch.Tensor, labels: torch.Tensor,
                    temperature: float, top_k: int) -> TeacherTargets:
    with teacher_mode(views, full, peft_model):
        hidden, _ = labelled_hidden(views.hf, input_ids, labels)
        parts, index_parts = [], []
        for start in range(0, hidden.shape[0], LOGIT_CHUNK):
            logits = views.hf.lm_head(hidden[start : start + LOGIT_CHUNK]).float()
            logprobs = F.log_softmax(logits / temperature, dim=-1)
            if 0 < top_k < logprobs.shape[-1]:
                indices = logprobs.topk(top_k, dim=-1).indices
                logprobs = bucket_logprobs(logprobs, indices)
                index_parts.append(indices)
            parts.append(logprobs)
    return TeacherTargets(torch.cat(parts), torch.cat(index_parts) if index_parts else None)


def divergence(student: torch.Tensor, teacher: torch.Tensor, kind: Divergence = "forward",
               beta: float = 0.5) -> torch.Tensor:
    """Summed divergence between two rows of log-probabilities: "forward" KL(teacher || student), which
    covers every token the teacher gives mass; "reverse" KL(student || teacher), which seeks its modes;
    "jsd" the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), β·KL(teacher || M) +
    (1 − β)·KL(student || M) with M = β·teacher + (1 − β)·student, between the two."""
    if kind == "forward":
        return F.kl_div(student, teacher, log_target=True, reduction="sum")
    if kind == "reverse":
        return (student.exp() * (student - teacher)).sum()
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1 - beta)]), dim=0)
    return (beta * F.kl_div(mixture, teacher, log_target=True, reduction="sum")
            + (1 - beta) * F.kl_div(mixture, student, log_target=True, reduction="sum"))


def distill_loss(hf: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, teacher: TeacherTargets,
                 temperature: float, lm_weight: float = 0.0, repeated: torch.Tensor | None = None,
                 unlikelihood: float = 0.0, kind: Divergence = "forward", beta: float = 0.5) -> torch.Tensor:
    """Mean over labelled positions of T²·D(teacher, student) at temperature T (D: `divergence`), plus
    lm_weight·NLL, plus unlikelihood·−log(1 − p(token)) at the `repeated` positions ([batch, length]
    bool, see `repeated_ngram_positions`; the student's own probability at temperature 1)."""
    hidden, targets = labelled_hidden(hf, input_ids, labels)
    if hidden.shape[0] != teacher.logprobs.shape[0]:
        raise RecoverError("the teacher's targets belong to another batch")
    if repeated is not None:  # aligned with `targets`: the positions labelled_hidden keeps
        repeated = repeated[:, 1:].reshape(-1)[labels[:, 1:].reshape(-1) != IGNORE]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), LOGIT_CHUNK):
        part = slice(start, start + LOGIT_CHUNK)
        logits = hf.lm_head(hidden[part]).float()
        student = F.log_softmax(logits / temperature, dim=-1)
        if teacher.indices is not None:
            student = bucket_logprobs(student, teacher.indices[part])
        total = total + divergence(student, teacher.logprobs[part], kind, beta) * temperature**2
        if lm_weight:
            total = total + lm_weight * F.cross_entropy(logits, targets[part], reduction="sum")
        if unlikelihood and repeated is not None and repeated[part].any():
            hit = repeated[part]
            chosen = F.softmax(logits[hit], dim=-1).gather(-1, targets[part][hit, None]).squeeze(-1)
            total = total - unlikelihood * torch.log1p(-chosen.clamp(max=1 - 1e-6)).sum()
    return total / max(targets.numel(), 1)


def repeated_ngram_positions(ids: torch.Tensor, start: int, n: int = 4) -> torch.Tensor:
    """[batch, length] bool: the tokens from `start` on that belong to an n-gram already written earlier
    in the same row from `start` (what `pipeline.elastilm.evaluate.repeated_4gram_rate` counts): the tokens of a loop."""
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    for row, tokens in enumerate(ids[:, start:].tolist()):
        for i in repeated_ngram_starts(tokens, n):
            repeated[row, start + i : start + i + n] = True
    return repeated


@torch.no_grad()
def student_rollout(hf: nn.Module, input_ids: torch.Tensor, prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): each row's first `prefix_tokens` tokens continued greedily by `hf` itself (the level
    with its LoRA, dropout off) to the batch's length, the prefix left out of the labels.

    Distilled on these, the level is corrected on the text it would write, loops included: the states
    greedy decoding reaches and corpus text does not (on-policy distillation, as in GKD)."""
    if not 0 < prefix_tokens < input_ids.shape[1]:
        raise RecoverError(f"rollout_prefix must be between 1 and the sequence length - 1 ({input_ids.shape[1] - 1})")
    was_training = hf.training
    hf.eval()
    prefix = input_ids[:, :prefix_tokens]
    new_tokens = input_ids.shape[1] - prefix_tokens
    try:
        with decoding_precision(hf):
            ids = hf.generate(prefix, attention_mask=torch.ones_like(prefix), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)  # rows never pad: min_new_tokens keeps every row to the end
    finally:
        hf.train(was_training)
    labels = ids.clone()
    labels[:, :prefix_tokens] = IGNORE
    return ids, labels


@torch.no_grad()
def corrected_rollout(views: LevelViews, full: str, peft_model, input_ids: torch.Tensor, prefix_tokens: int,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) as `student_rollout`, but each greedy token of the level that is not among the full
    model's `top_k` next tokens is replaced by the full model's argmax (speculative KD's interleaved
    sampling, greedy). Both models keep their own KV cache over the one shared storage."""
    from transformers import DynamicCache

    if not 0 < prefix_tokens < input_ids.shape[1]:
        raise RecoverError(f"rollout_prefix must be between 1 and the sequence length - 1 ({input_ids.shape[1] - 1})")
    hf = views.hf
    was_training = hf.training
    hf.eval()
    ids = input_ids[:, :prefix_tokens]
    fed, student_cache, teacher_cache = ids, DynamicCache(), DynamicCache()
    try:
        with decoding_precision(hf):
            for _ in range(input_ids.shape[1] - prefix_tokens):
                proposed = hf(input_ids=fed, cache=student_cache, use_cache=True).logits[:, -1].argmax(-1)
                with teacher_mode(views, full, peft_model):
                    teacher_logits = hf(input_ids=fed, cache=teacher_cache, use_cache=True).logits[:, -1]
                allowed = teacher_logits.topk(top_k, dim=-1).indices
                kept = (allowed == proposed[:, None]).any(dim=-1)
                fed = torch.where(kept, proposed, allowed[:, 0])[:, None]
                ids = torch.cat([ids, fed], dim=1)
    finally:
        hf.train(was_training)
    labels = ids.clone()
    labels[:, :prefix_tokens] = IGNORE
    return ids, labels


def make_loss(settings: RecoverSettings, views: LevelViews, full: str, peft_model) -> Callable:
    """The training loss of (input ids, labels): the LM loss, or distillation from the full model, on the
    batch or (a seeded `experimental.on_policy` share of steps) on the level's own continuation of it."""
    if settings.loss == "lm":
        return lambda ids, labels: lm_loss(views.hf, ids, labels)
    rollouts = random.Random(settings.seed)  # which steps roll out: the same on a rerun
    experimental = settings.experimental

    def distill(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        repeated = None
        if experimental.on_policy and rollouts.random() < experimental.on_policy:
            if experimental.rollout == "corrected":
                ids, labels = corrected_rollout(views, full, peft_model, ids, experimental.rollout_prefix,
                                                experimental.correct_top_k)
            else:
                ids, labels = student_rollout(views.hf, ids, experimental.rollout_prefix)
            repeated = repeated_ngram_positions(ids, experimental.rollout_prefix) if experimental.unlikelihood else None
        teacher = teacher_targets(views, full, peft_model, ids, labels, settings.temperature, settings.top_k)
        return distill_loss(views.hf, ids, labels, teacher, settings.temperature, experimental.lm_weight,
                            repeated, experimental.unlikelihood, experimental.divergence, experimental.jsd_beta)

    return distill


def _model_device(hf: nn.Module) -> torch.device:
    return next(hf.parameters()).device


@torch.no_grad()
def eval_loss(hf: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token NLL over `windows`, in the weights' own dtype (fp32: measured as served, not as trained)."""
    was_training = hf.training
    hf.eval()
    device = _model_device(hf)
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        total += lm_loss(hf, batch.to(device), batch.to(device)).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    hf.train(was_training)
    return total / count


@torch.no_grad()
def eval_loss_and_kl(views: LevelViews, full: str, peft_model, windows: torch.Tensor,
                     batch_size: int) -> tuple[float, float]:
    """Over `windows`, per next-token position: the level's mean NLL (as `eval_loss`) and the mean
    KL(full model || level) at temperature 1, full vocabulary. One student pass gives both."""
    was_training = views.hf.training
    views.hf.eval()
    device = _model_device(views.hf)
    nll = kl = 0.0
    count = 0
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        teacher = teacher_targets(views, full, peft_model, batch, batch, 1.0, 0)
        hidden, targets = labelled_hidden(views.hf, batch, batch)
        for start in range(0, targets.numel(), LOGIT_CHUNK):
            part = slice(start, start + LOGIT_CHUNK)
            student = F.log_softmax(views.hf.lm_head(hidden[part]).float(), dim=-1)
            nll += F.nll_loss(student, targets[part], reduction="sum").item()
            kl += divergence(student, teacher.logprobs[part]).item()
        count += targets.numel()
    views.hf.train(was_training)
    return nll / count, kl / count


def _schedule(settings: RecoverSettings):
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(settings.steps - settings.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def train_torch(peft_model, hf, batches, settings: RecoverSettings, ctx: StageContext,
                loss_fn: Callable | None = None) -> list[float]:
    """AdamW on the LoRA parameters; `loss_fn(ids, labels)` defaults to the LM loss (see make_loss)."""
    loss_fn = loss_fn or (lambda ids, labels: lm_loss(hf, ids, labels))
    device = _model_device(hf)
    dtype = training_dtype(settings.precision, device)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(settings))
    peft_model.train()
    losses = []
    for step, (ids, labels) in enumerate(batches, 1):
        with autocast(device, dtype):
            loss = loss_fn(ids.to(device), labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ctx.report(f"recover {settings.level}", step, len(batches))
    peft_model.eval()
    return losses


def init_deepspeed_single_process(device: torch.device | None = None) -> None:
    """One-process group, gloo on CPU and NCCL on CUDA (`device`: where the model is; default: CUDA when
    torch sees it); never JIT-compile the shm-comm op (minutes, unused here)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


def train_deepspeed(peft_model, hf, batches, settings: RecoverSettings, ctx: StageContext,
                    loss_fn: Callable | None = None, views: LevelViews | None = None) -> list[float]:
    """The same step under DeepSpeed ZeRO, with a client torch optimizer (no fused-op build)."""
    import deepspeed

    loss_fn = loss_fn or (lambda ids, labels: lm_loss(hf, ids, labels))
    device = _model_device(hf)
    if not torch.distributed.is_initialized():
        init_deepspeed_single_process(device)
    # DeepSpeed broadcasts every parameter as a flat byte view, which needs a unit last stride:
    # the transposed o/down views get a contiguous copy of this level's prefix for initialize().
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
    if views is not None:
        # ZeRO 0-2 keeps no handle on frozen weights after initialize(): back to the storage's views,
        # which the teacher's level switches need anyway.
        views.use(views.level)
    engine.train()
    dtype = training_dtype(settings.precision, device)
    losses = []
    for step, (ids, labels) in enumerate(batches, 1):
        with autocast(device, dtype):
            loss = loss_fn(ids.to(device), labels.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ctx.report(f"recover {settings.level} (deepspeed)", step, len(batches))
    engine.eval()
    return losses


# --------------------------------------------------------------------------- saving


def lora_layers(peft_model) -> Iterator[tuple[str, nn.Module]]:
    """(projection key `model.layers.N.….q_proj`, peft LoRA layer) for every LoRA-wrapped projection."""
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            yield canonical_key(name), module


def unit_major_adapter(peft_model) -> dict[str, torch.Tensor]:
    """peft's A/B per projection under the package's names (device_sdk.lora)."""
    tensors = {}
    for key, module in lora_layers(peft_model):
        a_name, b_name = lora_tensor_names(key)
        tensors[a_name] = module.lora_A["default"].weight.detach().contiguous().clone()
        tensors[b_name] = module.lora_B["default"].weight.detach().contiguous().clone()
    if not tensors:
        raise RecoverError("the model carries no LoRA layers to save")
    return tensors


def warm_start(peft_model, adapter: Path, settings: RecoverSettings) -> int:
    """Start every LoRA pair from a larger level's unit-major adapter; returns the pairs set.

    This level's active units are a prefix of the larger level's in unit-major storage, so
    A[:, :in_active] and B[:out_active] are the larger LoRA restricted to the units kept here.
    B is rescaled when the scales (alpha / rank) differ, so the starting update is the same.
    """
    source = read_adapter(Path(adapter))
    target_scale = lora_scale(settings.rank, settings.alpha)
    count = 0
    for key, module in lora_layers(peft_model):
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        if key not in source:
            raise RecoverError(f"{adapter} has no LoRA for {key}: not a larger level's adapter of this package")
        a_source, b_source, source_scale = source[key]
        if a_source.shape[0] != a.shape[0]:
            raise RecoverError(f"{adapter} has rank {a_source.shape[0]}; this level trains rank {a.shape[0]}")
        if a_source.shape[1] < a.shape[1] or b_source.shape[0] < b.shape[0]:
            raise RecoverError(f"{adapter}'s {key} is narrower than this level's: warm start needs a larger level")
        with torch.no_grad():
            a.copy_(a_source[:, : a.shape[1]])
            b.copy_(b_source[: b.shape[0]] * (source_scale / target_scale))
        count += 1
    return count


def save_adapter(tensors: dict[str, torch.Tensor], path: Path, settings: RecoverSettings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=adapter_metadata(settings.rank, settings.alpha, level=settings.level))
    os.replace(tmp, path)


@dataclass
class LevelTraining:
    """One level's training, built the same way in every process that trains it (seeded data, model, LoRA)."""

    settings: RecoverSettings
    views: LevelViews
    full: str  # the teacher's level
    peft_model: nn.Module
    loss_fn: Callable
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    eval_windows: torch.Tensor
    mix_stats: dict | None  # windows per kind of corpus text, when training on a recovery corpus
    init_adapter: Path | None
    corpus_dir: Path | None

    def evaluate(self, with_lora: bool) -> tuple[float, float]:
        """(eval loss, KL to the full model) of the level, with its LoRA or without (as elastify left it)."""
        if with_lora:
            return eval_loss_and_kl(self.views, self.full, self.peft_model, self.eval_windows,
                                    self.settings.batch_size)
        with self.peft_model.disable_adapter():  # student and teacher both without it
            return eval_loss_and_kl(self.views, self.full, None, self.eval_windows, self.settings.batch_size)


def prepare_level(package_dir: Path, settings: RecoverSettings, device: torch.device,
                  init_adapter: Path | None = None, corpus_dir: Path | None = None) -> LevelTraining:
    """The level's data, sub-model on `device` and LoRA (warm-started from `init_adapter`), ready to train.

    Deterministic under `settings.seed`: every data-parallel worker builds the same batches and LoRA.
    """
    from transformers import AutoTokenizer

    if settings.level is None:
        raise RecoverError("recover trains one level: set `level` (the chain's fan-out sets one per shard)")
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(package_dir) / "model"))
    mix_stats = None
    if settings.instructions:
        batches = instruction_batches(tokenizer, Path(settings.instructions), settings)
    elif corpus_dir is not None:
        batches, mix_stats = mixed_batches(tokenizer, load_recovery_kinds(Path(corpus_dir)), settings)
    else:
        batches = corpus_batches(tokenizer, settings)
    eval_windows = make_windows(tokenizer, settings.eval_corpus, settings.eval_windows, settings.seq_len,
                                settings.seed + 1)
    model = ElasticCausalLM.from_package(package_dir, device=device)
    full = max(model.elastic.levels, key=lambda level: level.ratio).name  # the teacher
    views = LevelViews(model, settings.level)
    peft_model = add_lora(views.hf, settings)
    if init_adapter is not None:
        warm_start(peft_model, Path(init_adapter), settings)
    return LevelTraining(settings, views, full, peft_model, make_loss(settings, views, full, peft_model), batches,
                         eval_windows, mix_stats, init_adapter, corpus_dir)


def write_level(training: LevelTraining, out_dir: Path, before: tuple[float, float], after: tuple[float, float],
                losses: list[float]) -> dict:
    """Write the trained LoRA in peft format (`peft/`) and unit-major (`<level>.safetensors`); return the metrics."""
    settings = training.settings
    peft_dir = out_dir / "peft"
    staging = out_dir / ".peft.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    training.peft_model.save_pretrained(str(staging))
    shutil.rmtree(peft_dir, ignore_errors=True)
    os.replace(staging, peft_dir)
    save_adapter(unit_major_adapter(training.peft_model), out_dir / f"{settings.level}.safetensors", settings)
    return {
        "level": settings.level,
        "teacher_level": training.full,
        "eval_loss_before": before[0],
        "eval_loss_after": after[0],
        "eval_kl_before": before[1],
        "eval_kl_after": after[1],
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "steps": len(losses),
        "train_tokens": sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in training.batches),
        "warm_start_from": str(training.init_adapter) if training.init_adapter is not None else None,
        # else settings.corpus / instructions
        "corpus_dir": str(training.corpus_dir) if training.corpus_dir is not None else None,
        "mix": training.mix_stats,
        "settings": settings.model_dump(mode="json"),
    }


def recover_level(package_dir: Path, settings: RecoverSettings, out_dir: Path, ctx: StageContext,
                  init_adapter: Path | None = None, corpus_dir: Path | None = None) -> dict:
    """Train the level's LoRA in this process on `ctx.device`; write peft format and the unit-major adapter;
    return metrics.

    `init_adapter`: a larger level's adapter to warm-start from; `corpus_dir`: a recovery corpus
    (pipeline.elastilm.corpus) to train on instead of the named `corpus` sources.
    """
    training = prepare_level(package_dir, settings, torch.device(ctx.device), init_adapter, corpus_dir)
    before = training.evaluate(with_lora=False)
    hf = training.views.hf
    if settings.backend == "deepspeed":
        losses = train_deepspeed(training.peft_model, hf, training.batches, settings, ctx, training.loss_fn,
                                 training.views)
    else:
        losses = train_torch(training.peft_model, hf, training.batches, settings, ctx, training.loss_fn)
    after = training.evaluate(with_lora=True)
    return write_level(training, out_dir, before, after, losses)


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


def run(inputs: dict[str, Path], options: RecoverSettings, ctx: StageContext,
        train: Callable[..., dict] | None = None) -> dict[str, Path]:
    """Stage entry: inputs {"package": dir} -> {"adapter": <level>.safetensors, "peft": dir, "metrics": json}.

    Optional inputs: "init_adapter", a larger level's adapter (with `warm_start`; which one is the
    schedule's choice, and the largest recovered level starts cold), and "corpus", a recovery corpus
    directory. `train`: `recover_level` (one process) unless given; recover_distributed.run gives its own.
    """
    init_adapter = inputs.get("init_adapter")
    if init_adapter is not None and not options.warm_start:
        raise RecoverError("an init_adapter input is only used with warm_start: true")
    out = ctx.work_dir
    out.mkdir(parents=True, exist_ok=True)
    corpus = inputs.get("corpus")
    if train is None and options.workers > 1:
        raise RecoverError("workers > 1 trains through Ray Train: run pipeline.elastilm.recover_distributed.run")
    metrics = (train or recover_level)(Path(inputs["package"]), options, out, ctx,
                    init_adapter=Path(init_adapter) if init_adapter is not None else None,
                    corpus_dir=Path(corpus) if corpus is not None else None)
    metrics_path = out / "recover.json"
    atomic_write_bytes(metrics_path, json.dumps(metrics, indent=2).encode())
    ctx.logger.info("recover %s (%s): eval loss %.4f -> %.4f, KL to level %s %.4f -> %.4f", options.level,
                    options.loss, metrics["eval_loss_before"], metrics["eval_loss_after"], metrics["teacher_level"],
                    metrics["eval_kl_before"], metrics["eval_kl_after"])
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
