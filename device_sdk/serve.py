"""A local, OpenAI-style completion service over one ElasticModel (standard library only).

    POST /v1/completions {"prompt": "...", "max_tokens": 32, "stream": false,
                          "slo": {"ttft_ms": 200, "tpot_ms": 40}}   # or {"ttft": 0.5, "tpot": 0.8} as fractions
    GET  /v1/models, GET /health

Several apps share one model: one request runs at a time (a single worker thread owns the
model, so level switches never race a generation); up to `max_queue` more wait, and the
rest get 503 at once. Streaming answers are server-sent events, ending with `data: [DONE]`.
The response's extra `elastify` object reports the chosen level and prompt ratio, TTFT, TPOT and `slo_met`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from device_sdk.latency import SLO

_DONE = object()


class Job:
    def __init__(self, request: dict):
        self.request = request
        self.events: queue.Queue = queue.Queue()  # text pieces, then a Generation or an exception, then _DONE


class CompletionService:
    """The model, its single worker thread and the bounded queue in front of it."""

    def __init__(self, model, model_name: str, max_queue: int = 4):
        self.model = model
        self.model_name = model_name
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
                stream = self.model.generate(
                    request["prompt"], slo=request["slo"], max_new_tokens=request["max_tokens"], stream=True
                )
                for piece in stream:
                    job.events.put(piece)
                job.events.put(stream.result)
            except Exception as err:  # reported to the client; the worker keeps serving
                job.events.put(err)
            finally:
                job.events.put(_DONE)


def parse_request(body: bytes) -> dict:
    """Validate a completion request; raises ValueError with a message for the client."""
    try:
        data = json.loads(body or b"{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"body is not JSON: {err}") from None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    max_tokens = data.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
        raise ValueError("max_tokens must be an integer in 1..4096")
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": bool(data.get("stream")), "slo": parse_slo(data.get("slo"))}


def parse_slo(value) -> SLO | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("slo must be an object")
    numbers = {k: v for k, v in value.items() if k in ("ttft_ms", "tpot_ms", "ttft", "tpot")}
    if set(value) - set(numbers) or any(not isinstance(v, int | float) or v <= 0 for v in numbers.values()):
        raise ValueError("slo takes positive ttft_ms/tpot_ms (milliseconds) or ttft/tpot (fractions of full)")
    if "ttft" in numbers or "tpot" in numbers:
        if "ttft_ms" in numbers or "tpot_ms" in numbers:
            raise ValueError("slo is either absolute (ttft_ms, tpot_ms) or fractional (ttft, tpot), not both")
        return SLO.fraction(numbers.get("ttft"), numbers.get("tpot"))
    return SLO(numbers.get("ttft_ms"), numbers.get("tpot_ms"))


def make_handler(service: CompletionService):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # quiet by default; the CLI prints one line per request
            pass

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok", "level": service.model.level})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": service.model_name, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path != "/v1/completions":
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                request = parse_request(body)
            except ValueError as err:
                self._json(400, {"error": {"message": str(err), "type": "invalid_request_error"}})
                return
            job = service.submit(request)
            if job is None:
                self._json(503, {"error": {"message": "the model is busy and its queue is full; retry later"}})
                return
            ident = f"cmpl-{uuid.uuid4().hex[:24]}"
            if request["stream"]:
                self._stream(job, ident)
            else:
                self._complete(job, ident)

        def _complete(self, job: Job, ident: str):
            while (event := job.events.get()) is not _DONE:
                if isinstance(event, Exception):
                    self._json(500, {"error": {"message": str(event)}})
                    return
                if not isinstance(event, str):
                    result = event
            self._json(200, completion_body(ident, service.model_name, result.text, result))

        def _stream(self, job: Job, ident: str):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            while (event := job.events.get()) is not _DONE:
                if isinstance(event, Exception):
                    payload = {"error": {"message": str(event)}}
                elif isinstance(event, str):
                    payload = completion_body(ident, service.model_name, event, None)
                else:
                    payload = completion_body(ident, service.model_name, "", event)
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _json(self, status: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def completion_body(ident: str, model_name: str, text: str, result) -> dict:
    """One OpenAI text_completion object; the final one carries usage and the `elastify` report."""
    body = {
        "id": ident,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "text": text, "finish_reason": None}],
    }
    if result is not None:
        body["choices"][0]["finish_reason"] = result.finish_reason
        body["usage"] = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_tokens + len(result.tokens),
        }
        body["elastify"] = {
            "level": result.level,
            "prompt_ratio": result.decision.prompt_ratio if result.decision else 1.0,
            "ttft_ms": round(result.ttft_ms, 3),
            "tpot_ms": None if result.tpot_ms is None else round(result.tpot_ms, 3),
            "slo_met": result.slo_met,
        }
    return body


def make_server(model, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 4, model_name: str | None = None):
    """A ready ThreadingHTTPServer (call serve_forever); port 0 picks a free one."""
    service = CompletionService(model, model_name or model.manifest.name, max_queue)
    server = ThreadingHTTPServer((host, port), make_handler(service))
    server.service = service
    return server
