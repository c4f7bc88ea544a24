"""ElastifyClient: the Python client of the Elastify REST API (/v1), on httpx.

The `elastify` CLI and the device SDK's `pull` both use it. Answers come back as small frozen
dataclasses (`Build`, `Page`, `Package`, `Version`, `Usage`, …) that mirror the API's schemas
(api/schemas.py) without importing them: the SDK stands alone. Each keeps the server's JSON in
`raw` (what `--json` prints; fields a newer server adds are kept there). Every list method returns
one `Page` (`items`, `next_cursor`) and has an `iter_*` twin that walks every page.

Errors come back as `ElastifyAPIError(status, title, detail)` parsed from the server's
problem+json body. The bearer token comes from the argument or ELASTIFY_TOKEN and is never
printed: it is kept out of `repr`, error messages and logs, and sent only to the API's own origin
(a redirect to a presigned object-store URL is followed without it). Build logs are Server-Sent
Events read with httpx-sse; `wait()` follows them until the build ends.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import httpx_sse

DEFAULT_SERVER = "http://127.0.0.1:8000"
CHUNK = 1 << 20
TERMINAL = ("succeeded", "failed", "cancelled")  # a build in one of these has ended
CONNECT_TIMEOUT = 10.0  # seconds; the read timeout is the client's `timeout`
CONNECT_RETRIES = 2  # httpx's own retries of a connection that could not be opened (nothing was sent)
STREAM_TIMEOUT = 60.0  # seconds of silence before a log stream is reopened (the server sends a keepalive every 15 s)
MAX_REDIRECTS = 5


class ElastifyAPIError(Exception):
    """A 4xx/5xx answer from the API, with the problem+json fields; or no answer (status 0, never shown)."""

    def __init__(self, status: int, title: str, detail: str | None = None, problem: dict | None = None):
        self.status = status
        self.title = title
        self.detail = detail
        self.problem = problem or {}
        super().__init__((f"{status} {title}" if status else title) + (f": {detail}" if detail else ""))

    @property
    def field_errors(self) -> list[tuple[str, str]]:
        """(field, message) for each entry of the problem's `errors` (a 422 lists every invalid field)."""
        entries = self.problem.get("errors")
        return [(str(e.get("field", "")), str(e.get("message", ""))) for e in entries if isinstance(e, dict)] \
            if isinstance(entries, list) else []

    def describe(self) -> str:
        """The message, then one indented line per field error."""
        return str(self) + "".join(f"\n  {field}: {message}" for field, message in self.field_errors)


class BuildTimeout(TimeoutError):
    """`wait()` gave up before the build ended; the build goes on running on the server (`build`: as last seen)."""

    def __init__(self, build: Build, timeout: float):
        self.build = build
        self.timeout = timeout
        super().__init__(f"build {build.id} has not ended after {timeout:g} s: {build.status}, "
                         f"{build.stages_done}/{build.stages_total} stages done (it keeps running; wait again "
                         "or cancel it)")


