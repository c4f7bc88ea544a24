"""Compression never touches the template: a chat compresses the contents of its turns before the last user
turn and renders the template afterwards, at every ratio of the TLM's grid, through `generate` and through
the server with the official `openai` client; a completion keeps its question whole (`question_tail`)."""

from __future__ import annotations

import re

import openai
import pytest
import torch

from device_sdk.chat import ChatPrompt, ChatTemplate, ChatTemplateError
from device_sdk.format import Level
from device_sdk.latency import SLO, Decision, Drift, LatencyProfile, LevelLatency
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import question_tail, words_of
from tests.support.sdk_packages import (
    LEVELS,
    TLM_HIDDEN,
    TLM_RATIOS,
    random_package,
    random_tlm,
    serving,
    sign_package,
    signing_key,
)

KEY = signing_key()
LEVEL_NAMES = [Level(ratio).name for ratio in LEVELS]
# SmolLM2-Instruct's own template (ChatML, a default system turn), a Llama-3-style one that trims contents
# around special tokens, and one with Jinja blocks and raise_exception (tests/unit/device_sdk/test_openai.py's).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
BLOCKS = (
    "{% if messages[0]['role'] != 'system' %}<s>system\nBe brief.</s>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.first %}{{ raise_exception('a chat starts with the user') }}{% endif %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TEMPLATES = {"chatml": ChatTemplate(CHATML), "llama3": ChatTemplate(LLAMA3, {"bos_token": "<|begin_of_text|>"}),
             "blocks": ChatTemplate(BLOCKS)}
SYSTEM = ("one of the two and three is four of five and six is seven of eight and nine is ten "
          "the one which is two of three and four what is five and six of seven")
CONVERSATIONS = {
    "system and turns": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "what is one and two ?"},
        {"role": "assistant", "content": "three . and four of five is nine . which is ten"},
        {"role": "user", "content": "and what is two and two of four ?"},
    ],
    "no system": [
        {"role": "user", "content": "  " + SYSTEM + "\n"},
        {"role": "assistant", "content": "one two three four five six seven eight nine ten"},
        {"role": "user", "content": "what is six of seven ?"},
    ],
    "one turn": [{"role": "user", "content": SYSTEM + " ?"}],
}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A signed random package (long context) whose random TLM prefers ratio 1.0 and level 1.0."""
    root = tmp_path_factory.mktemp("chat-compression")
    heads = {"ratio_head.weight": torch.zeros(len(TLM_RATIOS), TLM_HIDDEN),
             "ratio_head.bias": torch.tensor([5.0 if r == 1.0 else 0.0 for r in TLM_RATIOS]),
             "level_head.weight": torch.zeros(len(LEVEL_NAMES), TLM_HIDDEN),
             "level_head.bias": torch.tensor([float(i) for i in range(len(LEVEL_NAMES))])}
    tlm = random_tlm(root / "tlm", LEVEL_NAMES, heads=heads)
    path = random_package("llama_gqa", root / "pkg", KEY, tlm=tlm, max_position=1024)
    (path / "model" / "chat_template.jinja").write_text(CHATML)
    sign_package(path, KEY)
    return path


@pytest.fixture(scope="module")
def model(package) -> ElasticModel:
    """The package's model with a fixed profile: TTFT 1 ms a prompt token at every level, so an SLO on TTFT
    below the full prompt's can be met only by compressing; TPOT that of the level."""
    loaded = ElasticModel.load(package, allow_unsigned=True)
    loaded.latency_profile = LatencyProfile("fp32", 1, {name: LevelLatency(0.0, 1.0, float(Level(name).ratio))
                                                        for name in LEVEL_NAMES}, drift=Drift(quantile=None))
    return loaded


def template_pieces(chat: ChatPrompt) -> list[str]:
    """The template's own text around each message content: rendered with a marker for each content."""
    marked = ChatPrompt(chat.template, [{**m, "content": f"@@{i}@@"} for i, m in enumerate(chat.messages)])
    return re.split(r"@@\d+@@", marked.text)


