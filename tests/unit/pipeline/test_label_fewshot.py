"""Labelled prompts long enough for compression to matter: few-shot blocks from the train split, BoolQ's
passage, compression of the context only, and the few-shot prefix's KV cache reused across items."""

from __future__ import annotations

import pytest
import torch

from tests.support.elastilm_fixtures import (
    recovered_package,
    score_tlm_dir,
    single_thread,  # noqa: F401  (fixture)
    smollm2_elastic_package,
)

SIX_TASKS = ["arc_easy", "obqa", "piqa", "sciq", "siqa", "boolq"]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _shot_question(shot: str) -> str:
    """A shot's text without its answer: what would appear in an item's prompt if the shot were that item."""
    return _norm(shot.rsplit("\nAnswer:", 1)[0])


def test_few_shot_block_is_fixed_and_built_from_train_split_only():
    from pipeline.data.tasks import few_shot_block, load_task, train_shots

    for task in SIX_TASKS:
        shots = train_shots(task)
        assert len(shots) == 5 and len(set(shots)) == 5, task
        train_shots.cache_clear()
        assert train_shots(task) == shots, task  # rebuilt from the files: the same shots in the same order
        assert all("\nAnswer: " in shot and shot.rsplit("\nAnswer: ", 1)[1].strip() for shot in shots), task
        assert few_shot_block(task, 0) == ""
        assert few_shot_block(task, 2) == f"{shots[0]}\n\n{shots[1]}"
        assert few_shot_block(task, 5).startswith(few_shot_block(task, 3))
        # None of the task's shots is one of its validation items (the split that is labelled and held out).
        evaluated = [_norm(item.prompt()) for item in load_task(task)]
        for shot in shots:
            question = _shot_question(shot).removeprefix("question: ")
            assert not any(question in prompt for prompt in evaluated), (task, shot)
    with pytest.raises(ValueError, match="shots"):
        few_shot_block("arc_easy", 6)


def test_labelled_held_out_and_shot_items_are_disjoint():
    """The default labelling range, the report card's held-out items, the benches' held-out range from
    item 300 and every task's shots share no item."""
    from pipeline.data.tasks import load_items, train_shots
    from pipeline.settings import LabelSettings, ReportCardSettings

    settings, card = LabelSettings(), ReportCardSettings()
    assert settings.tasks == SIX_TASKS and settings.shots == 5
    labelled = load_items(settings.tasks, settings.start, settings.stop, settings.per_task)
    assert len(labelled) >= 1200
    held_out = [item for task in settings.tasks for item in load_items([task], card.items_start,
                                                                       card.items_start + card.items)]
    labelled_ids, held_out_ids = {it.id for it in labelled}, {it.id for it in held_out}
    assert len(labelled_ids) == len(labelled) and not labelled_ids & held_out_ids
    # (PIQA asks one goal twice with other solutions: items 164 and 317; as items they differ)
    assert not {(_norm(it.prompt()), *it.choices) for it in labelled} & {(_norm(it.prompt()), *it.choices)
                                                                         for it in held_out}
    shots = {_shot_question(s) for task in settings.tasks for s in train_shots(task)}
    assert not shots & {_norm(it.prompt().rsplit("\nAnswer:", 1)[0]) for it in labelled + held_out}


