"""Long prompts: one over the context is refused before anything is allocated for it (the device server
answers 400 naming the limit), and prefill of a long prompt inside the context holds attention scores
and masks for a chunk of queries at a time, with the same logits as computing them whole."""

from __future__ import annotations

import http.client
import json
import threading

import psutil
import pytest
import torch

from device_sdk import llama
from device_sdk.runtime import ElasticModel, PromptTooLong
from tests.support.sdk_packages import random_package, serving

MB = 1 << 20


class PeakRSS:
    """The most this process's resident memory grew above where it was at entry, sampled every ms."""

    def __enter__(self):
        self.process, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.growth = self.peak - self.base


@pytest.fixture(scope="module")
def short_context(tmp_path_factory) -> ElasticModel:
    """A random model with a 256-token context; its tokenizer gives one token per byte."""
    return ElasticModel.load(random_package("llama_gqa", tmp_path_factory.mktemp("short") / "pkg", None),
                             allow_unsigned=True)


def test_an_over_context_prompt_is_refused_before_anything_is_allocated(short_context, monkeypatch):
    caches, new_cache = [], short_context.transformer.new_cache
    monkeypatch.setattr(short_context.transformer, "new_cache", lambda n: caches.append(n) or new_cache(n))
    with PeakRSS() as memory, pytest.raises(PromptTooLong, match="12000 tokens; the model's context is 256"):
        short_context.generate("hello " * 2000, max_new_tokens=2)
    assert caches == []  # no KV cache, so no prefill either
    assert memory.growth < 50 * MB, f"{memory.growth / MB:.0f} MB"  # the old int64 12k×12k mask alone was 1.1 GB


def test_a_prompt_that_fills_the_context_still_answers(short_context):
    result = short_context.generate("x" * 256, max_new_tokens=4)
    assert result.prompt_tokens == 256 and len(result.tokens) == 1 and result.finish_reason == "length"


def test_the_device_server_answers_400_naming_the_context(short_context):
    with serving(short_context, max_queue=2) as port:
        for stream in (False, True):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            connection.request("POST", "/v1/completions", json.dumps(
                {"model": "tiny", "prompt": "hello " * 25000, "max_tokens": 2, "stream": stream}),
                {"Content-Type": "application/json"})
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == 400, body
            assert "context is 256 tokens" in body["error"]["message"]
            connection.close()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # and it goes on serving
        connection.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 2}),
                           {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200


def logits(transformer, ids: torch.Tensor, decode: int = 2) -> list[torch.Tensor]:
    cache = transformer.new_cache(ids.shape[1] + decode)
    out = [transformer(ids, cache)]
    for token in range(decode):
        out.append(transformer(torch.tensor([[token + 1]]), cache))
    return out


@pytest.mark.parametrize("kind, extra", [("llama_gqa", {}), ("mistral", {"sliding_window": 48}), ("qwen2_bias", {})])
def test_attention_in_chunks_gives_the_logits_of_attention_whole(tmp_path, monkeypatch, kind, extra):
    model = ElasticModel.load(random_package(kind, tmp_path / "pkg", None, max_position=1024, **extra),
                              allow_unsigned=True, native=False)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (1, length), generator=generator) for length in (1, 5, 300)]
    batch = torch.randint(0, 256, (3, 40), generator=generator)
    key_mask = torch.ones(3, 40, dtype=torch.bool)
    key_mask[1, 30:] = key_mask[2, 15:] = False  # the padding after shorter rows
    positions = torch.arange(40).expand(3, 40)

    def run():
        out = [logits(model.transformer, ids) for ids in prompts]
        if kind != "mistral":  # per-row positions beyond the window are refused
            out.append([model.transformer.hidden_states(batch, positions=positions, key_mask=key_mask)])
        return out

    whole = run()
    monkeypatch.setattr(llama, "SCORE_ELEMENTS", 512)  # a few query positions per chunk
    chunked = run()
    for expected, got in zip(whole, chunked, strict=True):
        for a, b in zip(expected, got, strict=True):
            assert not a.isnan().any()
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_prefill_memory_of_a_long_prompt_is_bounded(tmp_path):
    model = ElasticModel.load(random_package("llama_gqa", tmp_path / "pkg", None, max_position=8192),
                              allow_unsigned=True, native=False)
    ids = torch.randint(0, 256, (1, 6000), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), PeakRSS() as memory:
        logits(model.transformer, ids, decode=0)
    # Whole, the scores alone were [1, 4, 2·6000, 6000] fp32 = 1.1 GB and the int64 mask 0.29 GB;
    # in chunks each layer's scores hold at most 64 MiB.
    assert memory.growth < 400 * MB, f"{memory.growth / MB:.0f} MB"


def test_generation_of_an_in_context_prompt_is_unchanged_by_chunking(tmp_path, monkeypatch):
    model = ElasticModel.load(random_package("llama_gqa", tmp_path / "pkg", None, max_position=1024),
                              allow_unsigned=True, native=False)
    prompt = "the quick brown fox " * 30
    whole = model.generate(prompt, max_new_tokens=8)
    monkeypatch.setattr(llama, "SCORE_ELEMENTS", 1024)
    assert model.generate(prompt, max_new_tokens=8).tokens == whole.tokens