def assert_template_survives(chat: ChatPrompt, served: str, ratio: float) -> None:
    """`served` is the template's text byte for byte, in order, around the contents: the last user turn (and
    what follows it) whole, each earlier content some of its own words, in order, fewer below ratio 1."""
    pattern = "(.*?)".join(map(re.escape, template_pieces(chat)))
    assert len(template_pieces(chat)) == len(chat.messages) + 1  # each content rendered once, in order
    written = re.fullmatch(pattern, chat.text, re.DOTALL).groups()  # each content as the template writes it
    found = re.fullmatch(pattern, served, re.DOTALL)
    assert found, f"the template's text did not survive at ratio {ratio}: {served!r}"
    last_user = max(i for i, message in enumerate(chat.messages) if message["role"] == "user")
    for index, (original, content) in enumerate(zip(written, found.groups(), strict=True)):
        if index >= last_user or ratio == 1.0:
            assert content == original, f"message {index} ({chat.messages[index]['role']}) changed at ratio {ratio}"
            continue
        words, kept = words_of(original), words_of(content)
        remaining = iter(words)
        assert all(word in remaining for word in kept) and len(kept) < len(words)


def test_compressible_turns_are_those_before_the_last_user_turn():
    chat = ChatPrompt(TEMPLATES["chatml"], [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                                            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    assert chat.compressible() == [0, 1]  # the last user turn and the assistant's start after it stay
    assert ChatPrompt(TEMPLATES["chatml"], [{"role": "user", "content": "q"}]).compressible() == []
    assert chat.compressed(lambda text: "") == chat.template.render(
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}, *chat.messages[2:]])
    with pytest.raises(ChatTemplateError, match="messages must be a list"):
        ChatPrompt(TEMPLATES["chatml"], ["hi"])


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_the_rendered_template_survives_compression_at_every_ratio(model, template, conversation):
    chat = ChatPrompt(TEMPLATES[template], CONVERSATIONS[conversation])
    assert chat.compressed(lambda text: text) == chat.text
    for ratio in model.tlm.ratios:
        served = chat.compressed(lambda text, r=ratio: model.tlm.compress(text, r, ("?",)).text)
        assert_template_survives(chat, served, ratio)
        if ratio < 1.0 and chat.compressible():
            assert len(served) < len(chat.text)


@pytest.mark.parametrize("template", TEMPLATES)
def test_generate_serves_a_chat_with_its_template_whole_at_every_ratio(model, template, monkeypatch):
    """Through `generate`: the decision's ratio compresses the contents only; the cost model is told that
    the template and the last user turn are kept (one byte-level token a character here)."""
    chat = ChatPrompt(TEMPLATES[template], CONVERSATIONS["system and turns"])
    compressible = sum(len(text) for text in chat.compressible_text())
    for ratio in model.tlm.ratios:
        asked = []

        def decide(prompt, prompt_tokens, slo, profile, levels, kept_tokens=0, r=ratio, seen=asked):
            seen.append((prompt, prompt_tokens, kept_tokens))
            return Decision("1.0", prompt_ratio=r)

        monkeypatch.setattr(model, "decide", decide)
        out = model.generate(chat, slo=SLO(ttft_ms=1e9), max_new_tokens=1)
        assert asked == [(chat.text, len(chat.text), len(chat.text) - compressible)]
        assert out.decision.prompt_ratio == ratio and out.prompt_tokens == len(out.served_prompt)
        assert_template_survives(chat, out.served_prompt, ratio)
    with pytest.raises(ValueError, match="last user turn"):
        model.generate(chat, keep="?", max_new_tokens=1)


