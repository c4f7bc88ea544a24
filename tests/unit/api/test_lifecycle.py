"""api/lifecycle.py in this process: the stop request a signal sets (from the wakeup-fd thread too), and the
multi-node check's warning; tests/integration/test_operations_signals.py drives `elastify up` and `serve`."""

from __future__ import annotations

import configparser
import os
import signal
import time
from pathlib import Path

import pytest

from api import lifecycle
from api.lifecycle import MultiNodeStoreCheck, StopRequest, multi_node_store_warning


@pytest.fixture
def restore_signals():
    saved = {signum: signal.getsignal(signum) for signum in lifecycle.STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    signal.set_wakeup_fd(-1)


def test_the_first_signal_asks_to_stop_and_a_second_ctrl_c_interrupts(restore_signals):
    stop = StopRequest().install()
    assert not stop.is_set()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.event.wait(5) and stop.signal_name == "SIGTERM"
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C only asks, like SIGTERM
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs here, in the main thread


def test_the_wakeup_thread_sets_the_request_while_the_main_thread_runs_no_python(restore_signals):
    stop = StopRequest().install()
    # As if the main thread were blocked in a C call: the Python handler cannot run, the C-level one still writes
    # the signal's number to the wakeup fd.
    os.write(stop._wakeup, bytes([signal.SIGTERM]))
    assert stop.event.wait(5) and stop.signal_name == "SIGTERM"


def test_a_local_store_on_two_nodes_is_warned_about_and_s3_or_one_node_is_not():
    assert multi_node_store_warning("/srv/elastify/store", 1) is None
    assert multi_node_store_warning("s3://bucket/prefix", 3) is None
    for local in ("/srv/elastify/store", "file:///srv/elastify/store"):
        warning = multi_node_store_warning(local, 2)
        assert "2 nodes" in warning and "ELASTIFY_STORE_URL=s3://" in warning


def test_the_check_catches_a_node_that_joins_later_warns_once_and_never_stops_the_loop(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: now[0])
    nodes = [1]
    asked = []

    def alive():
        asked.append(now[0])
        return nodes[0]

    check = MultiNodeStoreCheck("/srv/store", alive_nodes=alive)
    assert check() is False and not check.warned
    now[0] += 1
    check()
    assert len(asked) == 1  # Ray is asked at most every NODE_CHECK_SECONDS
    nodes[0] = 2  # an autoscaler adds a worker
    now[0] += lifecycle.NODE_CHECK_SECONDS
    with caplog.at_level("WARNING", logger="elastify"):
        assert check() is False
        now[0] += lifecycle.NODE_CHECK_SECONDS
        check()
    assert check.warned and len(asked) == 2
    assert sum("cannot read what this one wrote" in r.message for r in caplog.records) == 1
    assert MultiNodeStoreCheck("s3://bucket/p", alive_nodes=alive).warned  # an S3 store never asks Ray


def test_the_systemd_unit_signals_elastify_up_alone_and_waits_longer_than_its_stop():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(Path(__file__).resolve().parents[3] / "infra" / "systemd" / "elastify.service")
    service = unit["Service"]
    assert service["ExecStart"].split()[1:3] == ["up", "--host"] and service["ExecStart"].split()[0].endswith("/elastify")
    assert service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) > lifecycle.STOP_GRACE_SECONDS
    assert "RAY_AUTH_MODE=disabled" in service["Environment"].split()
