"""A local OpenAI-compatible service over one ElasticModel (standard library HTTP, Jinja2 chat templates).

    POST /v1/completions       {"prompt": "...", "max_tokens": 32, "stream": false, "stop": ["\\n"],
                                "temperature": 0.7, "top_p": 0.9, "seed": 1,
                                "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
                                "slo": {"ttft_ms": 200, "tpot_ms": 40},   # or {"ttft": 0.5, "tpot": 0.8}
                                "keep": "...",   # the prompt's end that compression keeps whole
                                "min_tokens": 1} # tokens before end-of-sequence may come (0 allows none)
    POST /v1/chat/completions  {"messages": [{"role": "user", "content": "..."}], ...the same fields}
    GET  /v1/models, GET /health

Chat prompts are rendered with the package's own chat template. Without `temperature` or
`top_p` decoding is greedy; with either it samples (the other defaults to 1, as OpenAI's do),
reproducibly for a given `seed`. OpenAI's frequency and presence penalties and vLLM's
`repetition_penalty` apply greedy or sampled (runtime.Sampling). A parameter this server does not honour (`n` > 1, `logprobs`,
`echo`, `tools`, ...) is refused with a 400 naming it, never silently ignored.

Several apps share one model: one request runs at a time (a single worker thread owns the
model, so level switches never race a generation); up to `max_queue` more wait, and the
rest get 503 at once. Streaming answers are server-sent events, ending with `data: [DONE]`.
The response's extra `elastify` object reports the chosen level and prompt ratio, TTFT, TPOT and `slo_met`.
Every request body is read before the answer, whatever the answer, so a keep-alive connection
stays usable after an error.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from device_sdk.chat import ChatTemplate, ChatTemplateError
from device_sdk.latency import SLO
from device_sdk.runtime import Sampling

_DONE = object()
MAX_BODY = 4 << 20  # bytes; a larger request gets 413 and the connection is closed
MAX_TOKENS = 4096
CHAT_DEFAULT_MAX_TOKENS = 512  # OpenAI's chat has no default cap; this one bounds an unasked-for essay
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4

# Parameters that are accepted only at the value that asks for nothing this server cannot do.
_ONLY_DEFAULT = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_COMMON = {"model", "max_tokens", "min_tokens", "stream", "stream_options", "temperature", "top_p", "seed", "stop",
           "user", "slo", "presence_penalty", "frequency_penalty", "repetition_penalty"}
_ACCEPTED = {
    "completion": _COMMON | {"prompt", "keep"},
    "chat": _COMMON | {"messages", "max_completion_tokens"},
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(ValueError):
    """A request this server refuses: `param` names the offending field, `code` classifies it (OpenAI's fields)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error document."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Job:
    def __init__(self, request: dict):
        self.request = request
        self.events: queue.Queue = queue.Queue()  # text pieces, then a Generation or an exception, then _DONE


class CompletionService:
    """The model, its chat template, its single worker thread and the bounded queue in front of it."""

    def __init__(self, model, model_name: str, max_queue: int = 4, chat_template: ChatTemplate | None = None):
        self.model = model
        self.model_name = model_name
        self.chat_template = chat_template
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.worker = threading.Thread(target=self._work, name="elastify-model", daemon=True)
        self.worker.start()

    def submit(self, request: dict) -> Job | None:
        """Queue a request; None when the queue is full (the caller answers 503)."""
        job = Job(request)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return None
        return job

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                request = job.request
                stream = self.model.generate(request["prompt"], slo=request["slo"], max_new_tokens=request["max_tokens"],
                                             stream=True, sampling=request["sampling"], stop=request["stop"],
                                             keep=request["keep"], min_new_tokens=request["min_tokens"])
                for piece in stream:
                    job.events.put(piece)
                job.events.put(stream.result)
            except Exception as err:  # reported to the client; the worker keeps serving
                job.events.put(err)
            finally:
                job.events.put(_DONE)


# --------------------------------------------------------------------------- requests


def parse_request(body: bytes, kind: str = "completion", chat_template: ChatTemplate | None = None) -> dict:
    """Validate a completion (`kind` "completion") or chat request; raises RequestError for the client.

    A chat request's messages are rendered to `prompt` with `chat_template`.
    """
    try:
        data = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    unsupported = sorted(
        key for key, value in data.items()
        if (key in _ONLY_DEFAULT and value not in _ONLY_DEFAULT[key]) or (key not in _ONLY_DEFAULT and key not in _ACCEPTED[kind])
    )
    if unsupported:
        raise RequestError(f"unsupported parameter{'s' if len(unsupported) > 1 else ''}: {', '.join(unsupported)} "
                           "(this server generates one choice of plain text, without logprobs or tools)",
                           param=unsupported[0], code="unsupported_parameter")
    if kind == "chat":
        if chat_template is None:
            raise RequestError("this package has no chat template; use /v1/completions", param="messages")
        try:
            prompt = chat_template.render(parse_messages(data.get("messages")))
        except ChatTemplateError as err:
            raise RequestError(str(err), param="messages") from None
        max_tokens = _max_tokens(data, "max_completion_tokens", CHAT_DEFAULT_MAX_TOKENS)
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string (one prompt per request)", param="prompt")
        max_tokens = _max_tokens(data, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    min_tokens = data.get("min_tokens", 1)  # vLLM's extension; 1, not its 0: an empty answer is no answer
    if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise RequestError(f"min_tokens must be an integer in 0..max_tokens ({max_tokens})", param="min_tokens")
    keep = data.get("keep", "")
    if not isinstance(keep, str) or not prompt.endswith(keep):
        raise RequestError("keep must be a string that ends the prompt (the part compression keeps whole)",
                           param="keep")
    stream = data.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not stream and options:
        raise RequestError("stream_options takes only include_usage, and only with stream: true", param="stream_options")
    try:
        slo = parse_slo(data.get("slo"))
    except ValueError as err:
        raise RequestError(str(err), param="slo") from None
    return {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": min_tokens, "stream": stream,
            "include_usage": bool(options.get("include_usage")), "slo": slo,
            "sampling": parse_sampling(data), "stop": parse_stop(data.get("stop")), "keep": keep}


def parse_messages(messages) -> list[dict]:
    """Chat messages as the template expects them: role and text content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    rendered = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", param=where)
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise RequestError(f"unsupported field{'s' if len(extra) > 1 else ''} in {where}: {', '.join(extra)}",
                               param=f"{where}.{extra[0]}", code="unsupported_parameter")
        role = message.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, not {role!r}", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"{where}.content: only text parts are supported", param=f"{where}.content",
                                   code="unsupported_parameter")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        rendered.append({"role": _ROLES[role], "content": content})
    return rendered


def _max_tokens(data: dict, alias: str, default: int) -> int:
    value = data.get(alias) if data.get(alias) is not None else data.get("max_tokens")
    if value is None:
        return default
    if not _is_int(value) or not 1 <= value <= MAX_TOKENS:
        raise RequestError(f"max_tokens must be an integer in 1..{MAX_TOKENS}", param=alias if alias in data else "max_tokens")
    return value


# Penalty parameters: OpenAI's two, and vLLM's repetition_penalty; (default, check, what the check says).
_PENALTIES = {
    "presence_penalty": (0.0, lambda v: -2 <= v <= 2, "a number in -2..2"),
    "frequency_penalty": (0.0, lambda v: -2 <= v <= 2, "a number in -2..2"),
    "repetition_penalty": (1.0, lambda v: 0 < v <= 10, "a number in (0, 10]"),
}


def parse_sampling(data: dict) -> Sampling | None:
    """None (greedy, no penalties) unless a sampling or penalty parameter is given; OpenAI's ranges and
    defaults. Without temperature or top_p decoding stays greedy, penalties or not."""
    temperature, top_p, seed = data.get("temperature"), data.get("top_p"), data.get("seed")
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= 2):
        raise RequestError("temperature must be a number in 0..2", param="temperature")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise RequestError("top_p must be a number in (0, 1]", param="top_p")
    if seed is not None and (not _is_int(seed) or not -(1 << 63) <= seed < 1 << 64):
        raise RequestError("seed must be a 64-bit integer", param="seed")
    penalties = {}
    for name, (default, valid, expected) in _PENALTIES.items():
        value = data.get(name)
        if value is not None and (not _is_number(value) or not valid(value)):
            raise RequestError(f"{name} must be {expected}", param=name)
        penalties[name] = default if value is None else float(value)
    if temperature is None and top_p is None:
        sampled = Sampling(temperature=0, seed=seed, **penalties)
        return sampled if sampled.penalised else None
    return Sampling(temperature=1.0 if temperature is None else float(temperature),
                    top_p=1.0 if top_p is None else float(top_p), seed=seed, **penalties)


def parse_stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise RequestError(f"stop must be a non-empty string or a list of 1..{MAX_STOPS} of them", param="stop")
    return tuple(stops)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_slo(value) -> SLO | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("slo must be an object")
    numbers = {k: v for k, v in value.items() if k in ("ttft_ms", "tpot_ms", "ttft", "tpot")}
    if set(value) - set(numbers) or any(not _is_number(v) or v <= 0 for v in numbers.values()):
        raise ValueError("slo takes positive ttft_ms/tpot_ms (milliseconds) or ttft/tpot (fractions of full)")
    if "ttft" in numbers or "tpot" in numbers:
        if "ttft_ms" in numbers or "tpot_ms" in numbers:
            raise ValueError("slo is either absolute (ttft_ms, tpot_ms) or fractional (ttft, tpot), not both")
        return SLO.fraction(numbers.get("ttft"), numbers.get("tpot"))
    return SLO(numbers.get("ttft_ms"), numbers.get("tpot_ms"))


# --------------------------------------------------------------------------- HTTP


class BodyError(Exception):
    """A request body that cannot be read whole; the connection is closed after the answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def make_handler(service: CompletionService):
    routes = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # quiet by default; the CLI prints one line per request
            pass

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok", "level": service.model.level})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": service.model_name, "object": "model", "created": 0, "owned_by": "elastify"}]})
            else:
                self._json(404, error_body(f"no route GET {self.path}", code="not_found"))

        def do_POST(self):
            if self._read_body() is None:
                return
            kind = routes.get(self.path)
            if kind is None:
                self._json(404, error_body(f"no route POST {self.path}", code="not_found"))
                return
            try:
                request = parse_request(self.body, kind, service.chat_template)
            except RequestError as err:
                self._json(400, error_body(str(err), param=err.param, code=err.code))
                return
            job = service.submit(request)
            if job is None:
                self._json(503, error_body("the model is busy and its queue is full; retry later", "server_error"))
                return
            ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            chunks = ChatChunks if kind == "chat" else CompletionChunks
            first = job.events.get()  # an error before any text still gets its own status
            if isinstance(first, Exception):
                self._generation_failed(first)
                while job.events.get() is not _DONE:
                    pass
            elif request["stream"]:
                self._stream(job, first, chunks(ident, service.model_name, request["include_usage"]))
            else:
                self._complete(job, first, chunks(ident, service.model_name, False))

        def _other_method(self):
            if self._read_body() is not None:
                self._json(405, error_body(f"{self.command} is not allowed on {self.path}", code="method_not_allowed"),
                           {"Allow": "GET, POST"})

        do_PUT = do_PATCH = do_DELETE = _other_method

        def _read_body(self) -> bytes | None:
            """Read the whole body (Content-Length or chunked) into self.body; None once an error was answered."""
            try:
                self.body = self._body_bytes()
                return self.body
            except BodyError as err:
                self.close_connection = True  # the rest of the body is still on the wire
                self._json(err.status, error_body(str(err)), {"Connection": "close"})
                return None

        def _body_bytes(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                parts, size = [], 0
                while (length := self._chunk_size()) > 0:
                    size += length
                    if size > MAX_BODY:
                        raise BodyError(413, f"the body is over {MAX_BODY} bytes")
                    parts.append(self.rfile.read(length))
                    self.rfile.readline()
                while self.rfile.readline().strip():  # trailers
                    pass
                return b"".join(parts)
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise BodyError(400, "Content-Length is not a number") from None
            if length < 0 or length > MAX_BODY:
                raise BodyError(413, f"the body is over {MAX_BODY} bytes")
            return self.rfile.read(length)

        def _chunk_size(self) -> int:
            line = self.rfile.readline(1024)
            try:
                return int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BodyError(400, f"bad chunk size line {line[:40]!r}") from None

        def _generation_failed(self, err: Exception):
            if isinstance(err, ValueError):  # e.g. a prompt that encodes to no tokens
                self._json(400, error_body(str(err)))
            else:
                self._json(500, error_body(f"generation failed: {err}", "server_error"))

        def _complete(self, job: Job, event, chunks):
            while event is not _DONE:
                if isinstance(event, Exception):
                    self._generation_failed(event)
                    while job.events.get() is not _DONE:
                        pass
                    return
                if not isinstance(event, str):
                    result = event
                event = job.events.get()
            self._json(200, chunks.whole(result.text, result))

        def _stream(self, job: Job, event, chunks):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for payload in chunks.opening():
                self._event(payload)
            while event is not _DONE:
                if isinstance(event, Exception):
                    self._event(error_body(f"generation failed: {event}", "server_error"))
                elif isinstance(event, str):
                    self._event(chunks.piece(event))
                else:
                    for payload in chunks.closing(event):
                        self._event(payload)
                event = job.events.get()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, payload: dict):
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        def _json(self, status: int, payload: dict, headers: dict[str, str] | None = None):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    return Handler


