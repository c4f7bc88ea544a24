"""Stage `evaluate`: the report card per level and the publish gate.

It evaluates the device SDK's own model (`pipeline.models.elastic.serving_model`), so the report
card's numbers are what a device computes. The report is a separate file; `apply_quality` folds
it into a manifest before publishing.

The report card measures like with like: every level against the full model (level 1.0 as the
package serves it) on the same windows and prompts. Out of domain (LAMBADA, the recovery corpus's
held-out generated slice) that is a plain ratio; in the recovery data's domain (PTB) only against a
full model that had the same recovery (`in_domain_reference`). It marks each level usable or not
(`usable_reasons`), which the manifest records and the SDK's SLO decision respects, and plots
quality against active fraction (`plot_quality`, published as report/quality.png).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from device_sdk.format import Level, Manifest, atomic_write_bytes, read_manifest, rewrite_manifest
from device_sdk.runtime import ElasticModel
from pipeline.data.calibration import cut_windows, make_windows
from pipeline.data.recovery_text import load_heldout_texts
from pipeline.data.tasks import load_items
from pipeline.elastilm.label import answer_correct
from pipeline.elastilm.latency import measure_level_points, profile_from_dict, profile_from_manifest
from pipeline.errors import PipelineError
from pipeline.models.elastic import serving_model
from pipeline.models.scoring import LOGIT_CHUNK
from pipeline.settings import ReportCardSettings
from pipeline.stage import StageContext

REPORT_FILE = "report.json"
QUALITY_PLOT = "report/quality.png"  # where publish puts the evaluate stage's plot in the package
HELDOUT = "heldout"  # the corpus input's held-out generated slice, as a perplexity key (`ppl:heldout`)
# Report-card keys that go into the manifest's per-level `quality`.
QUALITY_KEYS = ("accuracy", "accuracy_stderr", "repeat_4gram_rate", "top1_agreement")

# Generation health: fixed everyday prompts, typed as a user would at the CLI (no chat template).
GENERATION_PROMPTS = (
    "The capital of France is",
    "To boil an egg, you",
    "My favourite thing about summer is",
    "The best way to learn a new language is",
    "Here is a short story about a cat:",
    "What should I cook for dinner tonight?",
    "The weather today is",
    "Water boils at",
    "A good night's sleep helps",
    "The three primary colours are",
    "How do I reset my password?",
    "Dear team, thank you for",
    "The main reason people exercise is",
    "In the morning I usually",
    "Explain why the sky is blue.",
    "The train to London leaves at",
    "Write a sentence about the ocean.",
    "My grandmother always told me that",
    "The most important invention of the last century was",
    "To make a cup of tea, first",
    "Dogs are popular pets because",
    "The city was quiet after the storm, and",
    "Give me three tips for saving money.",
    "The library opens at nine, so",
    "A healthy breakfast includes",
    "The football match ended with",
    "When I was a child, I wanted to be",
    "Photosynthesis is the process by which",
    "The new phone costs",
    "What is the difference between a virus and a bacterium?",
    "Yesterday I went to the market and bought",
    "The moon orbits the Earth every",
)


def apply_quality(package_dir: Path, report: dict) -> None:
    """Record a report's per-level quality in the manifest (file table refreshed, atomic).

    The report card's {levels: {name: {"ppl:<corpus>": …, "ppl_ratio:<corpus>": …, "accuracy": …,
    "usable": …, …}}}: its perplexities, ratios to the full model, accuracy, generation health, and
    usable verdict; per quantised format, its ratios and agreement as "<precision>:<key>".
    """
    manifest = read_manifest(package_dir)
    for level in manifest.elastic.levels:
        row = report["levels"].get(level.name)
        if row is None:
            continue
        for key, value in row.items():
            if value is not None and (key.startswith(("ppl:", "ppl_ratio:")) or key in QUALITY_KEYS):
                level.quality[key] = round(float(value), 4)
        if "usable" in row:
            level.usable = bool(row["usable"])
        for precision, section in report.get("precisions", {}).items():
            for key, value in section["levels"].get(level.name, {}).items():
                if value is not None and key.startswith(("ppl_ratio:", "ppl_ratio_to_float:", "top1_agreement")):
                    level.quality[f"{precision}:{key}"] = round(float(value), 4)
    rewrite_manifest(package_dir, manifest)


# --------------------------------------------------------------------------- stage `evaluate`: the report card and the gate


class PublishGateError(PipelineError):
    """A level's quality beats a wider level's by more than the noise band: do not publish.

    A ValueError so that workers treat it as permanent: the same inputs fail the same way.
    """


def repeated_4gram_rate(outputs: list[list[int]]) -> float:
    """Share of the outputs' token 4-grams that already occurred earlier in the same output, pooled.

    [1, 2, 3, 4, 1, 2, 3, 4] has five 4-grams, the last a repeat of the first: 0.2.
    """
    repeats = sum(len(repeated_ngram_starts(tokens)) for tokens in outputs)
    total = sum(max(len(tokens) - 3, 0) for tokens in outputs)
    return repeats / total if total else 0.0


def repeated_ngram_starts(tokens: list[int], n: int = 4) -> list[int]:
    """Where in `tokens` an n-gram starts that already occurred earlier in them."""
    seen, starts = set(), []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        if gram in seen:
            starts.append(i)
        seen.add(gram)
    return starts


def accuracy_stderr(accuracy: float, items: int) -> float:
    """Binomial standard error of an accuracy over `items` independent items: sqrt(p (1 - p) / n)."""
    return math.sqrt(accuracy * (1.0 - accuracy) / items)


@torch.inference_mode()
def window_predictions(model: ElasticModel, windows: torch.Tensor, batch_size: int = 4) -> tuple[float, torch.Tensor]:
    """(mean next-token NLL, the argmax next token at every position [N, T - 1]) at the model's level.

    One forward pass gives both the perplexity and what top-1 agreement compares; the LM head
    runs in chunks so the logits never fill memory (as pipeline.models.scoring does).
    """
    total, argmax = 0.0, []
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        hidden = model.transformer.hidden_states(batch)[:, :-1].reshape(-1, model.manifest.architecture.hidden)
        targets = batch[:, 1:].reshape(-1)
        tops = []
        for at in range(0, targets.numel(), LOGIT_CHUNK):
            logits = model.transformer.lm_head(hidden[at : at + LOGIT_CHUNK]).float()
            total += F.cross_entropy(logits, targets[at : at + LOGIT_CHUNK], reduction="sum").item()
            tops.append(logits.argmax(-1))
        argmax.append(torch.cat(tops).view(batch.shape[0], -1))
    return total / (windows.shape[0] * (windows.shape[1] - 1)), torch.cat(argmax)


def heldout_windows(tokenizer, corpus_dir: Path, settings: ReportCardSettings) -> torch.Tensor | None:
    """Up to `windows` windows of the recovery corpus's held-out generated slice; None when it is shorter than one."""
    ids = tokenizer("\n\n".join(load_heldout_texts(corpus_dir)), add_special_tokens=False)["input_ids"]
    count = min(settings.windows, len(ids) // settings.window_length)
    if count == 0:
        return None
    return cut_windows(torch.tensor(ids, dtype=torch.long), count, settings.window_length, settings.seed)


def generation_outputs(model: ElasticModel, level: str, settings: ReportCardSettings) -> list[list[int]]:
    """Greedy continuations (token ids, end-of-sequence dropped) of the fixed prompts at `level`."""
    outputs = []
    for prompt in GENERATION_PROMPTS[: settings.generation_prompts]:
        result = model.generate(prompt, max_new_tokens=settings.generation_tokens, level=level)
        outputs.append([token for token in result.tokens if token not in model.eos_ids])
    return outputs


def in_domain_reference(manifest: Manifest, recovery: list[dict]) -> tuple[bool, str]:
    """(whether level 1.0 as served is a like-with-like in-domain reference, why).

    A level recovered on text of the evaluation's domain must be compared with a full model that had
    the same recovery, never the bare one. Level 1.0 as served is that model when it has its own
    recovery LoRA; when recovery was pure distillation from level 1.0 (a level-1.0 LoRA trained the
    same way would stay exactly zero: its student is its teacher, so every gradient is 0); and when
    no level was recovered. Otherwise in-domain ratios are not reported.
    """
    full = max(manifest.elastic.levels, key=lambda shape: shape.level)
    if full.adapter is not None:
        return True, f"level {full.name} with its own recovery LoRA, trained like the other levels'"
    if not any(shape.adapter for shape in manifest.elastic.levels):
        return True, "no level has a recovery LoRA: every level is the elastified model alone"
    settings = [metrics.get("settings", {}) for metrics in recovery]
    if settings and all(s.get("loss") == "distill" and s.get("experimental", {}).get("lm_weight", 0.0) == 0.0
                        for s in settings):
        return True, (f"level {full.name} without a LoRA: every level was distilled from it with no LM loss, so a "
                      f"level-{full.name} LoRA trained the same way stays exactly zero")
    return False, (f"not reported: levels were recovered with an LM loss (or it is unknown how) and the build has "
                   f"no level-{full.name} LoRA trained the same way")


def usable_reasons(row: dict, reference: dict, out_of_domain: list[str], settings: ReportCardSettings) -> list[str]:
    """Why a level is not usable (empty: usable): out-of-domain perplexity or repetition beyond the thresholds."""
    reasons = []
    for key in out_of_domain:
        ratio = row.get(f"ppl_ratio:{key}")
        if ratio is not None and ratio > settings.usable_ppl_ratio:
            reasons.append(f"{key} perplexity is {ratio:.2f}× the full model's (at most {settings.usable_ppl_ratio:g}×)")
    if "repeat_4gram_rate" in row:
        limit = max(settings.usable_repeat_ratio * reference["repeat_4gram_rate"], settings.usable_repeat_floor)
        if row["repeat_4gram_rate"] > limit:
            reasons.append(f"greedy output repeats {row['repeat_4gram_rate']:.3f} of its 4-grams (at most {limit:.3f}: "
                           f"{settings.usable_repeat_ratio:g}× the full model's {reference['repeat_4gram_rate']:.3f})")
    return reasons


def report_card(package_dir: Path, settings: ReportCardSettings, ctx: StageContext, profile=None,
                corpus_dir: Path | None = None, recovery: list[dict] | None = None) -> dict:
    """Per level (with its recovery LoRA), against the full model: perplexity and its ratio per corpus,
    held-out accuracy with its standard error, generation health, top-1 agreement, the usable verdict,
    and predicted and measured latency.

    Then the same per quantised format of `settings.precisions` (the SDK's block formats, quantised at
    load; perplexity runs the prefill path, which dequantises the weights, so it measures the weights'
    rounding, while decode also quantises activations): ratios to the same level in full precision and to
    the full model, top-1 agreement with both, and a usable verdict judged against the full model.

    `profile` is the cost model to predict latency with; by default the package's own, if it has one.
    `corpus_dir` (a recovery corpus) adds its held-out generated slice; `recovery` (the recover
    stage's metrics per level) says how the levels were recovered (see `in_domain_reference`).
    """
    from transformers import AutoTokenizer

    package_dir = Path(package_dir)
    model = serving_model(package_dir)
    manifest = model.manifest
    tokenizer = AutoTokenizer.from_pretrained(str(package_dir / "model"))
    windows = {c: make_windows(tokenizer, c, settings.windows, settings.window_length, settings.seed)
               for c in settings.corpora}
    if corpus_dir is not None and (held := heldout_windows(tokenizer, Path(corpus_dir), settings)) is not None:
        windows[HELDOUT] = held
    in_domain = [c for c in windows if c in settings.in_domain]
    out_of_domain = [c for c in windows if c not in settings.in_domain]
    in_domain_ok, in_domain_why = in_domain_reference(manifest, recovery or [])
    items = [it for task in settings.tasks for it in load_items([task], settings.items_start,
                                                                 settings.items_start + settings.items)]
    if profile is None and manifest.latency_profile:
        profile = profile_from_manifest(manifest)
    # Largest first: the full model is every other level's reference.
    ordered = sorted(manifest.elastic.levels, key=lambda shape: shape.level, reverse=True)
    reference_name = ordered[0].name
    levels, argmax = {}, {}
    for level in ctx.track(ordered, "evaluate: report card"):
        model.set_level(level.name)  # widths and the level's LoRA
        row, argmax[level.name] = _level_row(model, windows, items, tokenizer, settings)
        row.update(active_fraction=level.active_fraction, adapted=level.adapter is not None)
        _agreement(row, "top1_agreement", argmax[level.name], argmax[reference_name], out_of_domain)
        if profile is not None and level.name in profile.levels:
            row["predicted_ttft_ms"] = profile.ttft_ms(level.name, settings.prompt_tokens)
            row["predicted_tpot_ms"] = profile.tpot_ms(level.name)
        if settings.measure_latency:
            ttft, tpot = measure_level_points(model, [settings.prompt_tokens], decode_tokens=4, repeats=1)
            row["measured_ttft_ms"], row["measured_tpot_ms"] = ttft[settings.prompt_tokens], tpot
        levels[level.name] = row
    reference = levels[reference_name]
    ratio_corpora = out_of_domain + (in_domain if in_domain_ok else [])
    for name, row in levels.items():
        _ratios(row, "ppl_ratio", reference, ratio_corpora)
        reasons = [] if name == reference_name else usable_reasons(row, reference, out_of_domain, settings)
        row["usable"], row["unusable_because"] = not reasons, reasons
    precisions = {}
    for precision in settings.precisions:
        quantised = ElasticModel.load(package_dir, verify=False, allow_unsigned=True, quantize=precision)
        rows = {}
        for level in ctx.track(ordered, f"evaluate: report card at {precision}"):
            quantised.set_level(level.name)
            row, top = _level_row(quantised, windows, items, tokenizer, settings)
            row["active_fraction"] = level.active_fraction
            _agreement(row, "top1_agreement", top, argmax[reference_name], out_of_domain)
            _agreement(row, "top1_agreement_with_float", top, argmax[level.name], out_of_domain)
            _ratios(row, "ppl_ratio", reference, ratio_corpora)
            _ratios(row, "ppl_ratio_to_float", levels[level.name], list(windows))
            # Judged against the full model in full precision: what a device serving this precision gives up.
            reasons = usable_reasons(row, reference, out_of_domain, settings)
            row["usable"], row["unusable_because"] = not reasons, reasons
            rows[level.name] = row
        precisions[precision] = {"levels": {name: rows[name] for name in sorted(rows, key=Level)}}
        del quantised
    return {"levels": {name: levels[name] for name in sorted(levels, key=Level)},
            "reference_level": reference_name, "out_of_domain": out_of_domain, "in_domain": in_domain,
            "in_domain_reference": in_domain_why, "items": len(items), "tasks": settings.tasks,
            "corpora": list(windows), "windows": {c: list(w.shape) for c, w in windows.items()},
            "generation": {"prompts": settings.generation_prompts, "tokens": settings.generation_tokens},
            "usable_thresholds": {"ppl_ratio": settings.usable_ppl_ratio, "repeat_ratio": settings.usable_repeat_ratio,
                                  "repeat_floor": settings.usable_repeat_floor},
            "prompt_tokens": settings.prompt_tokens, "precisions": precisions}


def _level_row(model: ElasticModel, windows: dict[str, torch.Tensor], items: list, tokenizer,
               settings: ReportCardSettings) -> tuple[dict, dict[str, torch.Tensor]]:
    """The model's measurements at its current level: perplexity per corpus, held-out accuracy and
    generation health, with the argmax next tokens per corpus that top-1 agreement compares."""
    row: dict = {}
    argmax = {}
    for corpus, corpus_windows in windows.items():
        nll, argmax[corpus] = window_predictions(model, corpus_windows)
        row[f"ppl:{corpus}"] = math.exp(nll)
    if items:
        row["accuracy"] = sum(answer_correct(model, tokenizer, it) for it in items) / len(items)
        row["accuracy_stderr"] = accuracy_stderr(row["accuracy"], len(items))
    if settings.generation_prompts:
        row["repeat_4gram_rate"] = repeated_4gram_rate(generation_outputs(model, model.level, settings))
    return row, argmax


def _agreement(row: dict, key: str, argmax: dict, reference: dict, corpora: list[str]) -> None:
    """Top-1 agreement of `argmax` with `reference` over `corpora`'s positions, as row[key] (none: no corpus)."""
    compared = sum(argmax[c].numel() for c in corpora)
    if compared:
        row[key] = sum(int((argmax[c] == reference[c]).sum()) for c in corpora) / compared


def _ratios(row: dict, prefix: str, reference: dict, corpora: list[str]) -> None:
    for corpus in corpora:
        row[f"{prefix}:{corpus}"] = row[f"ppl:{corpus}"] / reference[f"ppl:{corpus}"]


def plot_quality(card: dict, path: Path) -> Path:
    """A PNG of quality against active fraction, one point per level: perplexity ratios to the full
    model (left), accuracy ± one standard error, top-1 agreement and repeated-4-gram rate (right).
    Levels marked unusable are drawn hollow."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker
    import matplotlib.pyplot as plt

    names = sorted(card["levels"], key=Level)
    rows = [card["levels"][name] for name in names]
    x = [row["active_fraction"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    def series(axis, key, label, errors=None):
        points = [(xi, row[key], row.get(errors, 0.0) if errors else 0.0, row.get("usable", True))
                  for xi, row in zip(x, rows, strict=True) if row.get(key) is not None]
        if not points:
            return
        line = axis.plot([p[0] for p in points], [p[1] for p in points], "-", label=label)[0]
        if errors:
            axis.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], fmt="none",
                          ecolor=line.get_color(), capsize=3)
        for xi, yi, _, usable in points:
            axis.plot(xi, yi, "o", color=line.get_color(), markerfacecolor=line.get_color() if usable else "white")

    ratio_keys = sorted({k for row in rows for k in row if k.startswith("ppl_ratio:")})
    for key in ratio_keys:
        domain = "in domain" if key.split(":", 1)[1] in card.get("in_domain", []) else "out of domain"
        series(left, key, f"{key.split(':', 1)[1]} ({domain})")
    for precision, section in card.get("precisions", {}).items():  # dashed: the quantised formats
        quantised = [section["levels"][name] for name in names if name in section["levels"]]
        for key in (k for k in ratio_keys if k.split(":", 1)[1] in card.get("out_of_domain", [])):
            points = [(row["active_fraction"], row[key]) for row in quantised if row.get(key) is not None]
            left.plot([p[0] for p in points], [p[1] for p in points], "--", marker=".",
                      label=f"{key.split(':', 1)[1]} at {precision}")
    left.axhline(card.get("usable_thresholds", {}).get("ppl_ratio", 3.0), color="grey", linestyle="--",
                 linewidth=0.8, label="usable limit")
    left.set_yscale("log")
    left.set(xlabel="active fraction", ylabel="perplexity / full model's", title="Perplexity ratio")
    series(right, "accuracy", f"accuracy ({card.get('items', 0)} held-out items)", errors="accuracy_stderr")
    series(right, "top1_agreement", "top-1 agreement with the full model")
    series(right, "repeat_4gram_rate", "repeated-4-gram rate (greedy)")
    right.set(xlabel="active fraction", ylabel="fraction", title="Accuracy and generation health", ylim=(0, 1))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a cheap card (perplexity only) leaves the right panel empty
            axis.legend(fontsize=8)
    fig.suptitle("Quality per level (hollow: not usable)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gate_failures(card: dict, ppl_noise: float, accuracy_noise: float | None) -> list[str]:
    """Every (narrow, wide) level pair where the narrower one is better by more than the noise band.

    Levels are compared like with like: with a recovery adapter or without. A narrow level whose
    LoRA was trained on the evaluation's domain (PTB train for PTB test, by default) may well beat
    the unadapted full model; that says nothing about the level order.
    """
    names = sorted(card["levels"], key=Level)
    failures = []
    for i, narrow in enumerate(names):
        for wide in names[i + 1:]:
            a, b = card["levels"][narrow], card["levels"][wide]
            if a.get("adapted", False) != b.get("adapted", False):
                continue
            for key in (k for k in a if k.startswith("ppl:") and k in b):
                if a[key] < b[key] * (1 - ppl_noise):
                    failures.append(f"level {narrow} has {key} {a[key]:.3f}, better than wider level {wide}'s "
                                    f"{b[key]:.3f} by more than the {ppl_noise:.0%} noise band")
            if "accuracy" in a and "accuracy" in b:
                band = accuracy_noise
                if band is None:
                    p, n = b["accuracy"], max(card.get("items", 1), 1)
                    band = 2 * math.sqrt(max(p * (1 - p), 1.0 / n) / n)
                if a["accuracy"] > b["accuracy"] + band:
                    failures.append(f"level {narrow} answers {a['accuracy']:.3f} of held-out items, more than wider "
                                    f"level {wide}'s {b['accuracy']:.3f} plus the noise band {band:.3f}")
    return failures


def check_gate(card: dict, ppl_noise: float = 0.02, accuracy_noise: float | None = None) -> None:
    failures = gate_failures(card, ppl_noise, accuracy_noise)
    if failures:
        raise PublishGateError("publish gate failed: quality rises as width falls, so the level order or a "
                               "level's adapter is wrong:\n  " + "\n  ".join(failures))


def run_card(inputs: dict[str, Path], options: ReportCardSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage `evaluate`: inputs {"package", optional "latency", "corpus", "recovery.<level>"…}
    -> {"report_card": json, "quality_plot": png}.

    Raises PublishGateError when the gate fails. The card and plot are written before the gate is
    checked, so a failed build still shows its numbers.
    """
    profile = None
    if "latency" in inputs:
        profile = profile_from_dict(json.loads(Path(inputs["latency"]).read_text())["latency_profile"])
    recovery = [json.loads(Path(path).read_text()) for key, path in sorted(inputs.items())
                if key.startswith("recovery.")]
    card = report_card(Path(inputs["package"]), options, ctx, profile,
                       corpus_dir=Path(inputs["corpus"]) if "corpus" in inputs else None, recovery=recovery)
    card["gate"] = gate_failures(card, options.ppl_noise, options.accuracy_noise)
    out = ctx.work_dir / "report_card.json"
    atomic_write_bytes(out, json.dumps(card, indent=2).encode())
    plot = plot_quality(card, ctx.work_dir / "quality.png")
    if options.gate:
        check_gate(card, options.ppl_noise, options.accuracy_noise)
    return {"report_card": out, "quality_plot": plot}


def install_quality_plot(package_dir: Path, plot: Path) -> None:
    """Publish installer: the evaluate stage's plot as report/quality.png, in the manifest's file table."""
    atomic_write_bytes(Path(package_dir) / QUALITY_PLOT, Path(plot).read_bytes())
    rewrite_manifest(package_dir, read_manifest(package_dir))
