"""The `elastify` REST commands (submit, builds, logs, packages, aliases, usage) against the live app."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from api.cli import app
from cluster.models import Build, Event, Stage
from device_sdk.registry import read_local_state, verify_local
from tests.support.api import finish_build, spec
from tests.support.live_api import KEY_SEED, api_with_packages
from tests.support.sdk_packages import public_bytes, signing_key

PUBLIC_KEY = public_bytes(signing_key(KEY_SEED))
SPEC = "source: {model: unused}\nlevels: [1.0]\npublish: {name: clipkg, version: '1'}\n"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with api_with_packages(tmp_path_factory.mktemp("cli")) as live:
        yield live


@pytest.fixture
def cli(api, monkeypatch):
    """Run `elastify …` in process as tenant acme, server and token from the environment."""
    monkeypatch.setenv("ELASTIFY_SERVER", api.url)
    monkeypatch.setenv("ELASTIFY_TOKEN", api.acme)
    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: str):
        result = CliRunner().invoke(app, list(args))
        assert api.acme not in result.output  # the token is never printed
        return result

    return run


def spec_file(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_cli_submit_list_show_cancel_retry_logs(cli, tmp_path, monkeypatch):
    submitted = cli("submit", str(spec_file(tmp_path)))
    assert submitted.exit_code == 0, submitted.output
    build_id = submitted.stdout.strip()
    assert len(build_id) == 16
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal's width must not squeeze a piped table
    listed = cli("builds", "list", "--name", "clipkg")
    monkeypatch.setenv("COLUMNS", "200")
    assert listed.exit_code == 0 and build_id in listed.stdout and "queued" in listed.stdout
    assert "…" not in listed.stdout and max(map(len, listed.stdout.splitlines())) > 60  # whole ids and dates
    shown = cli("builds", "show", build_id)
    assert shown.exit_code == 0 and "first" in shown.stdout and "second" in shown.stdout and "0/3 stages" in shown.stdout
    cancelled = cli("builds", "cancel", build_id)
    assert cancelled.exit_code == 0 and "cancelled" in cancelled.output
    text = cli("logs", build_id)
    assert text.exit_code == 0 and "submitted with 3 stages" in text.stdout and "cancellation requested" in text.stdout
    followed = cli("logs", build_id, "--follow")
    assert followed.exit_code == 0 and "build cancelled" in followed.output
    retried = cli("builds", "retry", build_id)
    assert retried.exit_code == 0 and "queued" in retried.output
    assert build_id in cli("builds", "list", "--status", "queued").stdout


def test_cli_submit_follow_draws_stage_progress_until_the_build_ends(cli, api, tmp_path):
    sessions = api.api.sessions
    with sessions() as session:
        before = set(session.scalars(select(Build.id)))

    def scheduler_stand_in():
        """Report progress on the new build's first stage, then cancel it, as a scheduler and a user would."""
        from cluster.service import cancel_build

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with sessions() as session:
                new = set(session.scalars(select(Build.id))) - before
            if new:
                break
            time.sleep(0.05)
        else:
            return
        build_id = new.pop()
        built.append(build_id)
        with sessions.begin() as session:
            stage = session.scalar(select(Stage).where(Stage.build_id == build_id, Stage.key == "first"))
            for done in (1, 2, 3):
                session.add(Event(build_id=build_id, stage_id=stage.id, kind="progress", message="windows",
                                  data={"done": done, "total": 3}))
        time.sleep(0.5)
        cancel_build(sessions, build_id)

    built: list[str] = []
    helper = threading.Thread(target=scheduler_stand_in, daemon=True)
    helper.start()
    result = cli("submit", str(spec_file(tmp_path, SPEC.replace("clipkg", "followed"))), "--follow")
    helper.join()
    assert result.exit_code == 1, result.output  # the build did not succeed
    assert "first: windows" in result.output and "3/3" in result.output  # the stage's progress bar
    assert "cancelled" in result.output and "stages of" in result.output
    followed = cli("logs", built[0], "--follow")  # the followed log shows each progress report as a line
    assert followed.exit_code == 0 and [line.split(" [")[-1] for line in followed.stdout.splitlines()
                                        if "windows" in line] == ["first] windows 1/3", "first] windows 2/3",
                                                                  "first] windows 3/3"], followed.stdout