def test_boolq_loads_with_its_passage():
    from pipeline.data.tasks import load_task

    items = load_task("boolq")
    assert len(items) == 3270
    assert all(item.passage and item.choices == ["yes", "no"] for item in items)
    assert sorted(len(item.passage.split()) for item in items)[len(items) // 2] > 60  # a passage, not a line
    assert {item.gold for item in items} == {0, 1}
    item = items[0]
    prompt = item.prompt()
    assert prompt.startswith(item.passage) and prompt.endswith(f"\nQuestion: {item.question}\nAnswer:")
    assert item.question.endswith("?")


def _text_worker():
    """A label worker with the package's tokenizer and a compressor that keeps every other word (no model)."""
    from transformers import AutoTokenizer

    from pipeline.elastilm.label import LabelWorker

    worker = object.__new__(LabelWorker)
    worker.tokenizer = AutoTokenizer.from_pretrained(str(smollm2_elastic_package() / "model"))
    worker.compress = lambda text, ratio, force: text if ratio >= 1.0 else " ".join(text.split()[::2])
    return worker


def test_compression_touches_only_the_few_shot_block_and_the_passage():
    from pipeline.data.tasks import few_shot_block, full_prompt, load_items

    worker = _text_worker()
    items = load_items(["boolq"], 0, 2) + load_items(["arc_easy"], 0, 2)
    prefixes, suffixes = worker.compressed_prompts(items, [0.5, 1.0], ["?"], shots=3)
    decode = worker.tokenizer.decode
    for i, item in enumerate(items):
        block = few_shot_block(item.task, 3)
        compressed, whole = decode(prefixes[item.task, 0]), decode(prefixes[item.task, 1])
        assert whole == block + "\n\n" and compressed == " ".join(block.split()[::2]) + "\n\n"
        kept = f"Question: {item.question}\nAnswer:"
        assert decode(suffixes[i][0]).endswith(kept) and decode(suffixes[i][1]).endswith(kept)
        if item.passage:  # the passage is compressed, the question after it is not
            assert decode(suffixes[i][0]) == f"{' '.join(item.passage.split()[::2])}\n{kept}"
        else:
            assert decode(suffixes[i][0]) == kept
        # at ratio 1 the two parts are the labelled prompt's tokens
        assert decode(prefixes[item.task, 1] + suffixes[i][1]) == full_prompt(block, item.prompt())


@pytest.mark.usefixtures("single_thread")
def test_few_shot_prefix_cache_reuse_gives_the_scores_of_whole_prompts():
    """The sweep with the prefix's KV cache reused equals the sweep running every whole prompt, and one
    grid cell equals a plain forward of prompt + choice written here."""
    from pipeline.data.tasks import few_shot_block, full_prompt, load_items
    from pipeline.elastilm import label
    from pipeline.stage import quiet_context

    worker = label.LabelWorker(recovered_package(), score_tlm_dir())
    items = load_items(["arc_easy"], 0, 2) + load_items(["boolq"], 0, 1)
    ratios, levels = [0.5, 1.0], ["0.5", "1.0"]  # 0.5 runs its recovery LoRA
    reused = worker.sweep_scored(items, ratios, levels, ["?"], quiet_context(), shots=2, reuse_prefix=True)
    whole = worker.sweep_scored(items, ratios, levels, ["?"], quiet_context(), shots=2, reuse_prefix=False)
    assert torch.equal(reused[0], whole[0])
    assert (reused[1] - whole[1]).abs().max().item() < 1e-4
    item, tokenizer = items[2], worker.tokenizer  # BoolQ at ratio 1, level 1.0
    prompt = full_prompt(few_shot_block("boolq", 2), item.prompt())
    context = tokenizer(few_shot_block("boolq", 2) + "\n\n", add_special_tokens=False)["input_ids"]
    context += tokenizer(item.prompt(), add_special_tokens=False)["input_ids"]
    assert len(context) > 300 and tokenizer.decode(context) == prompt
    worker.set_level("1.0")
    scores = []
    with torch.no_grad():
        for choice in item.choices:
            tokens = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            logits = worker.model.logits(torch.tensor([context + tokens]))[0].log_softmax(-1)
            positions = torch.arange(len(context) - 1, len(context) - 1 + len(tokens))
            scores.append(logits[positions, torch.tensor(tokens)].mean())
    expected = scores[item.gold] - max(s for c, s in enumerate(scores) if c != item.gold)
    assert abs(float(reused[1][2, 1, 1]) - float(expected)) < 1e-4
