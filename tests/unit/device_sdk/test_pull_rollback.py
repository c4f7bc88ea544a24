"""pull() against rollback and freeze: signed sequences and expiry, aliases checked against what they name."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from device_sdk.format import MANIFEST, Manifest, PackageError, canonical_json, read_manifest, sign_manifest
from device_sdk.registry import SEQUENCES, installed_sequences, pull
from tests.support.sdk_packages import public_bytes, random_package, signing_key

KEY = signing_key()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One tiny signed package without a sequence (as packages were before sequences)."""
    return random_package("llama_mha", tmp_path_factory.mktemp("rollback") / "built", KEY, layers=2)


def release(built: Path, registry: Path, version: str, sequence: int | None, *, expires_at: str | None = None,
            alias: str | None = None) -> None:
    """Lay `built` out in `registry` as `version`, with that sequence and expiry, re-signed."""
    target = registry / "packages" / "tiny" / version
    shutil.copytree(built, target)
    manifest = read_manifest(target)
    manifest.version = version
    if sequence is not None:
        manifest.sequence = sequence
    manifest.expires_at = expires_at
    sign_manifest(manifest, KEY)
    (target / MANIFEST).write_bytes(canonical_json(manifest.to_dict()))
    if alias is not None:
        point(registry, alias, version)


def point(registry: Path, alias: str, version: str) -> None:
    path = registry / "packages" / "tiny" / "aliases" / alias
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(version)


def test_a_manifest_without_a_sequence_keeps_its_signed_bytes_and_reads_as_sequence_0(built):
    raw = (built / MANIFEST).read_bytes()
    assert b'"sequence"' not in raw and b'"expires_at"' not in raw
    manifest = read_manifest(built)
    assert (manifest.sequence, manifest.expires_at) == (0, None)
    assert canonical_json(manifest.to_dict()) == raw  # so its old signature still verifies
    data = json.loads(raw)
    for bad in ({"sequence": -1}, {"sequence": True}, {"expires_at": "tomorrow"}, {"expires_at": "2027-01-01T00:00:00"}):
        with pytest.raises(PackageError, match="sequence|expires_at"):
            Manifest.from_dict({**data, **bad})


def test_an_older_release_is_refused_after_a_newer_one_unless_downgrade_is_allowed(built, tmp_path):
    registry, cache, key = tmp_path / "registry", tmp_path / "cache", public_bytes(KEY)
    release(built, registry, "0.9.0", None)
    release(built, registry, "1.0.0", 1)
    release(built, registry, "2.0.0", 2, alias="latest")
    pull("tiny", "0.9.0", registry=registry, public_key=key, cache_dir=cache)  # nothing sequenced installed yet
    assert installed_sequences(cache) == {}
    pull("tiny", "latest", registry=registry, public_key=key, cache_dir=cache)
    assert installed_sequences(cache) == {"tiny": 2}

    for version, sequence in (("1.0.0", 1), ("0.9.0", 0)):  # an installed pre-sequence copy is no way round it
        with pytest.raises(PackageError, match=f"tiny {version} has sequence {sequence}, "
                                               "older than sequence 2 already installed here: refusing a rollback"):
            pull("tiny", version, registry=registry, public_key=key, cache_dir=cache)
    assert not (cache / "tiny" / "1.0.0").exists()
    point(registry, "latest", "1.0.0")  # a registry that rolls its alias back
    with pytest.raises(PackageError, match=r"1\.0\.0 \(what 'latest' points to\) has sequence 1"):
        pull("tiny", "latest", registry=registry, public_key=key, cache_dir=cache)

    path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=cache, allow_downgrade=True)
    assert read_manifest(path).sequence == 1
    assert installed_sequences(cache) == {"tiny": 2}  # a deliberate downgrade stays one: the record never drops


def test_an_alias_is_only_a_pointer_the_manifest_it_names_is_checked(built, tmp_path):
    registry, key = tmp_path / "registry", public_bytes(KEY)
    release(built, registry, "1.0.0", 1)
    shutil.copytree(registry / "packages/tiny/1.0.0", registry / "packages/tiny/3.0.0")  # 1.0.0's signed manifest
    point(registry, "latest", "3.0.0")
    with pytest.raises(PackageError, match="manifest is for tiny 1.0.0, not tiny 3.0.0"):
        pull("tiny", "latest", registry=registry, public_key=key, cache_dir=tmp_path / "cache")
    manifest = json.loads((registry / "packages/tiny/1.0.0" / MANIFEST).read_text())
    manifest["sequence"] = 99  # a sequence raised by anyone but the publisher
    (registry / "packages/tiny/1.0.0" / MANIFEST).write_bytes(canonical_json(manifest))
    with pytest.raises(PackageError, match="signature does not verify"):
        pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path / "cache")


def test_an_expired_manifest_is_refused_and_one_not_yet_expired_is_pulled(built, tmp_path):
    registry, cache, key = tmp_path / "registry", tmp_path / "cache", public_bytes(KEY)
    now = datetime.now(UTC)
    release(built, registry, "1.0.0", 1, expires_at=(now - timedelta(minutes=1)).isoformat(timespec="seconds"))
    release(built, registry, "1.1.0", 2, expires_at=(now + timedelta(days=30)).isoformat(timespec="seconds"))
    with pytest.raises(PackageError, match="tiny 1.0.0 expired at .*stale metadata"):
        pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=cache)
    assert not (cache / "tiny" / "1.0.0").exists()
    pull("tiny", "1.1.0", registry=registry, public_key=key, cache_dir=cache)
    (cache / SEQUENCES).write_text("{not json")
    with pytest.raises(PackageError, match="installed-sequence record .* cannot be read"):
        pull("tiny", "1.1.0", registry=registry, public_key=key, cache_dir=cache)
