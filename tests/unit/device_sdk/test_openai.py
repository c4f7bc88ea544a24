"""`elastify-device serve` driven by the official `openai` client: chat and completions, streamed and not,
stop strings, seeded sampling, refused parameters, and keep-alive after an error."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from device_sdk.chat import ChatTemplate
from device_sdk.runtime import ElasticModel, Sampling
from tests.support.sdk_packages import random_package, serving, sign_package, signing_key

KEY = signing_key()
# A template with the features real ones use: a default system turn, loop.first, raise_exception.
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<s>system\nBe brief.</s>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.first %}{{ raise_exception('a chat starts with the user') }}{% endif %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    path = random_package("llama_gqa", tmp_path_factory.mktemp("openai") / "pkg", KEY)
    (path / "model" / "chat_template.jinja").write_text(TEMPLATE)
    sign_package(path, KEY)
    return path


@pytest.fixture(scope="module")
def model(package) -> ElasticModel:
    return ElasticModel.load(package, allow_unsigned=True)


@pytest.fixture(scope="module")
def port(model):
    with serving(model, max_queue=16) as free_port:
        yield free_port


@pytest.fixture(scope="module")
def client(port) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def render(*messages) -> str:
    return ChatTemplate(TEMPLATE).render([{"role": r, "content": c} for r, c in messages])


def test_openai_chat_uses_the_package_template(client, model):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    expected = model.generate(render(("user", "hi")), max_new_tokens=6)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == expected.prompt_tokens and reply.usage.completion_tokens == 6
    assert reply.model_extra["elastify"]["level"] == "1.0"


def test_openai_chat_streams_the_same_text(client):
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "abc"}]}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_completions_streamed_and_not_with_an_slo(client, model):
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=5, extra_body={"slo": {"ttft": 0.01}})
    assert reply.model_extra["elastify"]["level"] == "0.25"  # an SLO no other level can meet
    greedy = model.generate("hello", max_new_tokens=5)
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert reply.choices[0].text == greedy.text and reply.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == greedy.text


def _stop_string(text: str) -> tuple[str, int]:
    """Two characters from the middle of `text`, and where they first occur."""
    stop = text[len(text) // 2: len(text) // 2 + 2]
    return stop, text.index(stop)


def test_openai_stop_truncates_before_the_stop_string(client, model):
    greedy = model.generate("hello", max_new_tokens=16).text
    assert len(greedy) == 16  # one character per token with the byte tokenizer
    stop, at = _stop_string(greedy)
    for value in (stop, ["\x01never", stop]):
        reply = client.completions.create(model="tiny", prompt="hello", max_tokens=16, stop=value)
        assert reply.choices[0].text == greedy[:at] and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == at + len(stop)  # generation ended where the stop string did
        streamed = list(client.completions.create(model="tiny", prompt="hello", max_tokens=16, stop=value, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == greedy[:at]
        assert streamed[-1].choices[0].finish_reason == "stop"
    near_miss = greedy[5] + "\x01\x02"  # its first character comes, the rest never: held back, then shown
    streamed = client.completions.create(model="tiny", prompt="hello", max_tokens=16, stop=near_miss, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == greedy and chunks[-1].choices[0].finish_reason == "length"
    chat = model.generate(render(("user", "hi")), max_new_tokens=16).text
    stop, at = _stop_string(chat)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                           stop=[stop])
    assert reply.choices[0].message.content == chat[:at] and reply.choices[0].finish_reason == "stop"


def test_openai_seeded_sampling_is_reproducible(client, model):
    def sample(seed, **kwargs):
        return client.completions.create(model="tiny", prompt="hello", max_tokens=12, seed=seed, **kwargs).choices[0].text

    first = sample(3, temperature=1.0)
    assert sample(3, temperature=1.0) == first
    assert len({sample(seed, temperature=1.0) for seed in range(4)}) > 1  # the seed matters
    greedy = model.generate("hello", max_new_tokens=12).text
    assert sample(3, temperature=1.0) != greedy or sample(4, temperature=1.0) != greedy
    assert sample(5, top_p=1e-9) == greedy  # a nucleus of one token is the argmax
    assert sample(5, temperature=0) == greedy


def test_sampling_nucleus_keeps_only_the_top_tokens():
    import torch

    logits = torch.tensor([3.0, 2.9, -5.0, -5.0])  # the top two hold > 0.99 of the mass
    pick = Sampling(temperature=1.0, top_p=0.9, seed=0).picker()
    assert {pick(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize(("call", "named"), [
    (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], n=2), "n"),
    (lambda c: c.completions.create(model="tiny", prompt="a", logprobs=2, echo=True), "echo, logprobs"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                         tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
])
def test_openai_unsupported_parameters_are_named_in_a_400(client, call, named):
    with pytest.raises(openai.BadRequestError) as refused:
        call(client)
    assert refused.value.status_code == 400 and refused.value.code == "unsupported_parameter"
    assert f"unsupported parameter{'s' if ',' in named else ''}: {named}" in refused.value.message
    assert refused.value.param == named.split(",")[0]


def test_openai_bad_chats_are_400(client):
    with pytest.raises(openai.BadRequestError) as template_refused:  # the template's own raise_exception
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "a"}])
    assert "a chat starts with the user" in template_refused.value.message
    with pytest.raises(openai.BadRequestError) as bad_role:
        client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "a", "tool_call_id": "1"}])
    assert bad_role.value.param == "messages[0].tool_call_id"
    with pytest.raises(openai.BadRequestError) as bad_stop:
        client.completions.create(model="tiny", prompt="a", stop=[""])
    assert bad_stop.value.param == "stop"


def test_keep_must_end_the_prompt_and_is_for_completions_only(client):
    """`keep` (the prompt's end that compression leaves whole) is an extension of /v1/completions."""
    served = client.completions.create(model="tiny", prompt="a passage. Question: why?", max_tokens=2,
                                       extra_body={"keep": " Question: why?"})
    assert served.choices[0].text
    with pytest.raises(openai.BadRequestError) as not_the_end:
        client.completions.create(model="tiny", prompt="a passage", max_tokens=2, extra_body={"keep": "why?"})
    assert not_the_end.value.param == "keep"
    with pytest.raises(openai.BadRequestError) as on_chat:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], extra_body={"keep": "a"})
    assert on_chat.value.code == "unsupported_parameter" and on_chat.value.param == "keep"


