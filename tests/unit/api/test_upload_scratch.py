"""Upload scratch left by a process killed mid-body is swept; a live upload's scratch is not (46.15)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from api.routes.sources import SCRATCH_PREFIX, sweep_upload_scratch, upload_scratch

# What a killed upload leaves: upload_scratch's lock taken by a process that then dies with SIGKILL.
KILLED_MID_BODY = """
import fcntl, os, signal, sys, tempfile
scratch = tempfile.mkdtemp(prefix=sys.argv[1], dir=sys.argv[2])
fcntl.flock(os.open(scratch, os.O_RDONLY), fcntl.LOCK_EX)
open(os.path.join(scratch, "body"), "wb").write(b"half a body")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_uploads_scratch_is_swept_and_a_live_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    subprocess.run([sys.executable, "-c", KILLED_MID_BODY, SCRATCH_PREFIX, str(tmp_path)], check=False)
    (left,) = tmp_path.glob(f"{SCRATCH_PREFIX}*")
    assert (left / "body").exists()
    with upload_scratch() as live:
        (live / "body").write_bytes(b"in progress")
        assert sweep_upload_scratch(grace_s=0) == 1
        assert not left.exists() and (live / "body").exists()
    assert not live.exists() and list(tmp_path.iterdir()) == []


def test_a_young_unlocked_scratch_is_left_for_its_owner_to_lock(tmp_path):
    young = tmp_path / f"{SCRATCH_PREFIX}new"
    young.mkdir()
    assert sweep_upload_scratch(tmp_path) == 0 and young.exists()
    os.utime(young, (0, 0))  # older than the grace period: nobody is about to lock it
    assert sweep_upload_scratch(tmp_path) == 1 and not young.exists()
