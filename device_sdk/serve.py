"""A local OpenAI-compatible service over one ElasticModel (FastAPI + uvicorn, Jinja2 chat templates).

    POST /v1/completions       {"prompt": "...", "max_tokens": 32, "stream": false, "stop": ["\\n"],
                                "temperature": 0.7, "top_p": 0.9, "seed": 1,
                                "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
                                "model": "NAME@0.5",   # a level id from /v1/models; "NAME" lets the SLO decide
                                "slo": {"ttft_ms": 200, "tpot_ms": 40},   # or {"ttft": 0.5, "tpot": 0.8}
                                "level": "0.5",  # extension: the level, as model="NAME@0.5" does
                                "keep": "...",   # the prompt's end that compression keeps whole (default: its question)
                                "min_tokens": 1} # tokens before end-of-sequence may come (0 allows none)
    POST /v1/chat/completions  {"messages": [{"role": "user", "content": "..."}], ...the same fields}
    GET  /v1/models   NAME (the SLO-decided default) and NAME@<level> per level held; a level the
                      package's report card marks unusable has "elastify": {"usable": false}
    GET  /health, GET /metrics (Prometheus text: requests, tokens, TTFT/TPOT by level, SLO met/missed, queue)

Chat prompts are rendered with the package's own chat template. Under an SLO whose prompt ratio is below 1,
only the contents of the turns before the last user turn are compressed, and then the template renders:
its own text and the last user turn reach the model as written. A completion keeps its question whole
(`keep`, by default the SDK's `question_tail`). Without `temperature` or
`top_p` decoding is greedy; with either it samples (the other defaults to 1, as OpenAI's do),
reproducibly for a given `seed`. OpenAI's frequency and presence penalties and vLLM's
`repetition_penalty` apply greedy or sampled (runtime.Sampling). A parameter this server does not honour
(`n` > 1, `logprobs`, `echo`, `tools`, ...) is refused with a 400 naming it, never silently ignored; so are
bodies with NaN/Infinity, lone surrogates or nesting too deep to parse. An unknown `model` is a 404.

Several apps share one model: one request runs at a time (a single worker thread owns the model, so level
switches never race a generation); up to `max_queue` more wait, and the rest get 429 with Retry-After.
A client that disconnects stops its generation at the next token; a queued request whose client left
never runs. Streaming answers are server-sent events, ending with `data: [DONE]`. The response's extra
`elastify` object reports the chosen level and prompt ratio, TTFT, TPOT and `slo_met`; the headers
X-Elastify-Level and X-Elastify-Prompt-Ratio say the same on non-streamed answers (a stream's headers
leave before the level is chosen, so there they come in the final chunk's `elastify` only).
uvicorn closes a connection whose headers do not arrive within `timeout_keep_alive` and caps concurrent
connections (`limit_concurrency`, answered 503) so half-sent requests cannot pile up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import socket
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from device_sdk.chat import ChatPrompt, ChatTemplate, ChatTemplateError
from device_sdk.latency import SLO
from device_sdk.runtime import Sampling

access_log = logging.getLogger("device_sdk.serve.access")
MAX_BODY = 4 << 20  # bytes; a larger request gets 413
MAX_TOKENS = 4096
CHAT_DEFAULT_MAX_TOKENS = 512  # OpenAI's chat has no default cap; this one bounds an unasked-for essay
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4
RETRY_AFTER_S = 1  # what a 429 suggests; one short generation's worth
KEEP_ALIVE_TIMEOUT_S = 5  # uvicorn drops an idle or header-less connection after this
MAX_CONNECTIONS = 64  # uvicorn answers 503 beyond this many open connections/tasks

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
           "user", "slo", "level", "presence_penalty", "frequency_penalty", "repetition_penalty"}
_ACCEPTED = {
    "completion": _COMMON | {"prompt", "keep"},
    "chat": _COMMON | {"messages", "max_completion_tokens"},
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(ValueError):
    """A request this server refuses: `param` names the offending field, `code` classifies it (OpenAI's fields)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error document."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Job:
    """One request on its way through the worker; events go back to the request's event loop."""

    def __init__(self, request: dict, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()  # text pieces, then a Generation or an exception, then _DONE
        self.cancelled = threading.Event()  # the client left: stop at the next token, or never start

    def put(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shut down); nobody is listening
            self.cancelled.set()


_DONE = object()


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


class ServerMetrics:
    """The Prometheus series of one server, in a registry of its own so several servers can share a process."""

    def __init__(self, queue_depth):
        self.registry = CollectorRegistry()
        self.requests = Counter("elastify_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.tokens = Counter("elastify_generated_tokens", "Tokens generated", ["level"], registry=self.registry)
        self.ttft = Histogram("elastify_ttft_seconds", "Time to first token", ["level"], registry=self.registry)
        self.tpot = Histogram("elastify_tpot_seconds", "Time per output token after the first", ["level"],
                              registry=self.registry)
        self.slo = Counter("elastify_slo", "Requests with an SLO, by outcome", ["outcome"], registry=self.registry)
        self.queue = Gauge("elastify_queue_depth", "Requests waiting for the model", registry=self.registry)
        self.queue.set_function(queue_depth)

    def observe(self, result) -> None:
        level = result.level or "custom"
        self.tokens.labels(level).inc(len(result.tokens))
        self.ttft.labels(level).observe(result.ttft_ms / 1000)
        if result.tpot_ms is not None:
            self.tpot.labels(level).observe(result.tpot_ms / 1000)
        if result.slo_met is not None:
            self.slo.labels("met" if result.slo_met else "missed").inc()


class CompletionService:
    """The model, its chat template, its single worker thread and the bounded queue in front of it."""

    def __init__(self, model, model_name: str, max_queue: int = 16, chat_template: ChatTemplate | None = None):
        self.model = model
        self.model_name = model_name
        self.chat_template = chat_template
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.metrics = ServerMetrics(self.jobs.qsize)
        self.worker = threading.Thread(target=self._work, name="elastify-model", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the caller answers 429)."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def levels(self) -> list:
        held = set(self.model.available_levels())
        return [level for level in self.model.manifest.elastic.levels if level.name in held]

    def models(self) -> list[dict]:
        """/v1/models: the SLO-decided default, then one id per level held."""
        entries = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "elastify",
                    "elastify": {"level": None, "usable": True}}]
        for level in self.levels():
            entries.append({"id": f"{self.model_name}@{level.name}", "object": "model", "created": 0,
                            "owned_by": "elastify", "elastify": {"level": level.name, "usable": level.usable}})
        return entries

    def resolve_level(self, data: dict) -> str | None:
        """The level `model` ("NAME@0.5") or the `level` extension names; None lets the SLO decide."""
        model = data.get("model")
        chosen = None
        if model is not None and model != self.model_name:
            name, at, level = str(model).rpartition("@")
            if not at or name != self.model_name:
                raise RequestError(f"the model {model!r} does not exist; GET /v1/models lists them", param="model",
                                   code="model_not_found", status=404)
            chosen = level
        extra = data.get("level")
        if extra is not None:
            if not isinstance(extra, str | int | float) or isinstance(extra, bool):
                raise RequestError("level must be a level name such as \"0.5\"", param="level")
            extra = str(extra)
            if chosen is not None and chosen != extra:
                raise RequestError(f"model names level {chosen} but level says {extra}", param="level")
            chosen = extra
        if chosen is None:
            return None
        for level in self.levels():  # "0.50" names level 0.5
            if level.name == chosen or _same_number(level.name, chosen):
                return level.name
        raise RequestError(f"the model {self.model_name}@{chosen} does not exist; GET /v1/models lists them",
                           param="model", code="model_not_found", status=404)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():  # its client left while it waited
                job.put(_DONE)
                continue
            try:
                request = job.request
                stream = self.model.generate(request["prompt"], slo=request["slo"], max_new_tokens=request["max_tokens"],
                                             stream=True, sampling=request["sampling"], stop=request["stop"],
                                             keep=request["keep"], min_new_tokens=request["min_tokens"],
                                             level=request["level"])
                for piece in stream:
                    if job.cancelled.is_set():
                        break
                    job.put(piece)
                else:
                    self.metrics.observe(stream.result)
                    job.put(stream.result)
            except Exception as err:  # reported to the client; the worker keeps serving
                job.put(err)
            finally:
                job.put(_DONE)


# --------------------------------------------------------------------------- requests


def parse_request(body: bytes, kind: str = "completion", chat_template: ChatTemplate | None = None) -> dict:
    """Validate a completion (`kind` "completion") or chat request; raises RequestError for the client.

    A chat request's `prompt` is a ChatPrompt over `chat_template` (rendered here, so a conversation the
    template refuses is a 400 before it is queued; compressed per message content by the model).
    """
    try:
        data = json.loads(body or b"{}", parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"body is not JSON: {err}") from None
    except RecursionError:
        raise RequestError("body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    _check_text(data)
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
            prompt = ChatPrompt(chat_template, parse_messages(data.get("messages")))
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
    keep = data.get("keep")  # None: the SDK keeps the prompt's question (chat: its last user turn)
    if keep is not None and (not isinstance(keep, str) or not prompt.endswith(keep)):
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
            "sampling": parse_sampling(data), "stop": parse_stop(data.get("stop")), "keep": keep,
            "level": None}


def _no_constant(name: str):
    raise RequestError(f"{name} is not a JSON number; numbers must be finite")


def _check_text(data: dict) -> None:
    """Refuse lone surrogates (valid JSON escapes, but not text a tokenizer can encode)."""
    pending = [data]
    while pending:  # a loop, not recursion: the nesting json.loads allowed must not overflow here
        value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the body holds a lone surrogate (\\ud800-\\udfff); send UTF-8 text") from None
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


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
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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


async def _read_body(request: Request) -> bytes:
    """The whole body, refused with 413 past MAX_BODY (uvicorn has no body cap of its own)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise RequestError(f"the body is over {MAX_BODY} bytes", status=413)
        parts.append(part)
    return b"".join(parts)


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse(error_body(str(err), param=err.param, code=err.code), status_code=err.status)


def _failed(err: Exception) -> JSONResponse:
    if isinstance(err, ValueError):  # e.g. a prompt that encodes to no tokens
        return JSONResponse(error_body(str(err)), status_code=400)
    return JSONResponse(error_body(f"generation failed: {err}", "server_error"), status_code=500)


def _level_headers(result) -> dict[str, str]:
    report = elastify_report(result)
    return {"X-Elastify-Level": str(report["level"]), "X-Elastify-Prompt-Ratio": str(report["prompt_ratio"])}


def create_app(model, *, max_queue: int = 16, model_name: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over `model`; its worker thread starts here. `app.state.service` holds it."""
    package_dir = getattr(model, "package_dir", None)
    template = ChatTemplate.load(package_dir / "model") if package_dir is not None else None
    service = CompletionService(model, model_name or model.manifest.name, max_queue, template)
    metrics = service.metrics
    app = FastAPI(title="elastify-device", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.service = service

    @app.middleware("http")
    async def log_and_count(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        metrics.requests.labels(request.url.path if request.url.path in _ROUTES else "other",
                                str(response.status_code)).inc()
        access_log.info("%s %s %s %d %.1fms", request.client.host if request.client else "-", request.method,
                        request.url.path, response.status_code, (time.perf_counter() - started) * 1000)
        return response

    @app.exception_handler(404)
    async def not_found(request: Request, _exc):
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}", code="not_found"), 404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, _exc):
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}",
                                       code="method_not_allowed"), 405)

    @app.get("/health")
    async def health():
        return {"status": "ok", "level": service.model.level, "queue": service.jobs.qsize()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": service.models()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str):
        try:
            body = await _read_body(request)
            parsed = parse_request(body, kind, service.chat_template)
            parsed["level"] = service.resolve_level(json.loads(body or b"{}"))
        except RequestError as err:
            return _error(err)
        job = Job(parsed, asyncio.get_running_loop())
        if not service.submit(job):
            return JSONResponse(error_body("the model is busy and its queue is full; retry later", "server_error",
                                           code="queue_full"), 429, headers={"Retry-After": str(RETRY_AFTER_S)})
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        chunks = (ChatChunks if kind == "chat" else CompletionChunks)(ident, service.model_name,
                                                                      parsed["include_usage"])
        try:
            first = await _next_event(job, request)
        except _ClientGone:
            return Response(status_code=499)
        if first is _DONE:
            return Response(status_code=499)
        if isinstance(first, Exception):  # an error before any text still gets its own status
            _drain(job)
            return _failed(first)
        if parsed["stream"]:
            return EventSourceResponse(_events(job, first, chunks), headers={"Cache-Control": "no-cache"})
        return await _whole(job, first, chunks, request)

    return app


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class _ClientGone(Exception):
    pass


async def _next_event(job: Job, request: Request, poll_s: float = 0.25):
    """The job's next event; a client that disconnects meanwhile cancels the job (raises _ClientGone)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), poll_s)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                raise _ClientGone from None


def _drain(job: Job) -> None:
    job.cancelled.set()  # the worker stops at its next token; leftover events are dropped with the job


async def _whole(job: Job, event, chunks, request: Request):
    result = None
    try:
        while event is not _DONE:
            if isinstance(event, Exception):
                _drain(job)
                return _failed(event)
            if not isinstance(event, str):
                result = event
            event = await _next_event(job, request)
    except _ClientGone:
        return Response(status_code=499)
    if result is None:
        return Response(status_code=499)
    return JSONResponse(chunks.whole(result.text, result), headers=_level_headers(result))


def _sse(payload) -> bytes:
    return format_sse_event(data_str=payload if isinstance(payload, str) else json.dumps(payload))


async def _events(job: Job, event, chunks):
    """The SSE stream; starlette cancels this generator when the client disconnects, which cancels the job."""
    try:
        for payload in chunks.opening():
            yield _sse(payload)
        while event is not _DONE:
            if isinstance(event, Exception):
                yield _sse(error_body(f"generation failed: {event}", "server_error"))
            elif isinstance(event, str):
                yield _sse(chunks.piece(event))
            else:
                for payload in chunks.closing(event):
                    yield _sse(payload)
            event = await job.events.get()
        yield _sse("[DONE]")
    finally:
        job.cancelled.set()  # a no-op after _DONE; after a disconnect it frees the model at the next token


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




class BackgroundServer:
    """A uvicorn server on a socket bound now (port 0 picks a free one): `serve_forever` blocks,
    `shutdown` stops it from another thread. For the CLI and for tests that serve in a thread."""

    def __init__(self, model, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
                 model_name: str | None = None, log_requests: bool = False):
        import uvicorn  # lazy: only serving needs it

        self.app = create_app(model, max_queue=max_queue, model_name=model_name)
        self.service = self.app.state.service
        self.socket = socket.create_server((host, port), reuse_port=False)
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level="info" if log_requests else "warning", access_log=False,
                                timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, limit_concurrency=MAX_CONNECTIONS,
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.stopped = threading.Event()
        if log_requests:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
            access_log.setLevel(logging.INFO)

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.stopped.set()

    def shutdown(self, timeout_s: float = 10) -> None:
        self.server.should_exit = True
        self.stopped.wait(timeout_s)

    def server_close(self) -> None:
        self.socket.close()


def make_server(model, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
                model_name: str | None = None) -> BackgroundServer:
    """A ready server (call serve_forever); port 0 picks a free one. Kept for callers that serve in a thread."""
    return BackgroundServer(model, host, port, max_queue, model_name)


def run_server(model, *, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
               model_name: str | None = None, log_requests: bool = True) -> None:
    """Serve `model` until interrupted (uvicorn; one access-log line per request when `log_requests`)."""
    server = BackgroundServer(model, host, port, max_queue, model_name, log_requests)
    try:
        server.serve_forever()
    finally:
        server.server_close()