def test_a_package_without_a_chat_template_refuses_chat(tmp_path):
    path = random_package("llama_mha", tmp_path / "pkg", KEY)
    with serving(ElasticModel.load(path, allow_unsigned=True)) as free_port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
        assert "no chat template" in refused.value.message


def test_keep_alive_survives_a_404_and_a_400(port):
    """The error answers read the request body, so the next request on the same connection is parsed cleanly."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"prompt": "hello", "max_tokens": 2})
    connection.request("POST", "/v1/no-such-route", body, {"Content-Type": "application/json"})
    missing = connection.getresponse()
    assert missing.status == 404 and json.loads(missing.read())["error"]["code"] == "not_found"
    sock = connection.sock
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "a", "n": 3}))
    refused = connection.getresponse()
    assert refused.status == 400 and json.loads(refused.read())["error"]["param"] == "n"
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    good = connection.getresponse()
    assert good.status == 200 and json.loads(good.read())["usage"]["completion_tokens"] == 2
    assert connection.sock is sock  # one connection served all three
    connection.close()


def test_chunked_bodies_are_read_whole_and_a_bad_one_closes_the_connection(port):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    parts = [b'{"prompt": "hel', b'lo", "max_tokens": 2}']
    connection.request("POST", "/v1/nowhere", iter(parts), {"Transfer-Encoding": "chunked"}, encode_chunked=True)
    assert connection.getresponse().read() and connection.sock is not None
    connection.request("POST", "/v1/completions", iter(parts), {"Transfer-Encoding": "chunked"}, encode_chunked=True)
    good = connection.getresponse()
    assert good.status == 200 and json.loads(good.read())["usage"]["completion_tokens"] == 2
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders(b"zz\r\n{}\r\n0\r\n\r\n")
    bad = connection.getresponse()
    assert bad.status == 400 and bad.getheader("Connection") == "close"  # uvicorn's parser refuses the chunk size
    connection.close()


def _post(port: int, body: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    status, payload = answer.status, json.loads(answer.read())
    connection.close()
    return status, payload


@pytest.mark.parametrize(("body", "says"), [
    (b'{"prompt": "\\ud800 lone", "max_tokens": 2}', "lone surrogate"),
    (b'{"prompt": "a", "slo": {"ttft_ms": NaN}}', "finite"),
    (b'{"prompt": "a", "slo": {"tpot_ms": Infinity}}', "finite"),
    (b'{"prompt": "a", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
])
def test_hostile_bodies_are_400(port, body, says):
    status, payload = _post(port, body)
    assert status == 400 and says in payload["error"]["message"]


def test_models_list_every_level_and_model_selects_one(client):
    listed = {m.id: m.model_extra["elastify"] for m in client.models.list().data}
    assert listed == {"tiny": {"level": None, "usable": True},
                      **{f"tiny@{name}": {"level": name, "usable": True} for name in ("0.25", "0.5", "0.75", "1.0")}}
    raw = client.completions.with_raw_response.create(model="tiny@0.5", prompt="hello", max_tokens=3)
    assert raw.parse().model_extra["elastify"]["level"] == "0.5"
    assert raw.headers["X-Elastify-Level"] == "0.5" and raw.headers["X-Elastify-Prompt-Ratio"] == "1.0"
    by_extension = client.completions.create(model="tiny", prompt="hello", max_tokens=3, extra_body={"level": "0.75"})
    assert by_extension.model_extra["elastify"]["level"] == "0.75"
    for unknown in ("other", "tiny@0.3"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model=unknown, prompt="hello", max_tokens=3)
        assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_sixteen_concurrent_streams_all_finish(port):
    many = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)

    def stream(index: int) -> str:
        chunks = many.completions.create(model="tiny", prompt=f"hello {index}", max_tokens=4, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, range(16)))
    assert len(texts) == 16 and all(texts)


def test_metrics_parse_and_count_tokens_by_level(port, client):
    client.completions.create(model="tiny@0.5", prompt="hello", max_tokens=3, extra_body={"slo": {"ttft": 10}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(connection.getresponse().read().decode())}
    connection.close()
    tokens = {s.labels["level"]: s.value for s in families["elastify_generated_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens["0.5"] >= 3
    assert {"elastify_ttft_seconds", "elastify_tpot_seconds", "elastify_slo", "elastify_queue_depth",
            "elastify_requests"} <= set(families)


class GatedModel:
    """The real model behind a gate (generation waits until it opens) that counts the pieces it streamed."""

    def __init__(self, model):
        self.model, self.gate, self.pieces, self.started = model, threading.Event(), [], threading.Semaphore(0)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, *args, **kwargs):
        self.started.release()
        self.gate.wait(60)
        return CountedStream(self.model.generate(*args, **kwargs), self.pieces)


class CountedStream:
    def __init__(self, stream, pieces: list):
        self.stream, self.pieces, self.result = stream, pieces, None

    def __iter__(self):
        for piece in self.stream:
            self.pieces.append(piece)
            yield piece
        self.result = self.stream.result


def test_a_full_queue_is_429_with_retry_after(model):
    gated = GatedModel(model)
    with serving(gated, max_queue=1) as free_port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="-", max_retries=0, timeout=60)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.completions.create, model="tiny", prompt="a", max_tokens=2)
            assert gated.started.acquire(timeout=30)  # the first request holds the model
            waiting = pool.submit(client.completions.create, model="tiny", prompt="b", max_tokens=2)
            for _ in range(600):  # until the second request sits in the queue
                if _queued(free_port) == 1:
                    break
                time.sleep(0.05)
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model="tiny", prompt="c", max_tokens=2)
            assert refused.value.response.headers["Retry-After"] == "1"
            gated.gate.set()
            assert running.result().choices[0].text and waiting.result().choices[0].text  # both were served


def _queued(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/health")
    depth = json.loads(connection.getresponse().read())["queue"]
    connection.close()
    return depth


def test_a_client_that_disconnects_frees_its_slot(model):
    gated = GatedModel(model)
    gated.gate.set()
    with serving(gated, max_queue=1) as free_port:
        connection = http.client.HTTPConnection("127.0.0.1", free_port, timeout=60)
        body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 4096, "min_tokens": 4096, "stream": True})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert answer.status == 200 and answer.read(6) == b"data: "
        connection.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        connection.close()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="-", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="b", max_tokens=2).usage.completion_tokens == 2
        assert len(gated.pieces) < 4096 + 2  # the abandoned generation stopped early


def test_a_level_the_report_card_marks_unusable_is_listed_with_the_flag(package):
    flagged = ElasticModel.load(package, allow_unsigned=True)
    flagged.manifest.elastic.levels[0].usable = False  # as a report card that failed level 0.25 writes it
    with serving(flagged) as free_port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="-", max_retries=0)
        listed = {m.id: m.model_extra["elastify"]["usable"] for m in client.models.list().data}
    assert listed["tiny@0.25"] is False and listed["tiny@0.5"] is True