def test_cli_packages_aliases_and_pull(cli, api, tmp_path):
    listed = cli("packages", "list")
    assert listed.exit_code == 0 and "tiny" in listed.stdout and "latest → 1.0.0" in listed.stdout
    versions = cli("packages", "show", "tiny")
    assert versions.exit_code == 0 and "1.0.0" in versions.stdout and "2.0.0" in versions.stdout
    manifest = cli("packages", "show", "tiny", "1.0.0")
    assert manifest.exit_code == 0 and "0.25" in manifest.stdout and "adapters/recovery/0.5.safetensors" in manifest.stdout
    moved = cli("aliases", "set", "tiny", "latest", "2.0.0")
    assert moved.exit_code == 0 and "latest → 2.0.0" in moved.output
    try:
        pulled = cli("packages", "pull", "tiny", "latest", "--public-key", base64.b64encode(PUBLIC_KEY).decode(),
                     "--cache-dir", str(tmp_path / "cache"))
    finally:
        cli("aliases", "set", "tiny", "latest", "1.0.0")
    assert pulled.exit_code == 0, pulled.output
    path = Path(pulled.stdout.strip())
    assert path == tmp_path / "cache" / "tiny" / "2.0.0" and read_local_state(path)["max_level"] is None
    verify_local(path, PUBLIC_KEY)
    assert "verified tiny 2.0.0" in pulled.output


