"""The trust store: keys pinned by package name are the default check; unsigned or unpinned is an opt-in."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device_sdk import trust
from device_sdk.cli import main as device_cli
from device_sdk.format import (
    MANIFEST,
    PackageError,
    atomic_write_bytes,
    canonical_json,
    read_manifest,
    sign_manifest,
)
from device_sdk.registry import pull
from device_sdk.runtime import ElasticModel
from device_sdk.trust import TRUST_STORE_ENV, TrustStore, verify_package
from tests.support.sdk_packages import public_bytes, publish, random_package, signing_key

KEY = signing_key()
KEY_B64 = base64.b64encode(public_bytes(KEY)).decode()
OTHER = signing_key(seed=9)
OTHER_B64 = base64.b64encode(public_bytes(OTHER)).decode()


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    """A tiny package named "tiny", signed with KEY."""
    return random_package("llama_gqa", tmp_path_factory.mktemp("trust") / "pkg", KEY)


@pytest.fixture
def package(signed, tmp_path) -> Path:
    """A private copy of `signed` that a test may re-sign or strip."""
    return Path(shutil.copytree(signed, tmp_path / "pkg"))


@pytest.fixture
def store(tmp_path, monkeypatch) -> TrustStore:
    monkeypatch.setenv(TRUST_STORE_ENV, str(tmp_path / "config" / "trust.json"))
    return TrustStore()


def resign(package: Path, key: Ed25519PrivateKey | None) -> None:
    """Replace the signature with one by `key` (None: no signature), as a forger would."""
    manifest = read_manifest(package)
    manifest.signature = None
    if key is not None:
        sign_manifest(manifest, key)
    atomic_write_bytes(package / MANIFEST, canonical_json(manifest.to_dict()))


def test_trust_cli_add_list_remove_and_no_silent_rotation(store, capsys):
    assert device_cli(["trust", "add", "tiny", KEY_B64]) == 0
    assert TrustStore().pinned("tiny") == KEY_B64
    assert device_cli(["trust", "list"]) == 0
    assert f"tiny\t{KEY_B64}" in capsys.readouterr().out

    assert device_cli(["trust", "add", "tiny", OTHER_B64]) == 1  # another key for a pinned name
    assert "already pinned" in capsys.readouterr().err and TrustStore().pinned("tiny") == KEY_B64
    assert device_cli(["trust", "add", "tiny", OTHER_B64, "--replace"]) == 0
    assert TrustStore().pinned("tiny") == OTHER_B64

    assert device_cli(["trust", "remove", "tiny"]) == 0 and TrustStore().pinned("tiny") is None
    assert device_cli(["trust", "remove", "tiny"]) == 1
    # a malformed key is a usage error, not a traceback
    assert device_cli(["trust", "add", "tiny", "not-a-key"]) == 2
    assert "not an Ed25519 public key" in capsys.readouterr().err


def test_load_and_verify_without_a_key_are_refused_unless_opted_in(package, store, caplog, monkeypatch):
    # The warning is given once per package version and process; earlier tests load 'tiny' too.
    monkeypatch.setattr(trust, "_warned", set())
    with pytest.raises(PackageError, match="no public key is pinned for package 'tiny'"):
        ElasticModel.load(package)
    with pytest.raises(PackageError, match="no public key is pinned"):
        verify_package(package)
    with caplog.at_level("WARNING", logger="device_sdk.trust"):
        model = ElasticModel.load(package, allow_unsigned=True)
    assert model.manifest.name == "tiny" and "WITHOUT a signature check" in caplog.text


def test_the_pinned_key_is_the_default_and_a_forger_is_refused(package, store):
    store.add("tiny", KEY_B64)
    assert ElasticModel.load(package).manifest.name == "tiny"  # checked against the pin, no key passed

    resign(package, OTHER)  # a valid signature, by a key that is not the pinned one
    for load in (lambda: ElasticModel.load(package), lambda: ElasticModel.load(package, allow_unsigned=True),
                 lambda: verify_package(package)):
        with pytest.raises(PackageError, match="signature does not verify"):
            load()
    with pytest.raises(PackageError, match="not the key pinned"):  # nor may a caller hand over the forger's key
        ElasticModel.load(package, public_key=public_bytes(OTHER))

    resign(package, None)  # no signature at all
    with pytest.raises(PackageError, match="not signed"):
        ElasticModel.load(package)
    ElasticModel.load(package, allow_unsigned=True)  # an explicit opt-in, with a warning


def test_pull_uses_the_pinned_key_and_never_pins_on_first_use(signed, store, tmp_path):
    registry = tmp_path / "registry"
    publish(signed, registry)
    with pytest.raises(PackageError, match="pinned public key"):
        pull("tiny", "1.0.0", registry=registry, cache_dir=tmp_path / "cache")
    pull("tiny", "1.0.0", registry=registry, public_key=KEY_B64, cache_dir=tmp_path / "cache")
    assert TrustStore().keys == {}  # a key passed once is not remembered
    store.add("tiny", OTHER_B64)
    with pytest.raises(PackageError, match="signature does not verify"):
        pull("tiny", "1.0.0", registry=registry, cache_dir=tmp_path / "other")
    TrustStore().add("tiny", KEY_B64, replace=True)
    path = pull("tiny", "1.0.0", registry=registry, cache_dir=tmp_path / "pinned")
    assert ElasticModel.load(path).manifest.version == "1.0.0"


def test_cli_verify_needs_a_key_or_the_opt_in_and_says_which(package, store, capsys):
    assert device_cli(["verify", str(package)]) == 1
    assert "no public key is pinned" in capsys.readouterr().err
    assert device_cli(["verify", str(package), "--allow-unsigned"]) == 0
    assert "signature NOT checked" in capsys.readouterr().out
    assert device_cli(["verify", str(package), "--public-key", KEY_B64]) == 0
    assert "signature verified" in capsys.readouterr().out
    store.add("tiny", KEY_B64)
    assert device_cli(["verify", str(package)]) == 0
    assert "signature verified" in capsys.readouterr().out
    for bad in ("not base64!", base64.b64encode(b"short").decode()):
        assert device_cli(["verify", str(package), "--public-key", bad]) == 2
        assert "not an Ed25519 public key" in capsys.readouterr().err


def test_a_damaged_trust_store_is_a_clear_error(store, package):
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text(json.dumps({"format": 1, "keys": {"tiny": "not a key"}}))
    with pytest.raises(PackageError, match="not an Ed25519 public key"):
        ElasticModel.load(package)
    store.path.write_text("{")
    with pytest.raises(PackageError, match="trust store .* cannot be read"):
        ElasticModel.load(package)