# ---------------------------------------------------------------------- answers

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list, newest first where the list has an order; pass `next_cursor` back for the next."""

    items: tuple[T, ...]
    next_cursor: str | None = None

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class StageProgress:
    done: int
    total: int
    message: str = ""


@dataclass(frozen=True)
class Attempt:
    number: int
    status: str
    worker: str
    started_at: datetime
    wall_seconds: float
    cpu_seconds: float
    gpu_seconds: float
    exit: str | None = None  # ok, error, crashed, lease_expired, cancelled, interrupted
    error: str | None = None
    ended_at: datetime | None = None


@dataclass(frozen=True)
class Stage:
    key: str  # the DAG node, e.g. `profile` or `recover[0.5]`
    type: str
    status: str
    cache_hit: bool
    gpu_seconds: float
    cpu_seconds: float
    attempts: tuple[Attempt, ...] = ()
    shard: str | None = None
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    seconds: float | None = None
    progress: StageProgress | None = None  # the latest progress report of a running stage


@dataclass(frozen=True)
class PackageRef:
    name: str
    version: str


@dataclass(frozen=True, kw_only=True)
class BuildSummary:
    """A build as GET /v1/builds lists it."""

    id: str
    tenant: str
    status: str  # queued, running, succeeded, failed or cancelled
    name: str  # the package name the build publishes
    version: str
    created_at: datetime
    stages_total: int
    stages_done: int
    progress: float  # stages_done / stages_total
    cache_hits: int
    gpu_seconds: float
    cpu_seconds: float
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True, kw_only=True)
class Build(BuildSummary):
    """One build in full: its spec and every stage with its attempts."""

    spec: dict
    cancel_requested: bool
    stages: tuple[Stage, ...]
    idempotency_key: str | None = None
    package: PackageRef | None = None  # what it published, once it succeeded


BuildPage = Page[BuildSummary]


@dataclass(frozen=True, kw_only=True)
class Package:
    name: str
    tenant: str
    versions: int
    latest_version: str  # the most recently published version
    aliases: dict[str, str]  # alias → version
    updated_at: datetime
    raw: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class Version:
    name: str
    version: str
    build_id: str
    tenant: str
    manifest_sha256: str
    created_at: datetime
    aliases: tuple[str, ...]  # the aliases that point at this version
    raw: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class Alias:
    name: str
    alias: str
    version: str
    updated_at: datetime
    raw: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class UsageRow:
    """Compute of the attempts in one group; the fields not grouped by are None."""

    attempts: int
    wall_seconds: float
    cpu_seconds: float
    gpu_seconds: float
    cpu_hours: float
    gpu_hours: float
    tenant: str | None = None
    build: str | None = None
    stage_type: str | None = None
    day: str | None = None  # UTC day of the attempt's start, YYYY-MM-DD


@dataclass(frozen=True, kw_only=True)
class Usage:
    group_by: tuple[str, ...]
    rows: tuple[UsageRow, ...]
    total_gpu_hours: float
    total_cpu_hours: float
    raw: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class LogEvent:
    """One of a build's events: a state change, a stage's log line or a progress report (`data`: done/total)."""

    id: int
    time: datetime
    kind: str  # state, log or progress
    level: str
    message: str
    stage: str | None = None
    attempt: int | None = None
    data: dict | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class ServerEvent:
    """One Server-Sent Event: `event` is its type ("message" when the server gave none)."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)

    def log_event(self) -> LogEvent:
        """The LogEvent a `state`, `log` or `progress` event carries (not the final `end`)."""
        return _answer(_log_event, self.json(), "log event")


def _time(value: Any) -> datetime | None:
    """An RFC 3339 time as the API writes it (`…Z`; Python 3.10's fromisoformat wants +00:00)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"a time must be a string, not {value!r}")
    return datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)


def _make(kind, data: Any, **converted):
    """`kind` from a JSON object: the fields it declares (others stay in `raw`), `converted` ones replaced."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(kind)}
    values = {name: data[name] for name in names if name in data}
    values.update(converted)
    if "raw" in names:
        values["raw"] = data
    return kind(**values)