def test_cli_pull_without_any_key_refuses_and_trusts_the_servers_key_only_when_told(cli, tmp_path, monkeypatch):
    from device_sdk.trust import TRUST_STORE_ENV, TrustStore

    monkeypatch.setenv(TRUST_STORE_ENV, str(tmp_path / "trust.json"))
    refused = cli("packages", "pull", "tiny", "1.0.0", "--cache-dir", str(tmp_path / "cache"))
    assert refused.exit_code == 2 and "no key to verify 'tiny'" in refused.output
    assert "--trust-server-key" in refused.output and "verifying against" not in refused.output
    # The test packages are signed by a key that is not this server's: the server's key must not verify
    # them, and a key that verified nothing is not pinned.
    result = cli("packages", "pull", "tiny", "1.0.0", "--trust-server-key", "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 2 and "signature does not verify" in result.output
    assert "verifying against the server's key" in result.output and "pinned the server's key" not in result.output
    assert TrustStore().pinned("tiny") is None
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_cli_pull_checks_against_the_key_pinned_for_the_name_not_the_servers(cli, tmp_path, monkeypatch):
    from device_sdk.trust import TRUST_STORE_ENV, TrustStore

    monkeypatch.setenv(TRUST_STORE_ENV, str(tmp_path / "trust.json"))
    TrustStore().add("tiny", PUBLIC_KEY)
    result = cli("packages", "pull", "tiny", "1.0.0", "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 0, result.output
    assert "server's key" not in result.output and "verified tiny 1.0.0" in result.output


@pytest.mark.parametrize("key", ["not base64 at all!", base64.b64encode(b"short").decode()])
def test_cli_pull_with_a_malformed_public_key_is_a_clear_error_not_a_traceback(cli, tmp_path, key):
    result = cli("packages", "pull", "tiny", "1.0.0", "--public-key", key, "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 2, result.output
    assert "not an Ed25519 public key" in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_cli_usage_table(cli, api):
    from device_sdk.client import ElastifyClient

    build = ElastifyClient(api.url, token=api.acme).submit(spec("metered"))
    finish_build(api.api, build.id, gpu_seconds=5400)
    result = cli("usage", "--by", "stage_type", "--build", build.id)
    assert result.exit_code == 0, result.output
    cells = [line.replace("│", " ").split() for line in result.stdout.splitlines()]
    rows = {row[0]: row[1:] for row in cells if row and row[0] in ("first", "second", "third")}
    assert set(rows) == {"first", "second", "third"} and all(r[1] == "1.5000" for r in rows.values()), result.stdout
    assert "4.5000 GPU h" in result.stdout
    as_json = cli("usage", "--by", "build,stage_type", "--json")
    assert as_json.exit_code == 0 and '"group_by"' in as_json.stdout


def test_cli_bad_input_and_bad_tokens_are_clear_errors(cli, api, tmp_path, monkeypatch):
    missing = cli("submit", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 2 and "cannot read" in missing.output
    not_yaml = cli("submit", str(spec_file(tmp_path, "source: [unclosed")))
    assert not_yaml.exit_code == 2 and "not valid YAML" in not_yaml.output
    not_mapping = cli("submit", str(spec_file(tmp_path, "- a\n- b\n")))
    assert not_mapping.exit_code == 2 and "must hold a mapping" in not_mapping.output
    invalid = cli("submit", str(spec_file(tmp_path, "source: {model: x}\nlevels: [1.5, 1.0]\nstages: 3\n")))
    assert invalid.exit_code == 2 and "422" in invalid.output
    listed = [line.strip() for line in invalid.output.splitlines()[1:] if line.strip()]  # one line a field error
    fields = {line.split(":", 1)[0].removeprefix("body.") for line in listed}
    assert fields == {"levels", "stages", "publish"}, invalid.output
    assert any("(0, 1]" in line for line in listed)  # each with the server's message
    assert cli("builds", "show", "0123456789abcdef").exit_code == 2
    monkeypatch.setenv("ELASTIFY_TOKEN", "elst_wrong")
    refused = cli("builds", "list")
    assert refused.exit_code == 2 and "401" in refused.output and "elst_wrong" not in refused.output
    monkeypatch.setenv("ELASTIFY_SERVER", "http://127.0.0.1:9")
    down = cli("builds", "list")
    assert down.exit_code == 1 and "cannot reach the server at http://127.0.0.1:9: Connection refused" in down.output
    assert " 0 " not in down.output  # no status code for a server that never answered


def test_cli_uploads_a_model_directory_and_a_file_and_lists_them(cli, api, tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "blob").write_bytes(b"\x00" * 100)
    (model / "weights.safetensors").symlink_to(tmp_path / "blob")  # as in an HF cache snapshot: followed
    uploaded = cli("sources", "upload", str(model))
    assert uploaded.exit_code == 0, uploaded.output
    source = uploaded.stdout.strip()
    assert source.startswith("upload:") and len(source) == len("upload:") + 64
    stored = api.api.store.list(f"sources/acme/{source.removeprefix('upload:')}")
    assert sorted(key.rsplit("/", 1)[-1] for key in stored) == ["config.json", "index.json", "weights.safetensors"]
    calibration = tmp_path / "calib.jsonl"
    calibration.write_text('{"text": "hello"}\n')
    assert cli("sources", "upload", str(calibration)).exit_code == 0
    listed = cli("sources", "list", "--json")
    assert listed.exit_code == 0 and {"dir", "file"} <= {u["kind"] for u in json.loads(listed.stdout)["items"]}
    missing = cli("sources", "upload", str(tmp_path / "nothing"))
    assert missing.exit_code == 2 and "neither a file nor a directory" in missing.output


def test_submitting_a_published_version_is_a_409_naming_the_field_and_the_cli_says_so(cli, api, tmp_path):
    import httpx

    result = cli("submit", str(spec_file(tmp_path, SPEC.replace("clipkg", "tiny").replace("'1'", "1.0.0"))))
    assert result.exit_code == 2 and "tiny 1.0.0 is already published" in result.output
    body = {"source": {"model": "unused"}, "levels": [1.0], "publish": {"name": "tiny", "version": "1.0.0"}}
    refused = httpx.post(f"{api.url}/v1/builds", json=body, headers={"Authorization": f"Bearer {api.acme}"})
    assert refused.status_code == 409 and refused.json()["errors"][0]["field"] == "publish.version", refused.text
    other = httpx.post(f"{api.url}/v1/builds", json=body, headers={"Authorization": f"Bearer {api.token('other')}"})
    assert other.status_code == 409 and "already published" not in other.text  # not told which versions exist


def test_cli_init_writes_a_valid_spec_for_a_directory_or_a_cached_hub_id(cli, tmp_path):
    """init reads the family and shape from config.json; a Hub id resolves in the local HF cache only."""
    import yaml

    from cluster.spec import parse_spec

    config = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936}
    directory = tmp_path / "qwen"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    out = tmp_path / "from-dir.yaml"
    written = cli("init", str(directory), "--out", str(out), "--preset", "default")
    assert written.exit_code == 0, written.output
    text = out.read_text()
    assert "qwen2: 24 layers, hidden size 896, 14 attention heads,\n# 2 key/value heads" in text
    spec = yaml.safe_load(text)
    assert (spec["source"]["model"], spec["preset"], spec["publish"]["name"]) == (str(directory), "default", "qwen-elastic")
    parse_spec(text)
    refused = cli("init", str(directory), "--out", str(out))  # never overwritten unless asked
    assert refused.exit_code != 0 and "--force" in refused.output and out.read_text() == text

    # The cache's own layout: models--ORG--NAME/refs/main names the snapshot that holds the files.
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "a1b2c3"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (cache / "models--Qwen--Qwen2.5-0.5B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen2.5-0.5B" / "refs" / "main").write_text("a1b2c3")
    out = tmp_path / "from-hub.yaml"
    written = cli("init", "Qwen/Qwen2.5-0.5B", "--out", str(out), "--cache-dir", str(cache))
    assert written.exit_code == 0, written.output
    spec = yaml.safe_load(out.read_text())
    assert Path(spec["source"]["model"]).resolve() == snapshot.resolve()
    assert (spec["preset"], spec["publish"]["name"]) == ("quick", "qwen2.5-0.5b-elastic")

    missing = cli("init", "Qwen/Not-There", "--out", str(tmp_path / "x.yaml"), "--cache-dir", str(cache))
    assert missing.exit_code == 2 and str(cache) in missing.output and not (tmp_path / "x.yaml").exists()
    bad = cli("init", str(directory), "--out", str(tmp_path / "y.yaml"), "--preset", "huge")
    assert bad.exit_code != 0 and "quick" in bad.output
