"""`elastify-device serve` driven by the official `openai` client: chat and completions, streamed and not,
stop strings, seeded sampling, refused parameters, and keep-alive after an error."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import openai
import pytest

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
    with serving(model, max_queue=2) as free_port:
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
    (lambda c: c.chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}], n=2), "n"),
    (lambda c: c.completions.create(model="t", prompt="a", logprobs=2, echo=True), "echo, logprobs"),
    (lambda c: c.chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}],
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
        client.chat.completions.create(model="t", messages=[{"role": "assistant", "content": "a"}])
    assert "a chat starts with the user" in template_refused.value.message
    with pytest.raises(openai.BadRequestError) as bad_role:
        client.chat.completions.create(model="t", messages=[{"role": "tool", "content": "a", "tool_call_id": "1"}])
    assert bad_role.value.param == "messages[0].tool_call_id"
    with pytest.raises(openai.BadRequestError) as bad_stop:
        client.completions.create(model="t", prompt="a", stop=[""])
    assert bad_stop.value.param == "stop"


def test_keep_must_end_the_prompt_and_is_for_completions_only(client):
    """`keep` (the prompt's end that compression leaves whole) is an extension of /v1/completions."""
    served = client.completions.create(model="t", prompt="a passage. Question: why?", max_tokens=2,
                                       extra_body={"keep": " Question: why?"})
    assert served.choices[0].text
    with pytest.raises(openai.BadRequestError) as not_the_end:
        client.completions.create(model="t", prompt="a passage", max_tokens=2, extra_body={"keep": "why?"})
    assert not_the_end.value.param == "keep"
    with pytest.raises(openai.BadRequestError) as on_chat:
        client.chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}], extra_body={"keep": "a"})
    assert on_chat.value.code == "unsupported_parameter" and on_chat.value.param == "keep"


def test_a_package_without_a_chat_template_refuses_chat(tmp_path):
    path = random_package("llama_mha", tmp_path / "pkg", KEY)
    with serving(ElasticModel.load(path, allow_unsigned=True)) as free_port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}])
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
    assert bad.status == 400 and "chunk size" in json.loads(bad.read())["error"]["message"]
    assert bad.getheader("Connection") == "close"
    connection.close()
