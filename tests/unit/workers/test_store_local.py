"""The artifact store's local backend: atomic artifacts, digest-verified reads."""

from __future__ import annotations

import pytest

from workers.store import ArtifactRef, LocalStore, StoreConfig, StoreIntegrityError


def _tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.bin").write_bytes(b"\x00\x01" * 1000)
    return root


def test_directory_and_file_artifacts_round_trip(tmp_path):
    store = StoreConfig(str(tmp_path / "store")).open()
    store.ensure_ready()
    ref = store.put_artifact("builds/b1/s/a1/out", _tree(tmp_path / "src"))
    assert ref.size == 5 + 2000 and len(ref.digest) == 64
    got = store.get_artifact(ref, tmp_path / "dst")
    assert (got / "a.txt").read_text() == "alpha" and (got / "sub" / "b.bin").read_bytes() == b"\x00\x01" * 1000

    single = tmp_path / "one.json"
    single.write_text("{}")
    file_ref = store.put_artifact("builds/b1/s/a1/report", single)
    assert store.get_artifact(file_ref, tmp_path / "dst2").read_text() == "{}"
    assert not [p for p in (tmp_path / "store").rglob(".*")], "no temp files may be left behind"


def test_reads_are_verified_against_digests(tmp_path):
    store = LocalStore(tmp_path / "store")
    ref = store.put_artifact("x", _tree(tmp_path / "src"))
    (tmp_path / "store" / "x" / "files" / "a.txt").write_text("tampered")
    with pytest.raises(StoreIntegrityError, match="does not match"):
        store.get_artifact(ref, tmp_path / "dst")
    assert not (tmp_path / "dst" / "a.txt").exists()  # a failed read leaves nothing behind

    wrong = ArtifactRef(ref.key, "0" * 64, ref.size)
    assert store.artifact_exists(ref) and not store.artifact_exists(wrong)
    assert not store.artifact_exists(ArtifactRef("never/written", ref.digest, 0))


def test_an_artifact_without_its_index_does_not_exist(tmp_path):
    store = LocalStore(tmp_path / "store")
    ref = store.put_artifact("y", _tree(tmp_path / "src"))
    (tmp_path / "store" / "y" / "index.json").unlink()  # as if the writer died before the last write
    assert not store.artifact_exists(ref)


def test_keys_cannot_escape_the_store_and_bad_urls_are_refused(tmp_path):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ValueError, match="outside the store"):
        store.put_bytes("../evil", b"x")
    with pytest.raises(ValueError, match="unsupported store URL"):
        StoreConfig("ftp://host/x").open()
