"""LocalStore writes are durable: the object's bytes are fsynced before the rename that publishes them,
and its directory after it, so a power loss cannot leave a renamed but empty object."""

from __future__ import annotations

import os
import stat

import pytest

from workers.store import LocalStore


@pytest.fixture
def fsyncs(monkeypatch):
    """Each fsync the store makes, in order, as 'file' or 'dir' and the path's inode (still real fsyncs)."""
    calls, real_fsync = [], os.fsync

    def recording_fsync(fd):
        info = os.fstat(fd)
        calls.append(("dir" if stat.S_ISDIR(info.st_mode) else "file", info.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


@pytest.mark.parametrize("write", ["put_file", "put_bytes"])
def test_each_store_write_fsyncs_the_file_then_its_directory(tmp_path, fsyncs, write):
    store = LocalStore(tmp_path / "store")
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100_000)
    if write == "put_file":
        store.put_file("builds/b1/object.bin", source)
    else:
        store.put_bytes("builds/b1/object.bin", source.read_bytes())
    stored = tmp_path / "store" / "builds" / "b1" / "object.bin"
    assert stored.read_bytes() == b"x" * 100_000
    # The temp file's inode is the stored object's after the rename.
    assert fsyncs == [("file", stored.stat().st_ino), ("dir", stored.parent.stat().st_ino)]


def test_copies_out_of_the_store_are_not_fsynced(tmp_path, fsyncs):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("k", b"data")
    fsyncs.clear()
    store.get_file("k", tmp_path / "scratch" / "k")
    assert (tmp_path / "scratch" / "k").read_bytes() == b"data" and fsyncs == []