@pytest.mark.parametrize(("prompt", "tail"), [
    ("What is the capital of France?", "What is the capital of France?"),  # one line: all question
    ("The capital of France is", "The capital of France is"),
    ("a passage. More of it.\nQuestion: Tom has 3 apples. How many?\nAnswer:",
     "Question: Tom has 3 apples. How many?\nAnswer:"),  # the labelled layout: what the label stage keeps
    ("Question: q1\nAnswer: a1\n\nQuestion: q2 in\ntwo lines\nAnswer:", "Question: q2 in\ntwo lines\nAnswer:"),
    ("Q: one?\nA: two\n\nQ: three?\nA:", "Q: three?\nA:"),
    ("Was it one? It was.\n\nA passage\nwhat comes after nine?\nAnswer:", "what comes after nine?\nAnswer:"),
    ("Was it one? It was.\n\nThe capital of Spain is", "The capital of Spain is"),  # an earlier "?" is context
    ("a passage\nthe end of it\n\n", "the end of it\n\n"),
    ("", ""),
])
def test_question_tail_is_the_prompts_question(prompt, tail):
    assert question_tail(prompt) == tail and prompt.endswith(tail)


def test_a_completion_keeps_its_question_whole(model, monkeypatch):
    monkeypatch.setattr(model, "decide", lambda *a, **k: Decision("1.0", prompt_ratio=0.3))
    question = "what is the capital of France ?"  # the case: a bare question was cut to half
    assert model.generate(question, slo=SLO(ttft_ms=1e9), max_new_tokens=1).served_prompt == question
    passage = "one two three four five six seven eight nine ten and one of two is three"
    asked = "\nQuestion: which one comes after nine ?\nAnswer:"
    out = model.generate(passage + asked, slo=SLO(ttft_ms=1e9), max_new_tokens=1)
    assert out.served_prompt.endswith(asked) and out.served_prompt == model.compress(passage, 0.3) + asked
    assert len(words_of(out.served_prompt[:-len(asked)])) < len(words_of(passage))
    whole = model.generate(passage + asked, slo=SLO(ttft_ms=1e9), max_new_tokens=1, keep="")  # "" keeps nothing
    assert whole.served_prompt == model.compress(passage + asked, 0.3)


class Recording:
    """The real model, recording each generation's result (what the server served it on)."""

    def __init__(self, model):
        self.model, self.results = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, *args, **kwargs):
        return RecordedStream(self.model.generate(*args, **kwargs), self.results)


class RecordedStream:
    def __init__(self, stream, results: list):
        self.stream, self.results, self.result = stream, results, None

    def __iter__(self):
        yield from self.stream
        self.result = self.stream.result
        self.results.append(self.result)


def test_openai_chat_under_a_tight_slo_compresses_the_system_turn_not_the_template(model):
    recording = Recording(model)
    messages = CONVERSATIONS["system and turns"]
    chat = ChatPrompt(TEMPLATES["chatml"], messages)
    with serving(recording) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60)
        # TTFT at 0.8 of the full prompt's: ratio 1.0 (the TLM's favourite) cannot meet it at any level
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                               extra_body={"slo": {"ttft": 0.8}})
        report, served = reply.model_extra["elastify"], recording.results[-1]
        assert report["prompt_ratio"] < 1.0 and report["prompt_ratio"] in model.tlm.ratios
        assert report["prompt_ratio"] == served.decision.prompt_ratio and report["level"] == served.level == "1.0"
        assert_template_survives(chat, served.served_prompt, report["prompt_ratio"])
        assert reply.usage.prompt_tokens == len(served.served_prompt) < len(chat.text)
        assert reply.choices[0].message.content == model.generate(served.served_prompt, level="1.0",
                                                                  max_new_tokens=3).text
        streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True,
                                                       extra_body={"slo": {"ttft": 0.8}}))
        assert streamed[-1].model_extra["elastify"]["prompt_ratio"] == report["prompt_ratio"]
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content
        # Without an SLO nothing is compressed: the template renders the conversation as written.
        plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        assert plain.model_extra["elastify"]["prompt_ratio"] == 1.0
        assert recording.results[-1].served_prompt == chat.text
