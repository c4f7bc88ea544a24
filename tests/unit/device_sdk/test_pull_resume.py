"""pull() over HTTP in another process: killed with -9 it resumes from what it saved; Ctrl-C stops it at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from device_sdk.format import WEIGHTS
from device_sdk.registry import PROGRESS, pull, verify_local
from tests.support.sdk_packages import public_bytes, publish, random_package, signing_key

KEY = signing_key()
ROOT = Path(__file__).resolve().parents[3]
WEIGHTS_URL = f"/packages/tiny/1.0.0/{WEIGHTS}"
# The pull in the child process: small blocks and frequent progress saves, so a kill lands mid-file.
CHILD = """
import sys
from device_sdk import registry
registry.CHUNK, registry.PROGRESS_SECONDS = 8192, 0.05
try:
    registry.pull("tiny", "1.0.0", registry=sys.argv[1], public_key=bytes.fromhex(sys.argv[2]),
                  cache_dir=sys.argv[3], workers=1)
except KeyboardInterrupt as stopped:
    print(f"{type(stopped).__name__}: {stopped}", file=sys.stderr)
    sys.exit(130)
"""


class SlowRangeHandler(SimpleHTTPRequestHandler):
    """Static files with single-range GETs, sent in 8 KiB pieces `delay` seconds apart; logs what it sent."""

    delay = 0.0
    sent: list[tuple[str, str | None, int]] = []  # (path, Range header, body bytes sent)

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        header = self.headers.get("Range")
        start, end = 0, len(data)
        if header:
            first, last = header.removeprefix("bytes=").split("-")
            start, end = int(first), min(len(data), int(last) + 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        written = 0
        try:
            for offset in range(start, end, 8192):
                self.wfile.write(data[offset:min(end, offset + 8192)])
                written += min(end, offset + 8192) - offset
                time.sleep(self.delay)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-body
        finally:
            self.sent.append((self.path, header, written))


@pytest.fixture(scope="module")
def slow_registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow-registry")
    publish(random_package("llama_mha", tmp_path_factory.mktemp("slow-built") / "package", KEY), root)
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SlowRangeHandler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()


def start_child(url: str, cache: Path) -> subprocess.Popen:
    # A terminal's process: SIGINT at its default, so Python raises KeyboardInterrupt even when this
    # suite was started in the background of a shell, whose jobs inherit SIGINT ignored.
    return subprocess.Popen([sys.executable, "-c", CHILD, url, public_bytes(KEY).hex(), str(cache)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def weights_kept(cache: Path) -> int:
    """How far the child's saved progress says the weights got (0 before its first save)."""
    record = cache / "tiny" / ".staging-1.0.0" / PROGRESS
    try:
        progress = json.loads(record.read_text())
    except (OSError, ValueError):
        return 0
    return next((done for key, done in progress.items() if key.startswith(f"{WEIGHTS}@")), 0)


def wait_for_progress(child: subprocess.Popen, cache: Path, at_least: int) -> int:
    deadline = time.monotonic() + 60
    while (kept := weights_kept(cache)) < at_least:
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child pull saved no progress"
        time.sleep(0.02)
    return kept


def test_a_pull_killed_with_sigkill_resumes_and_fetches_only_the_rest(slow_registry, tmp_path):
    url, root = slow_registry
    size = (root / "packages/tiny/1.0.0" / WEIGHTS).stat().st_size
    cache = tmp_path / "cache"
    SlowRangeHandler.delay, SlowRangeHandler.sent = 0.02, []
    child = start_child(url, cache)
    try:
        wait_for_progress(child, cache, size // 4)
    finally:
        child.kill()  # SIGKILL: no finally block, no atexit, only what was saved while it ran
        child.communicate()
    kept = weights_kept(cache)
    assert size // 4 <= kept < size and not (cache / "tiny" / "1.0.0").exists()
    deadline = time.monotonic() + 10
    while not any(sent_path == WEIGHTS_URL for sent_path, _, _ in SlowRangeHandler.sent):  # the server saw it go
        assert time.monotonic() < deadline
        time.sleep(0.02)

    SlowRangeHandler.delay, SlowRangeHandler.sent = 0.0, []
    path = pull("tiny", "1.0.0", registry=url, public_key=public_bytes(KEY), cache_dir=cache)
    resumed = [(header, written) for sent_path, header, written in SlowRangeHandler.sent if sent_path == WEIGHTS_URL]
    assert resumed == [(f"bytes={kept}-{size - 1}", size - kept)]  # only the rest, from where it was saved
    verify_local(path, public_bytes(KEY))  # and the kept bytes were checked with the rest: the whole file hashes


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT")
def test_ctrl_c_stops_a_pull_at_once_with_one_line_and_keeps_what_arrived(slow_registry, tmp_path):
    url, root = slow_registry
    cache = tmp_path / "cache"
    SlowRangeHandler.delay = 0.8  # the whole file would take over a minute
    child = start_child(url, cache)
    try:
        wait_for_progress(child, cache, 1)
        child.send_signal(signal.SIGINT)
        # Not held by a download thread still waiting on the network; the bound leaves room for a loaded CI
        # box (it missed 5 s once there, beside a compiler) and is still far below the download's minute.
        _, err = child.communicate(timeout=15)
    finally:
        child.kill()
    lines = err.strip().splitlines()
    assert child.returncode == 130 and len(lines) == 1, err
    assert lines[0].startswith("PullInterrupted: pull interrupted: ") and lines[0].endswith("pull again to resume")
    assert weights_kept(cache) > 0
