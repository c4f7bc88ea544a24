"""The S3 backend against a real SeaweedFS: multipart and copy-based atomic writes, verified reads."""

from __future__ import annotations

import os

import pytest

from workers.store import MULTIPART_THRESHOLD, StoreIntegrityError

pytestmark = pytest.mark.integration


def test_s3_artifacts_round_trip_and_reads_are_verified(tmp_path, s3_store):
    store = s3_store.open()
    src = tmp_path / "pkg"
    (src / "model").mkdir(parents=True)
    big = os.urandom(MULTIPART_THRESHOLD + 12345)  # goes up as a multipart upload
    (src / "model" / "weights.bin").write_bytes(big)
    (src / "manifest.json").write_text('{"ok": true}')
    ref = store.put_artifact("builds/b/s/a1/package", src)

    got = store.get_artifact(ref, tmp_path / "got")
    assert (got / "model" / "weights.bin").read_bytes() == big
    assert store.list("builds/b") == [
        "builds/b/s/a1/package/files/manifest.json", "builds/b/s/a1/package/files/model/weights.bin",
        "builds/b/s/a1/package/index.json",
    ]
    assert not [key for key in store.list("") if key.startswith(".tmp/")]  # temp keys are removed after the copy

    store.put_bytes("builds/b/s/a1/package/files/manifest.json", b'{"ok": false}')  # tamper
    with pytest.raises(StoreIntegrityError, match="does not match"):
        store.get_artifact(ref, tmp_path / "again")
    store.copy("builds/b/s/a1/package/index.json", "elsewhere/index.json")
    assert store.get_bytes("elsewhere/index.json") == store.get_bytes("builds/b/s/a1/package/index.json")
    with pytest.raises(FileNotFoundError):
        store.get_bytes("never/written")