def _answer(parse: Callable[[Any], T], data: Any, what: str) -> T:
    """parse(data), or a clear error naming what the server's answer was supposed to be."""
    try:
        return parse(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ElastifyAPIError(0, f"the server's answer is not a {what}", f"{type(err).__name__}: {err}") from None


def _stage(data: dict) -> Stage:
    attempts = tuple(_make(Attempt, a, started_at=_time(a["started_at"]), ended_at=_time(a.get("ended_at")))
                     for a in data.get("attempts") or ())
    progress = data.get("progress")
    return _make(Stage, data, attempts=attempts, started_at=_time(data.get("started_at")),
                 finished_at=_time(data.get("finished_at")),
                 progress=None if progress is None else _make(StageProgress, progress))


def _summary_times(data: dict) -> dict[str, datetime | None]:
    return {"created_at": _time(data["created_at"]), "started_at": _time(data.get("started_at")),
            "finished_at": _time(data.get("finished_at"))}


def _build_summary(data: dict) -> BuildSummary:
    return _make(BuildSummary, data, **_summary_times(data))


def _build(data: dict) -> Build:
    package = data.get("package")
    return _make(Build, data, **_summary_times(data), stages=tuple(_stage(s) for s in data["stages"]),
                 package=None if package is None else _make(PackageRef, package))


def _package(data: dict) -> Package:
    return _make(Package, data, aliases=dict(data["aliases"]), updated_at=_time(data["updated_at"]))


def _version(data: dict) -> Version:
    return _make(Version, data, aliases=tuple(data["aliases"]), created_at=_time(data["created_at"]))


def _alias(data: dict) -> Alias:
    return _make(Alias, data, updated_at=_time(data["updated_at"]))


def _usage(data: dict) -> Usage:
    return _make(Usage, data, group_by=tuple(data["group_by"]),
                 rows=tuple(_make(UsageRow, row) for row in data["rows"]))


def _log_event(data: dict) -> LogEvent:
    return _make(LogEvent, data, time=_time(data["time"]))


def _page(parse: Callable[[dict], T]) -> Callable[[Any], Page[T]]:
    def parse_page(data: Any) -> Page[T]:
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        return Page(tuple(parse(item) for item in data["items"]), data.get("next_cursor"))

    return parse_page


# ---------------------------------------------------------------------- the client


class ElastifyClient:
    """One object per server and token. `base_url` is the server root (a trailing /v1 is accepted).

    `http` is the one httpx.Client every request goes through (thread-safe: pull's download
    threads share it); the token is added per request, to the API's origin only, so it is in
    neither `http.headers` nor a redirected request. `timeout` is the read timeout in seconds.
    """

    def __init__(self, base_url: str | None = None, token: str | None = None, timeout: float = 30.0, *,
                 transport: httpx.BaseTransport | None = None):
        base = (base_url or os.environ.get("ELASTIFY_SERVER") or DEFAULT_SERVER).rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"the server URL must start with http:// or https://, not {base!r}")
        self.base_url = base.removesuffix("/v1")
        self._token = token if token is not None else os.environ.get("ELASTIFY_TOKEN")
        self.timeout = timeout
        self.http = httpx.Client(timeout=_timeout(timeout), follow_redirects=False,
                                 transport=transport or httpx.HTTPTransport(retries=CONNECT_RETRIES))

    def __repr__(self) -> str:
        return f"ElastifyClient({self.base_url!r}, token={'set' if self._token else 'none'})"

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ElastifyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def url(self, path: str, params: dict[str, Any] | None = None) -> str:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self.base_url + path + (f"?{urllib.parse.urlencode(query, doseq=True)}" if query else "")

    def _send(self, method: str, path: str, *, params: dict | None = None, body: Any = None,
              headers: dict[str, str] | None = None, timeout: float | None = None) -> httpx.Response:
        """Send one request and return its streamed response (2xx), or raise ElastifyAPIError.

        Redirects are followed here, not by httpx, so that the token goes to the API's origin
        only: a presigned object-store URL gets the request without it (and would refuse a
        second credential anyway).
        """
        url = self.url(path, params)
        content, sent = _encode(body, headers)
        for _hop in range(MAX_REDIRECTS):
            request = self.http.build_request(method, url, content=content, headers=sent,
                                              timeout=_timeout(timeout or self.timeout))
            if self._token and _same_origin(url, self.base_url):
                request.headers["Authorization"] = f"Bearer {self._token}"
            try:
                response = self.http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                raise ElastifyAPIError(0, f"cannot reach the server at {_origin(url)}", reason(err)) from None
            except httpx.HTTPError as err:
                raise ElastifyAPIError(0, f"no answer from the server at {_origin(url)}", reason(err)) from None
            if response.is_redirect:
                response.close()
                url = str(response.url.join(response.headers["Location"]))
                if response.status_code == 303 or (response.status_code in (301, 302) and method not in ("GET", "HEAD")):
                    method, content = "GET", None
                continue
            if response.is_success:
                return response
            raise _api_error(response)
        raise ElastifyAPIError(0, "too many redirects", _origin(url))

    def request(self, method: str, path: str, *, params: dict | None = None, body: Any = None,
                headers: dict[str, str] | None = None, timeout: float | None = None) -> httpx.Response:
        """Send one request; return the whole response (2xx, body read) or raise ElastifyAPIError.

        `path` starts with "/" and is relative to the server root; `body` is bytes, text or
        JSON-serialisable.
        """
        response = self._send(method, path, params=params, body=body, headers=headers, timeout=timeout)
        try:
            response.read()
        except httpx.HTTPError as err:
            raise ElastifyAPIError(0, f"the answer from {_origin(str(response.url))} was cut short", reason(err)) from None
        finally:
            response.close()
        return response

    @contextmanager
    def stream(self, method: str, path: str, **kwargs) -> Iterator[httpx.Response]:
        """request() whose body is read as it arrives (`iter_bytes`); the connection is released on exit."""
        response = self._send(method, path, **kwargs)
        try:
            yield response
        finally:
            response.close()

    def _json(self, method: str, path: str, *, headers: dict[str, str] | None = None, **kwargs) -> Any:
        response = self.request(method, path, headers={"Accept": "application/json", **(headers or {})}, **kwargs)
        try:
            return response.json() if response.content else None
        except ValueError:
            raise ElastifyAPIError(0, f"the server at {self.base_url} did not answer with JSON",
                                   response.headers.get("Content-Type")) from None

    # ------------------------------------------------------------------ health

    def health(self) -> dict:
        """GET /healthz: the process answers."""
        return self._json("GET", "/healthz")

    def ready(self) -> dict:
        """GET /readyz: the database, the store and Ray answer."""
        return self._json("GET", "/readyz")

    # ------------------------------------------------------------------ builds

    def submit(self, spec: dict | str, idempotency_key: str | None = None) -> Build:
        """POST /v1/builds. `spec` is a BuildSpec as a dict or JSON text (the CLI reads YAML files).

        The same `idempotency_key` with the same spec returns the first build; with another spec, 409.
        """
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as err:
                raise ValueError(f"the spec text is not JSON ({err}); load YAML into a dict first") from None
        headers = {}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        return _answer(_build, self._json("POST", "/v1/builds", body=spec, headers=headers), "build")

    def builds(self, *, status: str | list[str] | None = None, name: str | None = None, owner: str | None = None,
               limit: int | None = None, cursor: str | None = None) -> Page[BuildSummary]:
        """One page of GET /v1/builds, newest first; `cursor` is the previous page's `next_cursor`."""
        params = {"status": status, "name": name, "owner": owner, "limit": limit, "cursor": cursor}
        return _answer(_page(_build_summary), self._json("GET", "/v1/builds", params=params), "page of builds")

    def iter_builds(self, **filters) -> Iterator[BuildSummary]:
        """Every build that matches (builds()'s filters; `limit` is the page size), across pages."""
        return _walk(self.builds, **filters)

    def build(self, build_id: str) -> Build:
        return _answer(_build, self._json("GET", f"/v1/builds/{_segment(build_id)}"), "build")

    def cancel(self, build_id: str) -> Build:
        return _answer(_build, self._json("POST", f"/v1/builds/{_segment(build_id)}/cancel"), "build")

    def retry(self, build_id: str) -> Build:
        """Re-run a build's failed stages; finished ones are reused."""
        return _answer(_build, self._json("POST", f"/v1/builds/{_segment(build_id)}/retry"), "build")

    def logs(self, build_id: str, after: int | None = None, reconnects: int = 5) -> Iterator[ServerEvent]:
        """Follow the build's events (Server-Sent Events) until it ends, from event id `after`.

        Each event's `data` is a LogEvent (`event.log_event()`); the last one is `end` with the
        build's status. A dropped or silent stream is resumed with Last-Event-ID, so no event is
        seen twice; a quiet build (a long stage) is not an error, `reconnects` failed connections
        in a row are.
        """
        return self._events(build_id, after, reconnects, deadline=None)

    def wait(self, build_id: str, timeout: float | None = None,
             on_progress: Callable[[LogEvent], None] | None = None) -> Build:
        """Follow the build's events until it ends and return it as it ended (any final status).

        `on_progress(event)` is called with each event as it arrives (state changes, stage log
        lines and progress reports: `event.kind`), from the first one on. Past `timeout`
        seconds BuildTimeout is raised (at worst one server keepalive, 15 s, late); the build
        itself is left running.
        """
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for event in self._events(build_id, None, 5, deadline):
                if event.event == "end":
                    break
                if on_progress is not None:
                    on_progress(event.log_event())
        except _Expired:
            raise BuildTimeout(self.build(build_id), timeout) from None
        return self.build(build_id)

    def _events(self, build_id: str, after: int | None, reconnects: int, deadline: float | None) -> Iterator[ServerEvent]:
        """logs(), and wait()'s stream: with a `deadline` (time.monotonic()), _Expired once it passes.

        The read timeout of a stream opened for wait() is the time left, so a silent stream ends at
        the deadline; one that carries the server's keepalives is checked at each (every 15 s).
        """
        last_id = None if after is None else str(after)
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            read = max(self.timeout, STREAM_TIMEOUT)
            if deadline is not None:
                read = min(read, max(_left(deadline), 0.01))
            seen = False
            try:
                with self.stream("GET", f"/v1/builds/{_segment(build_id)}/logs", headers=headers,
                                 timeout=read) as response:
                    for sse in httpx_sse.EventSource(_UntilDeadline(response, deadline)).iter_sse():
                        seen, failures = True, 0
                        event = ServerEvent(sse.event, sse.data, sse.id or None)
                        if event.id is not None:
                            last_id = event.id
                        yield event
                        if event.event == "end":
                            return
                error = "the server closed the log stream without an event"
            except httpx.ReadTimeout:
                seen = True  # nothing for a while is not a failure: ask again from the last event seen
            except httpx_sse.SSEError as err:
                raise ElastifyAPIError(0, "the server did not answer with an event stream", str(err)) from None
            except (httpx.TransportError, ElastifyAPIError) as err:
                if isinstance(err, ElastifyAPIError) and err.status != 0:
                    raise
                error = reason(err) if isinstance(err, httpx.TransportError) else str(err)
            if deadline is not None and _left(deadline) <= 0:
                raise _Expired
            if seen:
                continue  # a stream that carried events was closed, or went quiet: resume after the last one
            failures += 1
            if failures > reconnects:
                raise ElastifyAPIError(0, "log stream interrupted", error)
            pause = min(5.0, 0.2 * 2**failures)
            if deadline is not None:
                pause = min(pause, max(_left(deadline), 0.0))
            time.sleep(pause)

    def logs_text(self, build_id: str) -> str:
        """The build's log so far, as plain text."""
        return self.request("GET", f"/v1/builds/{_segment(build_id)}/logs", headers={"Accept": "text/plain"}).text

    # ------------------------------------------------------------------ packages

    def packages(self, cursor: str | None = None) -> Page[Package]:
        """GET /v1/packages: the caller's tenant's packages with their aliases (the server answers in one page)."""
        return _answer(_page(_package), self._json("GET", "/v1/packages", params={"cursor": cursor}),
                       "page of packages")

    def iter_packages(self) -> Iterator[Package]:
        return _walk(self.packages)

    def versions(self, name: str, cursor: str | None = None) -> Page[Version]:
        """GET /v1/packages/{name}/versions: each version with the aliases that point at it (one page)."""
        return _answer(_page(_version), self._json("GET", f"/v1/packages/{_segment(name)}/versions",
                                                   params={"cursor": cursor}), "page of versions")

    def iter_versions(self, name: str) -> Iterator[Version]:
        return _walk(self.versions, name)

    def manifest(self, name: str, version: str) -> dict:
        """GET /v1/packages/{name}/{version}/manifest (`version` may be an alias): the manifest's JSON."""
        return self._json("GET", f"/v1/packages/{_segment(name)}/{_segment(version)}/manifest")

    def manifest_bytes(self, name: str, version: str) -> bytes:
        """The signed manifest.json byte for byte, as a package file (verify it before trusting it)."""
        return self.request("GET", self._file_path(name, version, "manifest.json"), timeout=max(self.timeout, 60.0)).content

    def _file_path(self, name: str, version: str, path: str) -> str:
        quoted = "/".join(_segment(part) for part in path.split("/"))
        return f"/v1/packages/{_segment(name)}/{_segment(version)}/files/{quoted}"

    def open_file(self, name: str, version: str, path: str, byte_range: tuple[int, int] | None = None):
        """A context manager: the streamed response of one package file (bytes [start, end) with `byte_range`).

        The status is 206 when the server honoured the range, 200 when it sent the whole file.
        """
        headers = {}
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        return self.stream("GET", self._file_path(name, version, path), headers=headers,
                           timeout=max(self.timeout, 60.0))

    def download(self, name: str, version: str, path: str, target: str | Path,
                 on_progress: Callable[[int, int | None], None] | None = None) -> Path:
        """Download one package file to `target`; resumes a previous partial download with Range.

        Bytes go to `<target>.part` and are renamed into place once complete, so `target`
        only ever holds a whole file. `on_progress(done, total)` is called per block.
        """
        target = Path(target)
        part = target.with_name(target.name + ".part")
        target.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with self.stream("GET", self._file_path(name, version, path), headers=headers,
                             timeout=max(self.timeout, 60.0)) as response, open(part, "ab") as sink:
                total = _total_size(response, have)
                if response.status_code != 206:  # the server sent the whole file: start over
                    sink.truncate(0)
                    have = 0
                for block in response.iter_bytes(CHUNK):
                    sink.write(block)
                    have += len(block)
                    if on_progress is not None:
                        on_progress(have, total)
        except ElastifyAPIError as err:
            if err.status != 416:  # 416: the part file is already whole
                raise
            os.replace(part, target)
            return target
        except httpx.HTTPError as err:
            raise ElastifyAPIError(0, "download interrupted", f"{path}: {have:,} bytes kept ({reason(err)}); "
                                   "run again to resume") from None
        if total is not None and have != total:
            raise ElastifyAPIError(0, "download incomplete", f"{path}: {have} of {total} bytes; run again to resume")
        os.replace(part, target)
        return target

    def set_alias(self, name: str, alias: str, version: str) -> Alias:
        """PUT /v1/packages/{name}/aliases/{alias}: point the alias at `version`."""
        return _answer(_alias, self._json("PUT", f"/v1/packages/{_segment(name)}/aliases/{_segment(alias)}",
                                          body={"version": version}), "alias")

    # ------------------------------------------------------------------ usage and keys

    def usage(self, **filters) -> Usage:
        """GET /v1/usage: GPU- and CPU-hours by tenant, build, stage type and day; filters as query params."""
        return _answer(_usage, self._json("GET", "/v1/usage", params=filters), "usage report")

    def signing_key(self) -> str:
        """The base64 Ed25519 public key that signs this server's manifests."""
        answer = self._json("GET", "/v1/keys/signing")
        return answer["public_key"] if isinstance(answer, dict) else answer


