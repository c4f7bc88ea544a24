"""`elastify-device verify` checks a legitimate `--max-level` partial pull as what it is (the files and
weight ranges it holds), and still reports a tampered one."""

from __future__ import annotations

from device_sdk.cli import main
from device_sdk.format import WEIGHTS
from device_sdk.registry import pull
from tests.support.sdk_packages import public_bytes, publish, random_package, signing_key

KEY = signing_key()


def test_verify_accepts_a_partial_pull_and_refuses_a_tampered_one(tmp_path, capsys):
    import base64

    registry = tmp_path / "registry"
    publish(random_package("llama_gqa", tmp_path / "built", KEY), registry)
    key = base64.b64encode(public_bytes(KEY)).decode()
    path = pull("tiny", "1.0.0", registry=registry, public_key=public_bytes(KEY), max_level=0.5,
                cache_dir=tmp_path / "cache")
    assert main(["verify", str(path), "--public-key", key]) == 0
    assert "partial copy: levels <= 0.5" in capsys.readouterr().out
    weights = path / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[200] ^= 0xFF  # inside the first (held) range
    weights.write_bytes(bytes(data))
    assert main(["verify", str(path), "--public-key", key]) == 1
