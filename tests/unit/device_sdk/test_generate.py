"""generate() under SLOs, the latency profile CLI, and the local completion service."""

from __future__ import annotations

import base64
import http.client
import json
import time

import pytest
import torch

from device_sdk.cli import main as device_cli
from device_sdk.latency import SLO, Decision, LatencyProfile, profile_path
from device_sdk.runtime import ElasticModel, Sampling
from device_sdk.serve import parse_slo
from tests.support.sdk_packages import fixed_profile_model, public_bytes, serving, signing_key

KEY = signing_key()


@pytest.fixture
def model(gqa_package) -> ElasticModel:
    return fixed_profile_model(gqa_package)


def test_sdk_slo_picks_the_largest_feasible_level(model):
    assert model.available_levels() == ["0.25", "0.5", "0.75", "1.0"]
    out = model.generate("hello", slo=SLO(tpot_ms=2.5), max_new_tokens=3, level=None)
    assert out.decision.level == "0.5" and out.level == "0.5" and out.decision.feasible
    assert model.generate("hello", slo=SLO.fraction(tpot=0.8), max_new_tokens=2).level == "0.75"  # 0.8 x 4 ms
    # TTFT grows with the prompt: 40 prompt tokens add 0.1 ms per token and level.
    assert model.generate("x" * 40, slo=SLO(ttft_ms=25), max_new_tokens=1).level == "0.25"
    relaxed = model.generate("hello", slo=SLO(ttft_ms=1e6, tpot_ms=1e6), max_new_tokens=3)
    assert relaxed.level == "1.0" and relaxed.slo_met


def test_sdk_impossible_slo_is_best_effort(model):
    out = model.generate("hello", slo=SLO(ttft_ms=1e-6, tpot_ms=1e-6), max_new_tokens=4)
    assert out.level == "0.25" and not out.decision.feasible
    assert out.slo_met is False
    assert 1 <= len(out.tokens) <= 4 and out.ttft_ms > 0


def test_sdk_stream_yields_the_text(model):
    stream = model.generate("abc", max_new_tokens=6, stream=True)
    pieces = list(stream)
    result = stream.result
    assert "".join(pieces) == result.text and len(result.tokens) == 6
    assert result.level == "1.0" and result.tpot_ms is not None and result.finish_reason == "length"


def test_the_end_of_sequence_token_waits_for_min_new_tokens(model):
    first = model.generate("abc", max_new_tokens=1, min_new_tokens=0).tokens[0]
    model.eos_ids = {first}  # the model's own greedy first token now ends the answer at once
    ended = model.generate("abc", max_new_tokens=4, min_new_tokens=0)
    assert ended.tokens == [first] and ended.text == "" and ended.finish_reason == "stop"
    answered = model.generate("abc", max_new_tokens=4)  # the default: at least one token
    assert answered.tokens[0] != first and answered.text
    assert first not in model.generate("abc", max_new_tokens=4, min_new_tokens=4).tokens
    with pytest.raises(ValueError, match="min_new_tokens"):
        model.generate("abc", max_new_tokens=2, min_new_tokens=3)


