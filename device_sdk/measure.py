"""Timing a model on this device: the measured latency profile that `device_sdk.latency` predicts from.

`measure_profile` times every held level (and the TLM, where the package carries one) as a request
runs them; `elastify-device profile` saves the result beside the package. `estimate_profile` is the
quick stand-in for a model with no saved profile: its largest level timed, the others scaled. The
build host's latency stage times the device's own code through `measure_points`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from device_sdk.latency import LatencyProfile, LevelLatency, TLMLatency
from device_sdk.tlm import TLM


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure_level(model, prompt_lengths: tuple[int, ...], decode_tokens: int, repeats: int) -> LevelLatency:
    """Prefill at each prompt length (a line through the ends, and the points themselves when there are
    three or more), then the mean of single-token decode steps. Lengths the model cannot hold are skipped."""
    room = model.manifest.architecture.max_position - decode_tokens - 1
    lengths = tuple(n for n in prompt_lengths if n <= room) or (min(prompt_lengths[0], room),)
    ttfts, tpot = measure_points(model, lengths, decode_tokens, repeats)
    points = [(n, t) for n, t in zip(lengths, ttfts, strict=True)] if len(lengths) >= 3 else None
    return LevelLatency(*line_through(lengths, ttfts), tpot, ttft_points=points)


def line_through(lengths, times_ms) -> tuple[float, float]:
    """(base ms, ms per token) of the line through the first and last points, neither below 0."""
    slope = (times_ms[-1] - times_ms[0]) / (lengths[-1] - lengths[0]) if len(lengths) > 1 else 0.0
    slope = max(slope, 0.0)
    return max(times_ms[0] - slope * lengths[0], 0.0), slope


def measure_points(model, prompt_lengths, decode_tokens: int, repeats: int) -> tuple[list[float], float]:
    """(median TTFT ms per prompt length, TPOT ms) of `model`'s current widths, timed as a request runs:
    prefill with `last_only` logits, then `repeats` runs of single-token steps (the native decoder where
    it is built), each with the greedy pick and the running detokenisation `generate` does. TTFT is the
    median, not the best, of the repeats: an SLO is met or missed by the typical request, and the best
    run predicts it short. The build host's latency stage calls this too, so its profile times the
    device's own code."""
    transformer = model.transformer
    tokenizer = getattr(model, "tokenizer", None)
    vocab = model.manifest.architecture.vocab
    generator = torch.Generator().manual_seed(0)
    ttfts = []
    with torch.inference_mode():
        for length in prompt_lengths:
            ids = torch.randint(0, vocab, (1, length), generator=generator)
            ttfts.append(statistics.median(timed_ms(lambda ids=ids: transformer(ids, last_only=True))
                                           for _ in range(repeats)))
        token = torch.zeros(1, 1, dtype=torch.long)
        steps = []
        for _ in range(repeats):  # `repeats` sequences of `decode_tokens` steps
            cache = transformer.new_cache(prompt_lengths[0] + decode_tokens + 1)
            transformer(torch.randint(0, vocab, (1, prompt_lengths[0]), generator=generator), cache, last_only=True)
            picked: list[int] = []

            def step(cache=cache, picked=picked):
                picked.append(int(transformer(token, cache, last_only=True)[0, -1].argmax()))
                if tokenizer is not None:
                    tokenizer.decode(picked)

            steps += [timed_ms(step) for _ in range(decode_tokens)]
    steps = sorted(steps)[: max(1, len(steps) * 3 // 4)]  # drop the slowest quarter (scheduler noise)
    return ttfts, sum(steps) / len(steps)


def measure_profile(
    model,
    *,
    levels: list[str] | None = None,
    prompt_lengths: tuple[int, ...] = (32, 128, 512, 1024),
    decode_tokens: int = 16,
    repeats: int = 2,
) -> LatencyProfile:
    """Measure every (held) level of `model`; restores its level afterwards."""
    previous = model.level
    names = levels or model.available_levels()
    measured = {}
    try:
        for name in names:
            model.set_level(name)
            measured[name] = measure_level(model, prompt_lengths, decode_tokens, repeats)
    finally:
        if previous is not None:
            model.set_level(previous)
    tlm = getattr(model, "tlm", None)
    tlm_latency = None
    if tlm is not None:
        tlm_latency = measure_tlm_latency(tlm, prompt_lengths, repeats)
    return LatencyProfile(model.weight_format, torch.get_num_threads(), measured, tlm=tlm_latency)


def estimate_profile(model) -> LatencyProfile:
    """A quick stand-in when no profile was measured: the largest level, scaled by active fraction."""
    full_name = model.available_levels()[-1]
    previous = model.level
    model.set_level(full_name)
    try:
        full = measure_level(model, (8, 32), decode_tokens=4, repeats=1)
    finally:
        if previous is not None:
            model.set_level(previous)
    full_fraction = model.manifest.elastic.level(full_name).active_fraction
    levels = {}
    for name in model.available_levels():
        share = model.manifest.elastic.level(name).active_fraction / full_fraction
        levels[name] = LevelLatency(full.ttft_base_ms * share, full.ttft_per_token_ms * share, full.tpot_ms * share)
    return LatencyProfile(model.weight_format, torch.get_num_threads(), levels, estimated=True)


def measure_tlm_latency(tlm: TLM, prompt_lengths: Sequence[int] = (32, 128), repeats: int = 2) -> TLMLatency:
    """Time the TLM as a request runs it (the decision, and the word scores compression needs) on prompts
    of `prompt_lengths` words (about as many tokens), best of `repeats`, and fit a line to each."""
    decide, compress = [], []
    prompt_lengths = sorted({min(n, tlm.max_length) for n in prompt_lengths})  # the decision reads no more
    for length in prompt_lengths:
        text = " ".join(f"word{i % 50}" for i in range(length)) + "?"
        if tlm.decision_head == "utility":
            decide.append(min(timed_ms(lambda t=text: tlm.utility(t)) for _ in range(repeats)))
        else:
            decide.append(min(timed_ms(lambda t=text: tlm.decision_log_probs(t, 1.0, 1.0)) for _ in range(repeats)))
        compress.append(min(timed_ms(lambda t=text: tlm.word_scores(t)) for _ in range(repeats)))
    return TLMLatency(*line_through(list(prompt_lengths), decide), *line_through(list(prompt_lengths), compress),
                      decide_window=tlm.max_length)