# --------------------------------------------------------------------------- responses


def usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_tokens + len(result.tokens)}


def elastify_report(result) -> dict:
    """The extra `elastify` object: what the SLO chose and what it measured."""
    return {
        "level": result.level,
        "prompt_ratio": result.decision.prompt_ratio if result.decision else 1.0,
        "ttft_ms": round(result.ttft_ms, 3),
        "tpot_ms": None if result.tpot_ms is None else round(result.tpot_ms, 3),
        "slo_met": result.slo_met,
    }


def completion_body(ident: str, model_name: str, text: str, result) -> dict:
    """One OpenAI text_completion object; the final one carries usage and the `elastify` report."""
    body = {
        "id": ident,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }
    if result is not None:
        body["choices"][0]["finish_reason"] = result.finish_reason
        body["usage"] = usage(result)
        body["elastify"] = elastify_report(result)
    return body


class CompletionChunks:
    """/v1/completions answers: whole, or as stream chunks (each a text_completion object)."""

    def __init__(self, ident: str, model_name: str, include_usage: bool):
        self.ident, self.model_name, self.include_usage = ident, model_name, include_usage

    def whole(self, text: str, result) -> dict:
        return completion_body(self.ident, self.model_name, text, result)

    def opening(self) -> list[dict]:
        return []

    def piece(self, text: str) -> dict:
        return completion_body(self.ident, self.model_name, text, None)

    def closing(self, result) -> list[dict]:
        """The finish chunk (with the `elastify` report); usage in it, or after it with stream_options.include_usage."""
        last = completion_body(self.ident, self.model_name, "", result)
        if not self.include_usage:
            return [last]
        tally = last.pop("usage")
        return [last, {**self._envelope(), "choices": [], "usage": tally}]

    def _envelope(self) -> dict:
        return {"id": self.ident, "object": "text_completion", "created": int(time.time()), "model": self.model_name}


