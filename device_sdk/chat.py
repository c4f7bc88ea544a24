"""The package's chat template (model/chat_template.jinja): chat messages to one prompt string.

Rendered with Jinja2 the way Hugging Face tokenizers render it (a sandbox, trim_blocks and
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), so a prompt
here is the prompt the model was trained on.

A `ChatPrompt` (a conversation and its template) is what `ElasticModel.generate` compresses a chat as:
the contents of the turns before the last user turn, each on its own, and only then the template
renders, so its own text (role headers, special tokens, the generation prompt) and the last user turn
reach the model as written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from device_sdk.format import PackageError


class ChatTemplateError(ValueError):
    """A conversation the template refuses (it called raise_exception) or cannot render."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            self.template = environment.from_string(source)
        except TemplateError as err:
            raise PackageError(f"the package's chat template does not parse: {err}") from None
        self.special_tokens = special_tokens or {}

    @classmethod
    def load(cls, model_dir: Path) -> ChatTemplate | None:
        """The template beside a package's tokenizer: chat_template.jinja, else tokenizer_config.json's
        `chat_template` string; None when the package has neither (a base model)."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        special = {key: text for key, text in special.items() if text is not None}
        template_path = model_dir / "chat_template.jinja"
        if template_path.is_file():
            return cls(template_path.read_text(), special)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        return cls(source, special) if isinstance(source, str) else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template cannot render these messages: {err}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatPrompt:
    """A conversation and the template that renders it: a prompt whose compression touches message contents only.

    The turns before the last user turn (the system prompt, earlier exchanges) may be compressed; the
    last user turn, anything after it, and the template's own text never are. `text` is the prompt as
    written; `compressed(compress)` renders it after `compress` has shortened each compressible content
    (its leading and trailing whitespace kept as written).
    """

    def __init__(self, template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = True):
        if not isinstance(messages, list | tuple) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
        self.template = template
        self.messages = [dict(message) for message in messages]
        self.add_generation_prompt = add_generation_prompt
        self.text = template.render(self.messages, add_generation_prompt)  # refused here, before any queue

    def compressible(self) -> list[int]:
        """Indices of the messages compression may shorten: text contents before the last user turn
        (none when no turn is the user's)."""
        last_user = max((i for i, message in enumerate(self.messages) if message.get("role") == "user"), default=0)
        return [i for i in range(last_user) if isinstance(self.messages[i].get("content"), str)]

    def compressible_text(self) -> list[str]:
        return [self.messages[i]["content"] for i in self.compressible()]

    def compressed(self, compress: Callable[[str], str]) -> str:
        """The template rendered over the messages with each compressible content passed through `compress`."""
        messages = [dict(message) for message in self.messages]
        for i in self.compressible():
            messages[i]["content"] = _compress_content(messages[i]["content"], compress)
        return self.template.render(messages, self.add_generation_prompt)


def _compress_content(content: str, compress: Callable[[str], str]) -> str:
    body = content.strip()
    if not body:
        return content
    start = content.index(body)
    return content[:start] + compress(body) + content[start + len(body):]
