"""ElastifyClient: the Python client of the Elastify REST API (/v1), standard library only.

The `elastify` CLI and the device SDK's `pull` both use it. Errors come back as
`ElastifyAPIError(status, title, detail)` parsed from the server's problem+json body. The
bearer token comes from the argument or ELASTIFY_TOKEN and is never printed: it is kept out
of `repr`, error messages and logs.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_SERVER = "http://127.0.0.1:8000"
CHUNK = 1 << 20


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


@dataclass(frozen=True)
class ServerEvent:
    """One Server-Sent Event: `event` is its type ("message" when the server gave none)."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # Redirects are followed by ElastifyClient itself, so the bearer token never leaves the API
    # host (a presigned S3 URL rejects a second credential anyway).
    def redirect_request(self, *args, **kwargs):
        return None


class ElastifyClient:
    """One object per server and token. `base_url` is the server root (a trailing /v1 is accepted)."""

    def __init__(self, base_url: str | None = None, token: str | None = None, timeout: float = 30.0):
        base = (base_url or os.environ.get("ELASTIFY_SERVER") or DEFAULT_SERVER).rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"the server URL must start with http:// or https://, not {base!r}")
        self.base_url = base.removesuffix("/v1")
        self._token = token if token is not None else os.environ.get("ELASTIFY_TOKEN")
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_NoRedirect)

    def __repr__(self) -> str:
        return f"ElastifyClient({self.base_url!r}, token={'set' if self._token else 'none'})"

    # ------------------------------------------------------------------ transport

    def url(self, path: str, params: dict[str, Any] | None = None) -> str:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self.base_url + path + (f"?{urllib.parse.urlencode(query, doseq=True)}" if query else "")

    def request(self, method: str, path: str, *, params: dict | None = None, body: Any = None,
                headers: dict[str, str] | None = None, timeout: float | None = None):
        """Send one request; return the open response (2xx) or raise ElastifyAPIError.

        `path` starts with "/" and is relative to the server root; a redirect to another host
        (a presigned object-store URL) is followed without the Authorization header.
        """
        url = self.url(path, params)
        data = None
        sent = dict(headers or {})
        if body is not None:
            if isinstance(body, bytes | str):
                data = body.encode() if isinstance(body, str) else body
            else:
                data = json.dumps(body).encode()
                sent.setdefault("Content-Type", "application/json")
        for _hop in range(5):
            request = urllib.request.Request(url, data=data, method=method, headers=sent)
            if self._token and _same_origin(url, self.base_url):
                request.add_unredirected_header("Authorization", f"Bearer {self._token}")
            try:
                return self._opener.open(request, timeout=timeout or self.timeout)
            except urllib.error.HTTPError as err:
                if err.code in (301, 302, 303, 307, 308) and err.headers.get("Location"):
                    url = urllib.parse.urljoin(url, err.headers["Location"])
                    if err.code == 303:
                        method, data = "GET", None
                    err.close()
                    continue
                raise _api_error(err) from None
            except urllib.error.URLError as err:
                raise ElastifyAPIError(0, f"cannot reach the server at {_origin(url)}", reason(err.reason)) from None
            except (TimeoutError, ConnectionError, http.client.HTTPException) as err:
                raise ElastifyAPIError(0, f"no answer from the server at {_origin(url)}", reason(err)) from None
        raise ElastifyAPIError(0, "too many redirects", _origin(url))

    def _json(self, method: str, path: str, **kwargs) -> Any:
        with self.request(method, path, headers={"Accept": "application/json"}, **kwargs) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    # ------------------------------------------------------------------ health

    def health(self) -> dict:
        """GET /healthz: the process answers."""
        return self._json("GET", "/healthz")

    def ready(self) -> dict:
        """GET /readyz: the database, the store and Ray answer."""
        return self._json("GET", "/readyz")

    # ------------------------------------------------------------------ builds

    def submit(self, spec: dict | str, idempotency_key: str | None = None) -> dict:
        """POST /v1/builds. `spec` is a BuildSpec as a dict or JSON text (the CLI reads YAML files).

        The same `idempotency_key` with the same spec returns the first build; with another spec, 409.
        """
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as err:
                raise ValueError(f"the spec text is not JSON ({err}); load YAML into a dict first") from None
        headers = {"Accept": "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        with self.request("POST", "/v1/builds", body=spec, headers=headers) as response:
            return json.loads(response.read())

    def builds(self, *, status: str | list[str] | None = None, name: str | None = None, owner: str | None = None,
               limit: int | None = None, cursor: str | None = None) -> dict:
        """One page of GET /v1/builds, newest first: {"items": [...], "next_cursor": str | None}."""
        params = {"status": status, "name": name, "owner": owner, "limit": limit, "cursor": cursor}
        return self._json("GET", "/v1/builds", params=params)

    def iter_builds(self, **filters) -> Iterator[dict]:
        """Every build that matches, following the cursor across pages."""
        cursor = None
        while True:
            page = self.builds(**filters, cursor=cursor)
            yield from page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def build(self, build_id: str) -> dict:
        return self._json("GET", f"/v1/builds/{_segment(build_id)}")

    def cancel(self, build_id: str) -> dict:
        return self._json("POST", f"/v1/builds/{_segment(build_id)}/cancel")

    def retry(self, build_id: str) -> dict:
        """Re-run a build's failed stages; finished ones are reused."""
        return self._json("POST", f"/v1/builds/{_segment(build_id)}/retry")

    def logs(self, build_id: str, after: int | None = None, reconnects: int = 5) -> Iterator[ServerEvent]:
        """Follow the build's events (Server-Sent Events) until it ends, from event id `after`.

        Each event's `data` is a LogEvent (`event.json()`); the last one is `end` with the build's
        status. A dropped or silent stream is resumed with Last-Event-ID, so no event is seen twice;
        a quiet build (a long stage) is not an error, `reconnects` failed connections in a row are.
        """
        last_id = None if after is None else str(after)
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            try:
                with self.request("GET", f"/v1/builds/{_segment(build_id)}/logs", headers=headers,
                                  timeout=max(self.timeout, 60.0)) as response:
                    failures = 0
                    for event in _parse_sse(response):
                        if event.id is not None:
                            last_id = event.id
                        yield event
                        if event.event == "end":
                            return
            except TimeoutError:
                continue  # nothing for a while: ask again from the last event seen
            except (ConnectionError, http.client.HTTPException, ElastifyAPIError) as err:
                if isinstance(err, ElastifyAPIError) and err.status != 0:
                    raise
                failures += 1
                if failures > reconnects:
                    raise ElastifyAPIError(0, "log stream interrupted", str(err)) from None
                time.sleep(min(5.0, 0.2 * 2**failures))

    def logs_text(self, build_id: str) -> str:
        """The build's log so far, as plain text."""
        with self.request("GET", f"/v1/builds/{_segment(build_id)}/logs", headers={"Accept": "text/plain"}) as response:
            return response.read().decode()

    # ------------------------------------------------------------------ packages

    def packages(self) -> list[dict]:
        """GET /v1/packages: every package of the caller's tenant, with its aliases."""
        return self._json("GET", "/v1/packages")["items"]

    def versions(self, name: str) -> list[dict]:
        """GET /v1/packages/{name}/versions: each version with the aliases that point at it."""
        return self._json("GET", f"/v1/packages/{_segment(name)}/versions")["items"]

    def manifest(self, name: str, version: str) -> dict:
        """GET /v1/packages/{name}/{version}/manifest (`version` may be an alias)."""
        return self._json("GET", f"/v1/packages/{_segment(name)}/{_segment(version)}/manifest")

    def manifest_bytes(self, name: str, version: str) -> bytes:
        """The signed manifest.json byte for byte, as a package file (verify it before trusting it)."""
        with self.open_file(name, version, "manifest.json") as response:
            return response.read()

    def open_file(self, name: str, version: str, path: str, byte_range: tuple[int, int] | None = None):
        """An open response for one package file (bytes [start, end) with `byte_range`).

        The status is 206 when the server honoured the range, 200 when it sent the whole file.
        """
        headers = {}
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        quoted = "/".join(_segment(part) for part in path.split("/"))
        return self.request("GET", f"/v1/packages/{_segment(name)}/{_segment(version)}/files/{quoted}",
                            headers=headers, timeout=max(self.timeout, 60.0))

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
        quoted = "/".join(_segment(p) for p in path.split("/"))
        try:
            response = self.request("GET", f"/v1/packages/{_segment(name)}/{_segment(version)}/files/{quoted}",
                                    headers=headers, timeout=max(self.timeout, 60.0))
        except ElastifyAPIError as err:
            if err.status != 416:  # 416: the part file is already whole
                raise
            os.replace(part, target)
            return target
        with response, open(part, "ab") as sink:
            total = _total_size(response, have)
            if response.status != 206:  # the server sent the whole file: start over
                sink.truncate(0)
                have = 0
            while block := response.read(CHUNK):
                sink.write(block)
                have += len(block)
                if on_progress is not None:
                    on_progress(have, total)
        if total is not None and have != total:
            raise ElastifyAPIError(0, "download incomplete", f"{path}: {have} of {total} bytes; run again to resume")
        os.replace(part, target)
        return target

    def set_alias(self, name: str, alias: str, version: str) -> dict:
        """PUT /v1/packages/{name}/aliases/{alias}: point the alias at `version`."""
        return self._json("PUT", f"/v1/packages/{_segment(name)}/aliases/{_segment(alias)}", body={"version": version})

    # ------------------------------------------------------------------ usage and keys

    def usage(self, **filters) -> dict:
        """GET /v1/usage: GPU- and CPU-hours by tenant, build, stage type and day; filters as query params."""
        return self._json("GET", "/v1/usage", params=filters)

    def signing_key(self) -> str:
        """The base64 Ed25519 public key that signs this server's manifests."""
        answer = self._json("GET", "/v1/keys/signing")
        return answer["public_key"] if isinstance(answer, dict) else answer


# ---------------------------------------------------------------------- helpers


def _segment(value: str) -> str:
    """One URL path segment; '/', '..' and control characters are refused here, not sent."""
    if not value or value in (".", "..") or any(c == "/" or ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"invalid name in a URL path: {value!r}")
    return urllib.parse.quote(value, safe="")


def reason(err) -> str:
    """Why a connection failed, in words: "Connection refused", not "[Errno 111] Connection refused"."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err) or type(err).__name__


def _origin(url: str) -> str:
    """scheme://host:port of a URL: what error messages show (a presigned query string is a credential)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _same_origin(url: str, base: str) -> bool:
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(base)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


def _total_size(response, offset: int) -> int | None:
    """The whole file's size from Content-Range (206) or Content-Length (200)."""
    content_range = response.headers.get("Content-Range", "")
    if response.status == 206 and "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) if length is not None else None


def _api_error(err: urllib.error.HTTPError) -> ElastifyAPIError:
    try:
        raw = err.read()
    except Exception:  # noqa: BLE001 (the status alone still says what happened)
        raw = b""
    finally:
        err.close()
    problem = None
    try:
        problem = json.loads(raw) if raw else None
    except ValueError:
        pass
    if isinstance(problem, dict):
        detail = problem.get("detail")
        if not isinstance(detail, str) and detail is not None:
            detail = json.dumps(detail)
        return ElastifyAPIError(err.code, str(problem.get("title") or err.reason), detail, problem)
    return ElastifyAPIError(err.code, str(err.reason), raw.decode(errors="replace")[:500] or None)


def _parse_sse(response) -> Iterator[ServerEvent]:
    """Events from a text/event-stream body (WHATWG rules: blank line ends an event, ':' is a comment)."""
    kind, data, event_id = "", [], None
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data or kind:
                yield ServerEvent(kind or "message", "\n".join(data), event_id)
            kind, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            kind = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
    if data:
        yield ServerEvent(kind or "message", "\n".join(data), event_id)