# ---------------------------------------------------------------------- helpers


class _Expired(Exception):
    """wait()'s deadline passed while following the log (turned into BuildTimeout with the build's state)."""


class _UntilDeadline:
    """A streamed response as httpx-sse reads it (its headers, its text as it arrives), with the deadline
    checked after every chunk: the server's keepalive comments reach no caller as events, so without
    this a quiet stage would hold wait() past its timeout."""

    def __init__(self, response: httpx.Response, deadline: float | None):
        self.response = response
        self.deadline = deadline
        self.headers = response.headers

    def iter_text(self) -> Iterator[str]:
        for text in self.response.iter_text():
            yield text
            if self.deadline is not None and _left(self.deadline) <= 0:
                raise _Expired


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _walk(list_page: Callable[..., Page[T]], *args, **filters) -> Iterator[T]:
    """Every item of a paged list, following `next_cursor` until a page has none."""
    cursor = None
    while True:
        page = list_page(*args, **filters, cursor=cursor)
        yield from page.items
        cursor = page.next_cursor
        if not cursor:
            return


def _timeout(seconds: float) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT))


def _encode(body: Any, headers: dict[str, str] | None) -> tuple[bytes | None, dict[str, str]]:
    sent = dict(headers or {})
    if body is None:
        return None, sent
    if isinstance(body, bytes | str):
        return (body.encode() if isinstance(body, str) else body), sent
    sent.setdefault("Content-Type", "application/json")
    return json.dumps(body).encode(), sent