class ChatChunks(CompletionChunks):
    """/v1/chat/completions answers: a chat.completion, or chat.completion.chunk deltas."""

    def whole(self, text: str, result) -> dict:
        return {
            "id": self.ident, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": result.finish_reason}],
            "usage": usage(result),
            "elastify": elastify_report(result),
        }

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def piece(self, text: str) -> dict:
        return self._chunk({"content": text}, None)

    def closing(self, result) -> list[dict]:
        last = {**self._chunk({}, result.finish_reason), "elastify": elastify_report(result)}
        if not self.include_usage:
            return [{**last, "usage": usage(result)}]
        return [last, {**self._envelope(), "choices": [], "usage": usage(result)}]

    def _chunk(self, delta: dict, finish_reason: str | None) -> dict:
        return {**self._envelope(), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason}]}

    def _envelope(self) -> dict:
        return {"id": self.ident, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}


def make_server(model, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 4, model_name: str | None = None):
    """A ready ThreadingHTTPServer (call serve_forever); port 0 picks a free one."""
    package_dir = getattr(model, "package_dir", None)
    template = ChatTemplate.load(package_dir / "model") if package_dir is not None else None
    service = CompletionService(model, model_name or model.manifest.name, max_queue, template)
    server = ThreadingHTTPServer((host, port), make_handler(service))
    server.service = service
    return server
