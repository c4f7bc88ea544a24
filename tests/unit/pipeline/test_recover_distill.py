"""Recovery by distillation from the same weights at level 1.0, and warm start from a larger level's LoRA."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from pipeline.elastilm.recover import (
    LevelViews,
    RecoverError,
    add_lora,
    corrected_rollout,
    distill_loss,
    divergence,
    eval_loss,
    eval_loss_and_kl,
    lm_loss,
    make_loss,
    repeated_ngram_positions,
    run,
    student_rollout,
    teacher_mode,
    teacher_targets,
    train_torch,
    warm_start,
)
from pipeline.models.elastic import ElasticCausalLM
from pipeline.settings import RecoverExperiments, RecoverSettings
from pipeline.stage import quiet_context
from tests.support.tiny import byte_tokenizer, tiny_model

LEVELS = [0.5, 0.7, 1.0]
FAST = {"steps": 4, "batch_size": 2, "seq_len": 32, "eval_windows": 4, "lr": 1e-2, "warmup_steps": 1,
        "rank": 4, "alpha": 8.0, "dropout": 0.0}


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    from tests.support.pipeline_packages import build_package
    from tests.support.sdk_packages import signing_key

    return build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path_factory.mktemp("pkg") / "pkg",
                         signing_key(), levels=LEVELS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import treebank

    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(treebank.penn["valid"][:40000])
    return path


def _batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, 256, (count, 2, 24), generator=torch.Generator().manual_seed(seed))
    return [(batch, batch) for batch in ids]


def _run(inputs: dict, settings: dict, work: Path) -> dict[str, Path]:
    return run(inputs, RecoverSettings(**settings), quiet_context(work))


def _student(package: Path, level: str, **settings):
    model = ElasticCausalLM.from_package(package)
    views = LevelViews(model, level)
    options = RecoverSettings(level=level, **{**FAST, **settings})
    torch.manual_seed(0)
    return views, add_lora(views.hf, options), options


def _lora_params(peft_model) -> list[torch.nn.Parameter]:
    return [p for n, p in peft_model.named_parameters() if "lora_" in n]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_distillation_moves_only_the_lora(package, precision):
    views, peft_model, settings = _student(package, "0.5", precision=precision)
    storages = {source.storage.data_ptr(): source.storage.clone() for source, _ in views.pairs}
    base = {p.data_ptr(): p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    train_torch(peft_model, views.hf, _batches(3), settings, quiet_context(),
                make_loss(settings, views, "1.0", peft_model))

    frozen = [p for n, p in peft_model.named_parameters() if "lora_" not in n]
    assert {p.data_ptr() for p in frozen} == set(base)  # the same tensors, not replacements
    for param in frozen:
        assert param.grad is None and not param.requires_grad
        assert torch.equal(param, base[param.data_ptr()])
    for source, view in views.pairs:  # the student's views still point at the package storage
        assert view.weight.data_ptr() == source.storage.data_ptr()
        assert torch.equal(source.storage, storages[source.storage.data_ptr()])
    assert any(torch.count_nonzero(p) for n, p in peft_model.named_parameters() if "lora_B" in n)


def test_bf16_training_autocasts_the_matmuls_and_keeps_the_lora_and_the_base_in_their_dtypes(package):
    views, peft_model, settings = _student(package, "0.5", precision="bfloat16")
    loss = make_loss(settings, views, "1.0", peft_model)
    hidden_dtypes = []
    views.hf.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: hidden_dtypes.append(out.dtype))
    train_torch(peft_model, views.hf, _batches(1), settings, quiet_context(), loss)
    assert hidden_dtypes and set(hidden_dtypes) == {torch.bfloat16}  # teacher and student passes alike
    assert all(p.dtype == torch.float32 for p in _lora_params(peft_model))
    assert all(source.storage.dtype == torch.float32 for source, _ in views.pairs)

    views, peft_model, settings = _student(package, "0.5", precision="float32")
    hidden_dtypes.clear()
    views.hf.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: hidden_dtypes.append(out.dtype))
    train_torch(peft_model, views.hf, _batches(1), settings, quiet_context(),
                make_loss(settings, views, "1.0", peft_model))
    assert set(hidden_dtypes) == {torch.float32}


def test_auto_precision_is_bf16_on_cuda_and_on_cpus_with_native_bf16_only(monkeypatch):
    from pipeline.models import precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        assert precision.training_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
        assert precision.training_dtype("auto", cuda) == torch.bfloat16
        assert precision.training_dtype("float32", cuda) == torch.float32
        assert precision.training_dtype("bfloat16", cpu) == torch.bfloat16


def test_on_policy_distillation_trains_on_the_levels_own_greedy_text_and_moves_only_the_lora(package):
    views, peft_model, settings = _student(package, "0.5", experimental={"on_policy": 1.0, "rollout_prefix": 8})
    ids = _batches(1, seed=3)[0][0]
    rolled, labels = student_rollout(views.hf, ids, 8)
    assert rolled.shape == ids.shape and torch.equal(rolled[:, :8], ids[:, :8])
    assert (labels[:, :8] == -100).all() and torch.equal(labels[:, 8:], rolled[:, 8:])
    with torch.no_grad():  # each token is the level's own argmax after the tokens before it
        logits = views.hf(input_ids=rolled).logits
    assert torch.equal(logits[:, 7:-1].argmax(-1), rolled[:, 8:])
    assert torch.equal(student_rollout(views.hf, ids, 8)[0], rolled)  # greedy: deterministic

    base = {p.data_ptr(): p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    seen = []
    loss = make_loss(settings, views, "1.0", peft_model)
    train_torch(peft_model, views.hf, _batches(2), settings, quiet_context(),
                lambda i, lab: seen.append(lab) or loss(i, lab))
    for name, param in peft_model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base[param.data_ptr()]) and param.grad is None
    assert any(torch.count_nonzero(p) for n, p in peft_model.named_parameters() if "lora_B" in n)
    assert views.hf.training is False  # train_torch leaves eval mode; the rollout restored training in between
    with pytest.raises(RecoverError, match="rollout_prefix"):
        student_rollout(views.hf, ids, ids.shape[1])


def test_corrected_rollout_keeps_the_levels_tokens_the_full_model_ranks_and_replaces_the_rest(package):
    views, peft_model, settings = _student(package, "0.5", experimental={
        "on_policy": 1.0, "rollout_prefix": 6, "rollout": "corrected", "correct_top_k": 16})
    for param in peft_model.parameters():  # a LoRA that moves the level's argmax, so student and teacher differ
        if param.requires_grad:
            torch.nn.init.normal_(param, std=0.2, generator=torch.Generator().manual_seed(1))
    ids = _batches(1, seed=5)[0][0]
    vocab = views.hf.config.vocab_size
    rolled, labels = corrected_rollout(views, "1.0", peft_model, ids, 6, 16)
    assert rolled.shape == ids.shape and torch.equal(rolled[:, :6], ids[:, :6])
    assert (labels[:, :6] == -100).all() and torch.equal(labels[:, 6:], rolled[:, 6:])
    assert views.model.level == "0.5"  # back at the student's level
    with torch.no_grad():
        student = views.hf(input_ids=rolled).logits[:, 5:-1].argmax(-1)
        with teacher_mode(views, "1.0", peft_model):
            teacher = views.hf(input_ids=rolled).logits[:, 5:-1]
    allowed = teacher.topk(16, dim=-1).indices
    written = rolled[:, 6:]
    in_top = (allowed == student[..., None]).any(-1)
    assert torch.equal(written[in_top], student[in_top])  # the level's token wherever the full model ranks it
    assert torch.equal(written[~in_top], allowed[..., 0][~in_top])  # else the full model's argmax
    assert in_top.any() and (~in_top).any()  # both cases happen here
    # The two ends: a top-k of the whole vocabulary is the level alone, a top-1 the full model alone.
    assert torch.equal(corrected_rollout(views, "1.0", peft_model, ids, 6, vocab)[0], student_rollout(views.hf, ids, 6)[0])
    with teacher_mode(views, "1.0", peft_model):
        teacher_alone = student_rollout(views.hf, ids, 6)[0]
    assert torch.equal(corrected_rollout(views, "1.0", peft_model, ids, 6, 1)[0], teacher_alone)

    loss = make_loss(settings, views, "1.0", peft_model)
    base = {p.data_ptr(): p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    train_torch(peft_model, views.hf, _batches(2), settings, quiet_context(), loss)
    for name, param in peft_model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base[param.data_ptr()]) and param.grad is None


def test_repeated_ngram_positions_mark_every_token_of_a_repeat_after_the_prefix():
    ids = torch.tensor([[9, 9, 9, 9, 1, 2, 3, 4, 1, 2, 3, 4, 5],
                        [9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 0]])
    marked = repeated_ngram_positions(ids, start=4)
    assert marked[0].tolist() == [False] * 8 + [True] * 4 + [False]  # the second 1 2 3 4
    assert not marked[1].any()
    assert not repeated_ngram_positions(ids, start=0)[1].any()  # the prefix's 9 9 9 9 occurs once


def test_unlikelihood_adds_minus_log_one_minus_p_at_the_repeated_tokens(package):
    views, peft_model, _ = _student(package, "0.5")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    repeated = repeated_ngram_positions(ids, start=0)
    teacher = teacher_targets(views, "1.0", peft_model, ids, ids, 1.0, 0)
    with torch.no_grad():
        plain = distill_loss(views.hf, ids, ids, teacher, 1.0)
        with_ul = distill_loss(views.hf, ids, ids, teacher, 1.0, repeated=repeated, unlikelihood=0.5)
        probs = views.hf(input_ids=ids).logits[0, :-1].float().softmax(-1)
    chosen = probs.gather(-1, ids[0, 1:, None]).squeeze(-1)[repeated[0, 1:]]
    expected = plain - 0.5 * torch.log1p(-chosen).sum() / (ids.shape[1] - 1)
    assert repeated.sum() == 8 and torch.allclose(with_ul, expected, atol=1e-5) and with_ul > plain


def test_the_teacher_pass_copies_no_weights_and_is_the_bare_full_model(package):
    views, peft_model, settings = _student(package, "0.5")
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a LoRA that would change the output if it were not bypassed
    student_shapes = [tuple(view.weight.shape) for _, view in views.pairs]
    ids = _batches(1, seed=5)[0][0]
    with teacher_mode(views, "1.0", peft_model), torch.no_grad():
        for source, view in views.pairs:
            assert view.weight.data_ptr() == source.storage.data_ptr()
            full = source.storage if source.unit_axis == "out" else source.storage.t()
            assert view.weight.shape == full.shape  # the whole storage: level 1.0
        teacher_logits = views.hf(input_ids=ids).logits
    assert [tuple(view.weight.shape) for _, view in views.pairs] == student_shapes  # back at level 0.5

    reference = ElasticCausalLM.from_package(package)
    reference.set_level("1.0")
    with torch.no_grad():
        assert torch.allclose(teacher_logits, reference(ids).logits, atol=1e-5)
        # and the student (LoRA on) is a different model
        assert not torch.allclose(views.hf(input_ids=ids).logits[..., :8], teacher_logits[..., :8], atol=1e-3)


@pytest.mark.parametrize("top_k", [0, 16])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_distill_loss_is_zero_for_the_teacher_itself_and_positive_below(package, top_k, temperature, kind):
    ids, labels = _batches(1, seed=3)[0]
    for level, expect_zero in (("1.0", True), ("0.5", False)):
        views, peft_model, _ = _student(package, level)  # peft starts B at zero: the LoRA adds nothing yet
        with torch.no_grad():
            teacher = teacher_targets(views, "1.0", peft_model, ids, labels, temperature, top_k)
            loss = distill_loss(views.hf, ids, labels, teacher, temperature, kind=kind).item()
        if top_k:
            assert teacher.logprobs.shape == (ids[:, 1:].numel(), top_k + 1)
            assert torch.allclose(teacher.logprobs.exp().sum(-1), torch.ones(ids[:, 1:].numel()), atol=1e-5)
        if expect_zero:
            assert abs(loss) < 1e-6, (level, loss)
        else:
            assert loss > 1e-4, (level, loss)


def test_divergences_match_their_definitions():
    generator = torch.Generator().manual_seed(0)
    teacher, student = (torch.randn(5, 40, generator=generator).log_softmax(-1) for _ in range(2))
    p, q = teacher.exp(), student.exp()
    forward = (p * (teacher - student)).sum()
    assert divergence(student, teacher, "forward").item() == pytest.approx(forward.item(), rel=1e-5)
    assert divergence(student, teacher, "reverse").item() == pytest.approx((q * (student - teacher)).sum().item(),
                                                                          rel=1e-5)
    assert divergence(teacher, student, "reverse").item() == pytest.approx(forward.item(), rel=1e-5)
    for beta in (0.5, 0.1):
        mixture = beta * p + (1 - beta) * q
        expected = beta * (p * (p / mixture).log()).sum() + (1 - beta) * (q * (q / mixture).log()).sum()
        assert divergence(student, teacher, "jsd", beta).item() == pytest.approx(expected.item(), rel=1e-5)
    # JSD at beta 1/2 is at most log 2 a row; every divergence is zero between a row and itself
    assert divergence(student, teacher, "jsd").item() <= 5 * math.log(2)
    for kind in ("forward", "reverse", "jsd"):
        assert abs(divergence(teacher, teacher, kind).item()) < 1e-5


@pytest.mark.parametrize("kind", ["reverse", "jsd"])
def test_the_divergence_setting_reaches_the_training_loss_and_trains_only_the_lora(package, kind):
    views, peft_model, options = _student(package, "0.5", experimental={"divergence": kind, "jsd_beta": 0.3})
    ids, labels = _batches(1, seed=6)[0]
    with torch.no_grad():
        teacher = teacher_targets(views, "1.0", peft_model, ids, labels, 1.0, 0)
        expected = distill_loss(views.hf, ids, labels, teacher, 1.0, kind=kind, beta=0.3).item()
        forward = distill_loss(views.hf, ids, labels, teacher, 1.0).item()
    loss = make_loss(options, views, "1.0", peft_model)(ids, labels)
    assert loss.item() == pytest.approx(expected, rel=1e-5) and expected != pytest.approx(forward, rel=1e-5)
    loss.backward()
    moved = {n for n, p in peft_model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert moved and all("lora_" in n for n in moved)


def test_distill_loss_adds_the_weighted_lm_loss(package):
    views, peft_model, _ = _student(package, "0.5")
    ids, labels = _batches(1, seed=4)[0]
    with torch.no_grad():
        teacher = teacher_targets(views, "1.0", peft_model, ids, labels, 1.0, 0)
        kl = distill_loss(views.hf, ids, labels, teacher, 1.0).item()
        mixed = distill_loss(views.hf, ids, labels, teacher, 1.0, lm_weight=0.5).item()
        assert mixed == pytest.approx(kl + 0.5 * lm_loss(views.hf, ids, labels).item(), rel=1e-5)


def test_the_evaluation_pass_gives_the_levels_nll_and_its_kl_to_the_full_model(package):
    """One student pass for both numbers: each equals its own definition, window by window averaged."""
    views, peft_model, _ = _student(package, "0.5")
    windows = torch.randint(0, 256, (5, 24), generator=torch.Generator().manual_seed(7))
    nll, kl = eval_loss_and_kl(views, "1.0", peft_model, windows, batch_size=2)
    assert nll == pytest.approx(eval_loss(views.hf, windows, 2), rel=1e-5)
    with torch.no_grad():
        per_window = [distill_loss(views.hf, w[None], w[None], teacher_targets(views, "1.0", peft_model, w[None],
                                                                              w[None], 1.0, 0), 1.0).item()
                      for w in windows]
    assert kl == pytest.approx(sum(per_window) / len(per_window), rel=1e-5) and kl > 0


# A random tiny model's levels differ little (held-out KL ~0.009 nats), so the margins are modest;
# measured: 0.0090 -> 0.0060 (full vocabulary, T=1) and -> 0.0081 (top-8 buckets, T=2) in 40 steps.
@pytest.mark.parametrize("top_k, temperature, factor", [(0, 1.0, 0.8), (8, 2.0, 0.97)])
def test_distillation_lowers_the_held_out_kl_to_the_full_model(package, corpus, tmp_path, top_k, temperature, factor):
    settings = {**FAST, "level": "0.5", "steps": 40, "lr": 3e-3, "top_k": top_k, "temperature": temperature,
                "corpus": [str(corpus)], "eval_corpus": [str(corpus)]}
    outputs = _run({"package": package}, settings, tmp_path)
    metrics = json.loads(Path(outputs["metrics"]).read_text())
    assert metrics["teacher_level"] == "1.0" and metrics["settings"]["loss"] == "distill"
    assert metrics["eval_kl_after"] < factor * metrics["eval_kl_before"], metrics
    assert metrics["train_tokens"] == 40 * 2 * 31


def test_warm_start_takes_the_prefix_of_the_larger_levels_lora(package, corpus, tmp_path):
    settings = {**FAST, "corpus": [str(corpus)], "eval_corpus": [str(corpus)]}
    larger = _run({"package": package}, {**settings, "level": "0.7"}, tmp_path / "0.7")["adapter"]
    source = load_file(str(larger))

    views, peft_model, options = _student(package, "0.5")
    assert warm_start(peft_model, larger, options) == len(source) // 2
    shrunk = 0
    for name, module in peft_model.named_modules():
        if "default" not in getattr(module, "lora_A", {}):
            continue
        key = name[name.index("model.layers."):].replace(".self_attn.inner.", ".self_attn.")
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        assert torch.equal(a, source[f"{key}.lora_A"][:, : a.shape[1]])
        assert torch.equal(b, source[f"{key}.lora_B"][: b.shape[0]])
        shrunk += a.shape[1] < source[f"{key}.lora_A"].shape[1] or b.shape[0] < source[f"{key}.lora_B"].shape[0]
    assert shrunk  # level 0.5 really is narrower somewhere, so the slices were taken

    outputs = _run({"package": package, "init_adapter": larger}, {**settings, "level": "0.5", "warm_start": True},
                   tmp_path / "0.5")
    metrics = json.loads(Path(outputs["metrics"]).read_text())
    assert metrics["warm_start_from"] == str(larger) and metrics["steps"] == FAST["steps"]
    trained = load_file(str(outputs["adapter"]))
    moved = [not torch.equal(t, source[k][: t.shape[0], : t.shape[1]]) for k, t in trained.items()]
    assert any(moved)  # training went on from the slices


def test_warm_start_refuses_a_smaller_level_and_a_stray_init_adapter(package, corpus, tmp_path):
    settings = {**FAST, "corpus": [str(corpus)], "eval_corpus": [str(corpus)]}
    smaller = _run({"package": package}, {**settings, "level": "0.5"}, tmp_path / "0.5")["adapter"]
    views, peft_model, options = _student(package, "0.7")
    with pytest.raises(RecoverError, match="narrower"):
        warm_start(peft_model, smaller, options)
    with pytest.raises(RecoverError, match="warm_start"):
        _run({"package": package, "init_adapter": smaller}, {**settings, "level": "0.5", "warm_start": False}, tmp_path)


def test_lm_loss_is_still_an_option(package, corpus, tmp_path):
    settings = {**FAST, "level": "0.5", "loss": "lm", "corpus": [str(corpus)], "eval_corpus": [str(corpus)]}
    metrics = json.loads(Path(_run({"package": package}, settings, tmp_path)["metrics"]).read_text())
    assert metrics["settings"]["loss"] == "lm"
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]


def test_recover_trains_on_a_recovery_corpus_directory(package, corpus, tmp_path):
    from pipeline.data.recovery_text import RECOVERY_FILE

    directory = tmp_path / "corpus"
    directory.mkdir()
    texts = [t for t in corpus.read_text().split("\n") if t.strip()]
    # A small "generated" kind and a large "ptb" kind; no passages, so the mix is renormalised over the two.
    records = [{"source": "generated:squad", "text": t} for t in texts[:4]] + [
        {"source": "ptb-train", "text": t} for t in texts[4:]]
    (directory / RECOVERY_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {**FAST, "level": "0.5", "corpus": ["/no/such/named/corpus.txt"], "eval_corpus": [str(corpus)],
                "mix": {"generated": 0.5, "passages": 0.3, "ptb": 0.2}}
    metrics = json.loads(Path(_run({"package": package, "corpus": directory}, settings, tmp_path / "out")["metrics"])
                         .read_text())
    assert metrics["steps"] == FAST["steps"]  # trained on the directory's texts, not the named (missing) corpus
    windows = FAST["steps"] * FAST["batch_size"]
    assert set(metrics["mix"]) == {"generated", "ptb"}
    assert metrics["mix"]["generated"]["windows"] + metrics["mix"]["ptb"]["windows"] == windows
    assert metrics["mix"]["generated"]["windows"] == round(windows * 0.5 / 0.7)


def test_text_windows_match_the_named_corpus_windows(corpus):
    from pipeline.data.calibration import make_windows, text_windows

    tokenizer = byte_tokenizer()
    assert torch.equal(text_windows(tokenizer, [corpus.read_text()], 8, 32, seed=3),
                       make_windows(tokenizer, [str(corpus)], 8, 32, seed=3))


@pytest.mark.parametrize("bad", [{"loss": "mse"}, {"temperature": 0.0}, {"top_k": -1}, {"lm_weight": -0.1},
                                 {"on_policy": 1.5}, {"on_policy": 0.5, "loss": "lm"},
                                 {"rollout_prefix": 64, "on_policy": 0.5, "seq_len": 64},
                                 {"unlikelihood": 1.0}, {"unlikelihood": -1.0, "on_policy": 0.5},
                                 {"rollout": "corrected"}, {"rollout": "teacher", "on_policy": 0.5},
                                 {"correct_top_k": 0, "on_policy": 0.5, "rollout": "corrected"},
                                 {"divergence": "kl"}, {"jsd_beta": 1.0}, {"jsd_beta": 0.0}])
def test_distillation_settings_are_checked(bad):
    """Each bad value or combination is refused, at the setting it names (the research levers' at `experimental`)."""
    name = next(iter(bad))
    experimental = {key: value for key, value in bad.items() if key in RecoverExperiments.model_fields}
    own = {key: value for key, value in bad.items() if key not in experimental}
    with pytest.raises(ValidationError, match=name) as refused:
        RecoverSettings(level="0.5", **own, **({"experimental": experimental} if experimental else {}))
    assert refused.value.errors()[0]["loc"][0] == ("experimental" if name in experimental else name)


# Every lever a screen rejected (docs/results/recovery.md, 'What was tried on recovery'); the default build uses none.
RESEARCH_LEVERS = {"divergence": "reverse", "jsd_beta": 0.3, "lm_weight": 1.0, "on_policy": 0.5, "rollout_prefix": 8,
                   "rollout": "corrected", "correct_top_k": 3, "unlikelihood": 1.0}


def test_the_research_levers_are_off_under_experimental_and_refused_at_the_top():
    defaults = RecoverSettings()
    assert set(RecoverExperiments.model_fields) == set(RESEARCH_LEVERS)
    assert set(RESEARCH_LEVERS).isdisjoint(RecoverSettings.model_fields)
    assert defaults.experimental == RecoverExperiments()
    lever = defaults.experimental
    assert (lever.on_policy, lever.unlikelihood, lever.lm_weight) == (0.0, 0.0, 0.0)
    assert (lever.divergence, lever.rollout) == ("forward", "student")  # plain KL on the corpus's own text

    on_policy = RecoverSettings(experimental={"on_policy": 0.5})
    assert on_policy.experimental.on_policy == 0.5 and on_policy.experimental.rollout == "student"
    assert RecoverSettings(experimental=RESEARCH_LEVERS).experimental.model_dump() == RESEARCH_LEVERS
    with pytest.raises(ValidationError, match="unlikelihood applies to the level's own text") as refused:
        RecoverSettings(experimental={"unlikelihood": 1.0})  # without on_policy
    assert refused.value.errors()[0]["loc"] == ("experimental",)

    for name, value in RESEARCH_LEVERS.items():  # the old top-level names: an unknown setting, never ignored
        with pytest.raises(ValidationError) as refused:
            RecoverSettings(**{name: value})
        assert [(e["loc"], e["type"]) for e in refused.value.errors()] == [((name,), "extra_forbidden")]
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        RecoverSettings(experimental={"temperature": 2.0})  # a product setting is not a research lever