def test_penalties_follow_ctrl_and_openai_on_known_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    penalties = Sampling(temperature=0, repetition_penalty=2.0).penalties(prompt_ids=[0, 1], vocab=4)
    # in the prompt: 2.0 halves, -1.0 doubles; unseen tokens keep theirs
    assert penalties(logits).tolist() == [1.0, -2.0, 0.5, 3.0]
    penalties.add(3)
    penalties.add(3)
    assert penalties(logits).tolist() == [1.0, -2.0, 0.5, 1.5]  # seen once or twice: divided once
    openai = Sampling(temperature=0, frequency_penalty=0.5, presence_penalty=0.25).penalties([0, 1], vocab=4)
    assert openai(logits).tolist() == logits.tolist()  # the prompt does not count, only the output
    openai.add(2)
    openai.add(2)
    assert openai(logits).tolist() == [2.0, -1.0, 0.5 - 2 * 0.5 - 0.25, 3.0]
    assert Sampling(temperature=0).penalties([0], vocab=4) is None  # nothing to do: no state kept
    for bad in ({"repetition_penalty": 0}, {"frequency_penalty": 2.5}, {"presence_penalty": -3},
                {"temperature": -1}, {"top_p": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_full_forward(model):
    """The cached decode loop against a reference: every step re-runs the whole sequence and applies
    the two rules by hand."""
    model.set_level("0.5")
    sampling = Sampling(temperature=0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.3)
    ids = model.tokenizer.encode("abc abc").ids
    expected, counts = [], {}
    for _ in range(10):
        logits = model.logits(torch.tensor([ids + expected]))[0, -1].float().clone()
        for token in set(ids + expected):
            logits[token] = logits[token] / 1.8 if logits[token] > 0 else logits[token] * 1.8
        for token, count in counts.items():
            logits[token] -= 0.7 * count + 0.3
        expected.append(int(logits.argmax()))
        counts[expected[-1]] = counts.get(expected[-1], 0) + 1
    penalised = model.generate("abc abc", max_new_tokens=10, level="0.5", sampling=sampling, min_new_tokens=0)
    plain = model.generate("abc abc", max_new_tokens=10, level="0.5", min_new_tokens=0)
    assert penalised.tokens == expected[: len(penalised.tokens)]
    assert penalised.tokens != plain.tokens  # the penalties changed what greedy chose
    assert len(set(penalised.tokens)) > len(set(plain.tokens))


def test_sdk_decision_hook_replaces_the_profile_rule(model):
    """The TLM issue plugs in here: a decider picks (level, prompt ratio), a compressor applies the ratio."""
    seen = {}

    def tlm_decide(prompt, prompt_tokens, slo, profile, levels, kept_tokens):
        seen["args"] = (prompt, prompt_tokens, slo, kept_tokens)
        return Decision("0.5", prompt_ratio=0.5)

    model.decide = tlm_decide
    model.compress = lambda prompt, ratio: prompt[: int(len(prompt) * ratio)]
    out = model.generate("abcdefgh", slo=SLO(tpot_ms=100), max_new_tokens=2, keep="")  # "": all of it compresses
    assert seen["args"] == ("abcdefgh", 8, SLO(tpot_ms=100), 0)
    assert out.level == "0.5" and out.prompt_tokens == 4
    # By default a completion keeps its question (here the one line, all of it) and the cost model knows.
    out = model.generate("abcdefgh", slo=SLO(tpot_ms=100), max_new_tokens=2)
    assert seen["args"] == ("abcdefgh", 8, SLO(tpot_ms=100), 8) and out.prompt_tokens == 8
    # The end kept whole is counted for the cost model, and only the rest is compressed.
    out = model.generate("abcdefgh", slo=SLO(tpot_ms=100), max_new_tokens=2, keep="efgh")
    assert seen["args"] == ("abcdefgh", 8, SLO(tpot_ms=100), 4)
    assert out.prompt_tokens == 6  # "ab" + "efgh"


def test_a_relative_slo_is_judged_against_the_prompt_as_given_not_the_compressed_one(model, monkeypatch):
    asked = []
    absolute = SLO.absolute

    def recording(self, profile, prompt_tokens):
        asked.append(prompt_tokens)
        return absolute(self, profile, prompt_tokens)

    monkeypatch.setattr(SLO, "absolute", recording)
    model.decide = lambda prompt, prompt_tokens, slo, profile, levels, kept_tokens: Decision("0.5", prompt_ratio=0.5)
    model.compress = lambda prompt, ratio: prompt[: int(len(prompt) * ratio)]
    out = model.generate("abcdefgh", slo=SLO.fraction(ttft=0.9, tpot=0.9), max_new_tokens=2, keep="")
    assert out.prompt_tokens == 4  # what ran
    assert asked == [8]  # what the target is relative to: the full model on all 8 tokens
    assert out.slo_met == absolute(SLO.fraction(ttft=0.9, tpot=0.9), model.latency_profile, 8).met(
        out.ttft_ms, out.tpot_ms)


def test_generate_teaches_the_profile_what_its_decided_requests_measured(model, monkeypatch):
    """Every request the SLO decided is observed at its level, on the tokens it served (the compressed
    prompt); a forced level or no SLO teaches nothing (no decision to calibrate)."""
    seen = []
    monkeypatch.setattr(LatencyProfile, "observe",
                        lambda self, level, tokens, prefill_ms, tpot_ms: seen.append((level, tokens, prefill_ms, tpot_ms)))
    out = model.generate("hello", slo=SLO(tpot_ms=2.5), max_new_tokens=3)
    assert [(level, tokens) for level, tokens, _, _ in seen] == [("0.5", out.prompt_tokens)]
    prefill_ms, tpot_ms = seen[0][2:]
    assert 0 < prefill_ms <= out.ttft_ms and tpot_ms == out.tpot_ms  # prefill alone: no tokenising or TLM
    model.decide = lambda prompt, prompt_tokens, slo, profile, levels, kept_tokens: Decision("0.75", prompt_ratio=0.5)
    model.compress = lambda prompt, ratio: prompt[: int(len(prompt) * ratio)]
    out = model.generate("abcdefgh", slo=SLO(tpot_ms=100), max_new_tokens=2, keep="")
    assert seen[-1][:2] == ("0.75", 4) == (out.level, out.prompt_tokens)
    model.generate("hello", slo=SLO(tpot_ms=2.5), max_new_tokens=2, level="1.0")
    model.generate("hello", max_new_tokens=2)
    assert len(seen) == 2


def test_sdk_profile_cli_stores_a_profile_beside_the_package(gqa_package, capsys):
    key = base64.b64encode(public_bytes(KEY)).decode()
    assert device_cli(["profile", str(gqa_package), "--public-key", key, "--prompt-lengths", "4,12",
                       "--decode-tokens", "3"]) == 0
    path = profile_path(gqa_package, "fp32")
    assert path.parent == gqa_package.parent and path.is_file()
    profile = LatencyProfile.load(path)
    assert set(profile.levels) == {"0.25", "0.5", "0.75", "1.0"} and not profile.estimated
    assert all(entry.tpot_ms > 0 for entry in profile.levels.values())
    assert ElasticModel.load(gqa_package, allow_unsigned=True).latency_profile.levels == profile.levels
    assert "saved" in capsys.readouterr().out


def test_a_loaded_model_keeps_the_serving_headroom_off_the_slo_boundary(gqa_package):
    from device_sdk.latency import SERVING_HEADROOM, Drift, LevelLatency

    model = ElasticModel.load(gqa_package, allow_unsigned=True)
    profile = model.latency_profile  # the package's (or an estimate), served with the SDK's headroom
    assert profile.drift.headroom == SERVING_HEADROOM > 1.0
    profile.levels = {name: LevelLatency(1.0, 0.0, 1.0 * (i + 1)) for i, name in enumerate(model.available_levels())}
    boundary = SLO(tpot_ms=2.0 * 1.02)  # level 0.5's TPOT is 2 ms: 2% inside the target
    assert model.generate("hello", slo=boundary, max_new_tokens=2).level == "0.25"
    profile.drift = Drift(headroom=1.0)  # a build's cost model, as measured
    assert model.generate("hello", slo=boundary, max_new_tokens=2).level == "0.5"


def test_measured_levels_keep_their_ttft_points_and_skip_lengths_the_model_cannot_hold(model):
    from device_sdk.measure import measure_level

    entry = measure_level(model, (4, 8, 12, 10**6), decode_tokens=2, repeats=1)
    assert [n for n, _ in entry.ttft_points] == [4, 8, 12]
    assert all(entry.ttft_ms(n) == ms for n, ms in entry.ttft_points)
    assert measure_level(model, (4, 12), decode_tokens=2, repeats=1).ttft_points is None  # two: the line


def test_the_profile_times_a_decode_step_as_generate_runs_it_and_ttft_as_the_median(model, monkeypatch):
    """A profile that leaves out what every served token pays (the pick, the detokenisation), or that
    keeps the luckiest prefill, predicts requests short and the SLO decision misses at the boundary."""
    from device_sdk import measure

    decode = model.tokenizer.decode
    monkeypatch.setattr(model, "tokenizer", type("SlowDecode", (), {"decode": lambda self, ids: (time.sleep(0.02),
                                                                                                 decode(ids))[1]})())
    _, tpot = measure.measure_points(model, (4,), decode_tokens=4, repeats=1)
    assert tpot >= 20.0
    prefills = iter([1.0, 50.0, 9.0])
    monkeypatch.setattr(measure, "timed_ms", lambda fn: next(prefills, 1.0))
    ttfts, _ = measure.measure_points(model, (4,), decode_tokens=1, repeats=3)
    assert ttfts == [9.0]


def test_sdk_generate_cli_keep_must_end_the_prompt(gqa_package, capsys):
    key = base64.b64encode(public_bytes(KEY)).decode()
    common = ["generate", str(gqa_package), "--public-key", key, "--max-new-tokens", "2", "--level", "0.5"]
    assert device_cli([*common, "a passage. Question: why?", "--keep", "Question: why?"]) == 0
    assert "[level 0.5" in capsys.readouterr().err
    assert device_cli([*common, "a passage", "--keep", "why?"]) == 2
    assert "--keep must be the end of the prompt" in capsys.readouterr().err
    assert device_cli([*common, "a passage", "--repetition-penalty", "1.3", "--presence-penalty", "0.5"]) == 0
    for bad, named in ((["--repetition-penalty", "0"], "repetition_penalty"), (["--top-p", "2"], "top_p"),
                       (["--frequency-penalty", "3"], "frequency_penalty")):
        assert device_cli([*common, "a passage", *bad]) == 2
        assert f"error: {named} must be" in capsys.readouterr().err


def test_serve_drift_quantile_is_a_quantile_or_off(gqa_package, capsys):
    from device_sdk.cli import _drift_headroom, _drift_quantile
    from device_sdk.latency import SERVING_HEADROOM, Drift

    assert _drift_quantile("off") is None and _drift_quantile("0.5") == 0.5 and _drift_quantile("1") == 1.0
    assert Drift.quantile == 0.9  # the serve flag's default is the SDK's
    key = base64.b64encode(public_bytes(KEY)).decode()
    for bad in ("0", "1.5", "median"):
        assert device_cli(["serve", str(gqa_package), "--public-key", key, "--drift-quantile", bad]) == 2
        assert "quantile in (0, 1]" in capsys.readouterr().err
    assert _drift_headroom("1") == 1.0 and _drift_headroom("1.04") == SERVING_HEADROOM  # the flag's default
    for bad in ("0.9", "-1", "wide"):
        assert device_cli(["serve", str(gqa_package), "--public-key", key, "--drift-headroom", bad]) == 2
        assert "margin of at least 1" in capsys.readouterr().err


def test_sdk_slo_request_field_is_validated():
    assert parse_slo({"ttft_ms": 100}) == SLO(100, None)
    assert parse_slo({"ttft": 0.5, "tpot": 0.8}) == SLO.fraction(0.5, 0.8)
    for bad in ({"ttft_ms": -1}, {"speed": 1}, {"ttft": 0.5, "tpot_ms": 3}, [1]):
        with pytest.raises(ValueError):
            parse_slo(bad)


# --------------------------------------------------------------------------- the service


def post(port: int, body: dict) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


@pytest.fixture(name="serving")
def serving_port(model):
    with serving(model, max_queue=2) as port:
        yield port


def test_sdk_serve_completion_and_stream(serving, model):
    status, body = post(serving, {"prompt": "hi", "max_tokens": 3, "slo": {"tpot_ms": 1.5}})
    reply = json.loads(body)
    assert status == 200 and reply["object"] == "text_completion"
    assert reply["elastify"]["level"] == "0.25" and reply["usage"]["completion_tokens"] == 3
    assert reply["choices"][0]["finish_reason"] == "length"

    status, body = post(serving, {"prompt": "hi", "max_tokens": 4, "stream": True})
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["elastify"]["level"] == "1.0" and chunks[-1]["usage"]["completion_tokens"] == 4
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == model.generate("hi", max_new_tokens=4).text  # greedy: the same text again

    status, body = post(serving, {"prompt": "", "max_tokens": 3})
    assert status == 400 and "prompt" in json.loads(body)["error"]["message"]
    for bad in (-1, 4, 1.5, "1"):
        status, body = post(serving, {"prompt": "hi", "max_tokens": 3, "min_tokens": bad})
        assert status == 400 and json.loads(body)["error"]["param"] == "min_tokens"


def test_sdk_serve_penalties_reach_the_decoder_and_bad_ones_are_400(serving, model):
    body = {"prompt": "abc abc", "max_tokens": 8, "min_tokens": 0}
    penalties = {"repetition_penalty": 1.8, "frequency_penalty": 0.7, "presence_penalty": 0.3}
    status, reply = post(serving, body | penalties)
    expected = model.generate("abc abc", max_new_tokens=8, min_new_tokens=0,
                              sampling=Sampling(temperature=0, **penalties)).text
    assert status == 200 and json.loads(reply)["choices"][0]["text"] == expected
    assert expected != model.generate("abc abc", max_new_tokens=8, min_new_tokens=0).text
    for name, bad in (("repetition_penalty", 0), ("repetition_penalty", "1.1"), ("frequency_penalty", 2.5),
                      ("presence_penalty", -2.5)):
        status, reply = post(serving, body | {name: bad})
        assert status == 400 and json.loads(reply)["error"]["param"] == name


def test_sdk_serve_min_tokens_lets_an_answer_be_empty_only_when_asked(serving, model):
    model.eos_ids = {model.generate("hi", max_new_tokens=1, min_new_tokens=0).tokens[0]}
    status, body = post(serving, {"prompt": "hi", "max_tokens": 3, "min_tokens": 0})
    choice = json.loads(body)["choices"][0]
    assert status == 200 and choice["text"] == "" and choice["finish_reason"] == "stop"
    status, body = post(serving, {"prompt": "hi", "max_tokens": 3})
    assert status == 200 and json.loads(body)["choices"][0]["text"]