def _segment(value: str) -> str:
    """One URL path segment; '/', '..' and control characters are refused here, not sent."""
    if not value or value in (".", "..") or any(c == "/" or ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"invalid name in a URL path: {value!r}")
    return urllib.parse.quote(value, safe="")


def reason(err: BaseException | str) -> str:
    """Why a connection failed, in words: "Connection refused", not "[Errno 111] Connection refused".

    httpx wraps the OS's error (httpx.ConnectError from httpcore's from the OSError): the first
    OSError with a reason along the chain of causes gives it."""
    seen = err
    while isinstance(seen, BaseException):
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    if text.startswith("[Errno") and "] " in text:
        text = text.split("] ", 1)[1]
    return text or type(err).__name__


def _origin(url: str) -> str:
    """scheme://host:port of a URL: what error messages show (a presigned query string is a credential)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _same_origin(url: str, base: str) -> bool:
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(base)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


def _total_size(response: httpx.Response, offset: int) -> int | None:
    """The whole file's size from Content-Range (206) or Content-Length (200)."""
    content_range = response.headers.get("Content-Range", "")
    if response.status_code == 206 and "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) if length is not None else None


def _api_error(response: httpx.Response) -> ElastifyAPIError:
    """The problem+json of a 4xx/5xx answer (the response is read and closed)."""
    try:
        raw = response.read()
    except httpx.HTTPError:
        raw = b""  # the status alone still says what happened
    finally:
        response.close()
    status, phrase = response.status_code, response.reason_phrase or "error"
    try:
        problem = json.loads(raw) if raw else None
    except ValueError:
        problem = None
    if isinstance(problem, dict):
        detail = problem.get("detail")
        if not isinstance(detail, str) and detail is not None:
            detail = json.dumps(detail)
        return ElastifyAPIError(status, str(problem.get("title") or phrase), detail, problem)
    return ElastifyAPIError(status, phrase, raw.decode(errors="replace")[:500] or None)
