"""Stage `label`: self-induced labels over the (prompt ratio × level) grid (docs/design.md, 'label').

A worker loads one elastic model (plus every level's LoRA) once and sweeps its shard of
multiple-choice items over the whole grid, switching levels zero-copy, by option log-likelihood
(length-normalised). A prompt is the task's fixed few-shot block (`train_shots`: examples from its
train split) and the item's passage, both compressed to ratio p by the TLM score head, then the
question, kept whole. The block is the same for every item of a task, so its KV cache is prefilled
once per (task, ratio, level) and every item continues it (`LabelWorker.sweep_scored`). The result is a boolean
correctness tensor [items, ratios, levels] and, beside it, the confidence margin of every grid cell
(`choice_margins`: the gold choice's length-normalised log-probability minus the best wrong choice's;
> 0 where the answer is right, and near 0 where a 4-way guess happened to land). The stage
`label-derive` (pipeline.elastilm.slo_labels) turns merged shards plus the cost model into per-SLO labels.

Tasks and their few-shot prompts come from pipeline.data.tasks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from device_sdk.format import atomic_write_bytes
from device_sdk.llama import KVCache
from device_sdk.runtime import ElasticModel
from pipeline.data.tasks import MCItem, few_shot_block, full_prompt, load_items
from pipeline.elastilm.tlm import compress, load_tlm
from pipeline.errors import PipelineError
from pipeline.models.elastic import serving_model
from pipeline.settings import LabelSettings
from pipeline.stage import StageContext


class LabelError(PipelineError):
    """Unknown tasks, empty shards, or inputs that do not fit together."""


# --------------------------------------------------------------------------- scoring


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one [rows, longest] batch, zero-padded on the right, and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, mask


@torch.inference_mode()
def choice_scores(model: ElasticModel, tokenizer, prompts: list[str], choices: list[str]) -> torch.Tensor:
    """[prompts, choices]: the mean log-probability of each choice's tokens after each prompt.

    Runs the device SDK's model at its current level (with its LoRA); see `continuation_scores`.
    """
    contexts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return continuation_scores(model.transformer, contexts, choice_ids(tokenizer, choices))


def choice_ids(tokenizer, choices: list[str]) -> list[list[int]]:
    return [tokenizer(" " + c, add_special_tokens=False)["input_ids"] or [0] for c in choices]


@torch.inference_mode()
def continuation_scores(transformer, contexts: list[list[int]], continuations: list[list[int]],
                        prefix: KVCache | None = None) -> torch.Tensor:
    """[contexts, continuations]: the mean log-probability of each continuation's tokens after each context.

    The contexts run once, as one batch whose KV cache every continuation then shares, and the LM
    head only runs where a continuation token is predicted. Choices are a few tokens against a
    prompt of tens, so this is a fraction of the work of one full row per (prompt, choice).
    `prefix`: a one-row cache holding tokens that precede every context (a few-shot block prefilled
    once); the contexts continue it, and it is left holding only the prefix again.
    """
    n_prompts, n_choices = len(contexts), len(continuations)
    rows = torch.arange(n_prompts).repeat_interleave(n_choices)  # row = prompt * n_choices + choice
    context_len = torch.tensor([len(c) for c in contexts])
    cont_len = torch.tensor([len(c) for c in continuations]).repeat(n_prompts)

    def log_probs(hidden: torch.Tensor, targets: list[int]) -> torch.Tensor:
        return transformer.lm_head(hidden).log_softmax(-1)[torch.arange(len(targets)), torch.tensor(targets)]

    ids, mask = _right_padded(contexts)
    if prefix is None:
        start, cache = 0, transformer.new_cache(ids.shape[1] + int(cont_len.max()) - 1)
    else:  # one context writes after the prefix in place; a batch continues copies of it
        start = prefix.length
        cache = prefix if n_prompts == 1 else prefix.select_rows(torch.zeros(n_prompts, dtype=torch.long))
    # Right padding: under causal attention a prompt's real tokens never see its padding.
    hidden = transformer.hidden_states(ids, cache)
    # Each choice's first token is predicted from its prompt's last real position ...
    last = hidden[torch.arange(n_prompts), context_len - 1]
    sums = log_probs(last[rows], [c[0] for c in continuations] * n_prompts)
    if cont_len.max() > 1:  # ... the rest from the choice's own tokens, over the shared prompt cache
        fed, _ = _right_padded([c[:-1] for c in continuations] * n_prompts)
        fed_len = cont_len - 1
        # A row's keys: the prefix, its prompt's real tokens (not the padding up to the longest prompt), its own.
        key_mask = torch.cat([torch.ones(len(rows), start, dtype=torch.long), mask[rows],
                              torch.ones(len(rows), fed.shape[1], dtype=torch.long)], 1)
        hidden = transformer.hidden_states(fed, cache.select_rows(rows),
                                           positions=start + context_len[rows, None] + torch.arange(fed.shape[1]),
                                           key_mask=key_mask)
        real = torch.arange(fed.shape[1])[None, :] < fed_len[:, None]
        rest = log_probs(hidden[real], [t for _ in range(n_prompts) for c in continuations for t in c[1:]])
        sums = sums.index_add(0, torch.repeat_interleave(torch.arange(len(rows)), fed_len), rest)
    if prefix is not None:
        prefix.truncate(start)
    return (sums / cont_len).view(n_prompts, n_choices)


def choice_margins(scores: torch.Tensor, gold: int) -> torch.Tensor:
    """The label rule that carries confidence, per row of `scores` [rows, choices] (mean log-probability
    of each choice's tokens, as `choice_scores` gives): the gold choice's score minus the best wrong
    choice's. Positive where the answer is right, by how much; negative where it is wrong, by how much.
    A right answer by a hair (a 135M model guessing among four) reads near 0, not as a sure 1."""
    if scores.shape[1] < 2:
        raise LabelError("a margin needs at least two choices")
    wrong = torch.cat([scores[:, :gold], scores[:, gold + 1:]], 1)
    return scores[:, gold] - wrong.max(1).values


def answers_scored(model, tokenizer, item: MCItem, questions: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(right, margin) per question in `questions` (None: as written); `right` is argmax == gold and
    `margin` is `choice_margins`. Questions that compress to the same text are scored once."""
    prompts = [item.prompt(q) for q in questions]
    unique = list(dict.fromkeys(prompts))
    scores = choice_scores(model, tokenizer, unique, item.choices)
    rows = [unique.index(p) for p in prompts]
    return (scores.argmax(1) == item.gold)[rows], choice_margins(scores, item.gold)[rows]


def answers_correct(model, tokenizer, item: MCItem, questions: list[str | None]) -> torch.Tensor:
    """Whether the model answers `item` right when asked each of `questions` (None: as written).
    Questions that compress to the same text are scored once."""
    prompts = [item.prompt(q) for q in questions]
    unique = list(dict.fromkeys(prompts))
    right = choice_scores(model, tokenizer, unique, item.choices).argmax(1) == item.gold
    return right[[unique.index(p) for p in prompts]]


def answer_correct(model, tokenizer, item: MCItem, question: str | None = None) -> bool:
    return bool(answers_correct(model, tokenizer, item, [question])[0])


# --------------------------------------------------------------------------- the sweep


class LabelWorker:
    """Holds the device SDK's model (all level LoRAs read at load) and the TLM; sweeps items without reloading."""

    def __init__(self, package_dir: Path, tlm_dir: Path | None):
        from transformers import AutoTokenizer

        self.package_dir = Path(package_dir)
        self.model = serving_model(self.package_dir)
        self.adapted_levels = list(self.model.adapters)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.package_dir / "model"))
        self.levels = [level.name for level in self.model.manifest.elastic.levels]
        self.tlm = load_tlm(tlm_dir) if tlm_dir is not None else None

    def compress(self, text: str, ratio: float, force_tokens: list[str]) -> str:
        if ratio >= 1.0 or not text:
            return text
        if self.tlm is None:
            raise LabelError("ratios below 1.0 need a TLM (the tlm-score stage's output)")
        return compress(*self.tlm, text, ratio, force_tokens).text

    def set_level(self, level: str) -> None:
        self.model.set_level(level)  # widths and the level's LoRA: zero-copy

    def sweep(self, items: list[MCItem], ratios: list[float], levels: list[str], force_tokens: list[str],
              ctx: StageContext, shots: int = 0) -> torch.Tensor:
        return self.sweep_scored(items, ratios, levels, force_tokens, ctx, shots)[0]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def compressed_prompts(self, items: list[MCItem], ratios: list[float], force_tokens: list[str], shots: int
                           ) -> tuple[dict[tuple[str, int], list[int]], list[list[list[int]]]]:
        """Token ids of every prompt on the grid, as (prefix per (task, ratio index), suffix per item and ratio).

        Prefix: the task's few-shot block and its blank line, the block compressed to the ratio as one
        text (the same for every item of the task). Suffix: the item's prompt, its passage compressed
        to the ratio; its question (or, without a passage, a question written with its context, as
        SciQ's) kept whole when there are shots; with no shots the question is what compresses.
        """
        prefixes = {}
        for task in dict.fromkeys(item.task for item in items):
            block = few_shot_block(task, shots)
            for r, ratio in enumerate(ratios):
                compressed = self.compress(block, ratio, force_tokens)
                prefixes[task, r] = self.ids(compressed + "\n\n") if compressed else []
        suffixes = []
        for item in items:
            rows = []
            for ratio in ratios:
                if shots or item.passage:
                    prompt = item.prompt(passage=self.compress(item.passage, ratio, force_tokens))
                else:  # today's zero-shot labelling: the question is the compressible part
                    prompt = item.prompt(self.compress(item.question, ratio, force_tokens))
                rows.append(self.ids(prompt))
            suffixes.append(rows)
        return prefixes, suffixes

    def sweep_scored(self, items: list[MCItem], ratios: list[float], levels: list[str], force_tokens: list[str],
                     ctx: StageContext, shots: int = 0, reuse_prefix: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct bool, margin float), each [items, ratios, levels]; margins as `choice_margins`.

        One switch per level. Per (task, ratio) the few-shot prefix is prefilled once at that level
        and every item of the task continues its KV cache (`reuse_prefix`; False runs every item's
        whole prompt: the same scores within float error, the baseline of the reuse's speedup).
        """
        correct = torch.zeros(len(items), len(ratios), len(levels), dtype=torch.bool)
        margin = torch.zeros(len(items), len(ratios), len(levels))
        prefixes, suffixes = self.compressed_prompts(items, ratios, force_tokens, shots)
        choices = [choice_ids(self.tokenizer, item.choices) for item in items]
        members: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            members.setdefault(item.task, []).append(i)
        # progress in grid cells (item, ratio, level); the runner and the log throttle the reports
        transformer, done, total = self.model.transformer, 0, len(items) * len(ratios) * len(levels)
        ctx.report("label: grid cells", 0, total)
        for m, level in enumerate(levels):
            self.set_level(level)
            for task, indices in members.items():
                for r in range(len(ratios)):
                    prefix, cache = prefixes[task, r], None
                    if reuse_prefix and prefix:
                        room = max(len(suffixes[i][r]) + max(map(len, choices[i])) for i in indices)
                        cache = transformer.new_cache(len(prefix) + room)
                        transformer.hidden_states(torch.tensor([prefix]), cache)
                    for i in indices:
                        context = suffixes[i][r] if cache is not None else prefix + suffixes[i][r]
                        scores = continuation_scores(transformer, [context], choices[i], cache)
                        correct[i, r, m] = bool(scores[0].argmax() == items[i].gold)
                        margin[i, r, m] = choice_margins(scores, items[i].gold)[0]
                        done += 1
                        ctx.report("label: grid cells", done, total)
        return correct, margin

    def prompt_tokens(self, items: list[MCItem], shots: int = 0) -> torch.Tensor:
        """Tokens of each item's uncompressed prompt, its task's few-shot block included."""
        return torch.tensor([len(self.tokenizer(full_prompt(few_shot_block(item.task, shots), item.prompt()))["input_ids"])
                             for item in items])


def count_kept_tokens(tokenizer, text: str) -> int:
    """Tokens of a prompt's end kept whole, as the SDK counts them (no special tokens)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def label_shard(package_dir: Path, tlm_dir: Path | None, settings: LabelSettings, out_dir: Path,
                ctx: StageContext) -> dict[str, Path]:
    worker = LabelWorker(package_dir, tlm_dir)
    levels = settings.levels or worker.levels
    unknown = set(levels) - set(worker.levels)
    if unknown:
        raise LabelError(f"levels {sorted(unknown)} are not in the package ({worker.levels})")
    if not 0 <= settings.shard < settings.shards:
        raise LabelError(f"shard must be in [0, {settings.shards}), got {settings.shard}")
    items = load_items(settings.tasks, settings.start, settings.stop, settings.per_task)[settings.shard::settings.shards]
    if not items:
        raise LabelError(f"shard {settings.shard} of {settings.shards} holds no items; use fewer shards")
    correct, margin = worker.sweep_scored(items, settings.ratios, levels, settings.force_tokens, ctx, settings.shots)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors_path, meta_path = out_dir / "correctness.safetensors", out_dir / "correctness.json"
    tmp = tensors_path.with_name(f".{tensors_path.name}.tmp")
    save_file({"correct": correct.to(torch.uint8), "margin": margin.contiguous(),
               "prompt_tokens": worker.prompt_tokens(items, settings.shots)}, str(tmp))
    tmp.replace(tensors_path)
    blocks = {task: few_shot_block(task, settings.shots) for task in settings.tasks}
    # "prompt": the whole labelled prompt at ratio 1; "kept": its part no ratio compresses (with shots),
    # and its tokens, which the cost model serves whole at every ratio
    kept = [f"Question: {it.question}\nAnswer:" if settings.shots or it.passage else "" for it in items]
    meta = {"ratios": settings.ratios, "levels": levels, "tasks": settings.tasks, "shots": settings.shots,
            "few_shot": blocks,
            "items": [{"id": it.id, "task": it.task, "prompt": full_prompt(blocks[it.task], it.prompt()),
                       "kept": text, "kept_tokens": count_kept_tokens(worker.tokenizer, text)}
                      for it, text in zip(items, kept, strict=True)]}
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2).encode())
    return {"correctness": tensors_path, "meta": meta_path}


# --------------------------------------------------------------------------- stage entries


def run(inputs: dict[str, Path], settings: LabelSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage `label` (one shard): inputs {"package" (with adapters), "tlm"} -> {"correctness", "meta"}."""
    tlm_dir = Path(inputs["tlm"]) if "tlm" in inputs else None
    return label_shard(Path(inputs["package"]), tlm_dir, settings, ctx.work_dir, ctx)
