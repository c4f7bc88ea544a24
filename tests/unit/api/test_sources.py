"""Where builds read from: the deployment's source roots, or the tenant's own uploads (POST /v1/sources).

Submit refuses any file a build would read outside the roots (403 naming the field) and malformed or
foreign references (422); uploads are unpacked safely, content-addressed per tenant, size- and
quota-limited, and the worker hands a stage the fetched upload in place of `upload:<digest>`."""

from __future__ import annotations

import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.app import default_registry
from pipeline.settings import ProfileSettings
from tests.support.api import make_api
from workers.runner import ExternalInput, StageTask, execute
from workers.store import StoreConfig


@pytest.fixture
def roots(tmp_path) -> Path:
    root = tmp_path / "models"
    model = root / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (root / "calib.txt").write_text("some calibration text")
    return root


@pytest.fixture
def api(tmp_path, roots):
    """The real stages (which read source.model and calibration), with `roots` as the only source root."""
    return make_api(tmp_path, registry=default_registry(), source_roots=str(roots), max_upload_bytes=64 << 10,
                    upload_quota_bytes=96 << 10)


@pytest.fixture
def client(api):
    from fastapi.testclient import TestClient

    return TestClient(api.app)


def _spec(model: str, calibration: list[str] | None = None, **stages) -> dict:
    spec = {"source": {"model": model}, "levels": [0.5, 1.0], "publish": {"name": "p", "version": "1"},
            "stages": {name: {"settings": settings} for name, settings in stages.items()}}
    if calibration is not None:
        spec["calibration"] = calibration
    return spec


def _fields(response) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json().get("errors", [])}


def test_paths_outside_the_source_roots_are_refused_naming_the_field(api, client, roots, tmp_path):
    acme = api.token("acme")
    passwd = client.post("/v1/builds", json=_spec(str(roots / "tiny"), ["/etc/passwd"]), headers=acme)
    assert passwd.status_code == 403, passwd.text
    assert list(_fields(passwd)) == ["calibration.0"] and "outside the allowed source roots" in passwd.text

    model = client.post("/v1/builds", json=_spec("/etc", [str(roots / "calib.txt")]), headers=acme)
    assert model.status_code == 403 and list(_fields(model)) == ["source.model"]

    setting = client.post("/v1/builds", json=_spec(str(roots / "tiny"), recover={"instructions": "/etc/passwd"}),
                          headers=acme)
    assert setting.status_code == 403 and list(_fields(setting)) == ["stages.recover.settings.instructions"]

    (roots / "escape").symlink_to("/etc")
    linked = client.post("/v1/builds", json=_spec(str(roots / "tiny"), [str(roots / "escape" / "passwd")]),
                         headers=acme)
    assert linked.status_code == 403 and list(_fields(linked)) == ["calibration.0"]
    (roots / "tiny" / "weights.safetensors").symlink_to("/etc/passwd")  # a model directory leading out
    inner = client.post("/v1/builds", json=_spec(str(roots / "tiny")), headers=acme)
    assert inner.status_code == 403 and "symlink" in _fields(inner)["source.model"]
    (roots / "tiny" / "weights.safetensors").unlink()

    for bad, why in ((str(roots / ".." / "models" / "calib.txt"), "'..'"), ("calib.txt", "absolute path")):
        malformed = client.post("/v1/builds", json=_spec(str(roots / "tiny"), [bad]), headers=acme)
        assert malformed.status_code == 422 and why in _fields(malformed)["calibration.0"], malformed.text

    with api.sessions() as session:
        from cluster.models import Build

        assert session.query(Build).count() == 0, "nothing is written for a refused build"
    fine = client.post("/v1/builds", json=_spec(str(roots / "tiny"), [str(roots / "calib.txt"), "ptb:train"]),
                       headers=acme)
    assert fine.status_code == 201, fine.text


def _tar_gz(files: dict[str, bytes], top: str = "my-model", link: tuple[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
        if link is not None:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            archive.addfile(info)
    return buffer.getvalue()


def _upload(client, headers, body: bytes, media: str, name: str | None = None):
    return client.post("/v1/sources", content=body, params={"name": name} if name else None,
                       headers={**headers, "Content-Type": media})


def test_an_uploaded_model_directory_is_stored_per_tenant_and_named_by_digest(api, client, roots):
    acme, beta = api.token("acme"), api.token("beta")
    body = _tar_gz({"config.json": b"{}", "weights.safetensors": b"\x00" * 1000})
    first = _upload(client, acme, body, "application/gzip")
    assert first.status_code == 201, first.text
    upload = first.json()
    assert upload["kind"] == "dir" and upload["size"] == 1002 and upload["source"] == f"upload:{upload['digest']}"
    # Stored as an artifact of the tenant, with the top-level directory of the archive stripped.
    index = json.loads(api.store.get_bytes(f"sources/acme/{upload['digest']}/index.json"))
    assert sorted(f["path"] for f in index["files"]) == ["config.json", "weights.safetensors"]
    again = _upload(client, acme, body, "application/gzip")
    assert again.status_code == 200 and again.json()["digest"] == upload["digest"]

    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as archive:
        archive.writestr("config.json", b"{}")
        archive.writestr("weights.safetensors", b"\x00" * 1000)
    assert _upload(client, acme, zipped.getvalue(), "application/zip").json()["digest"] == upload["digest"]

    calibration = _upload(client, acme, b"a calibration text", "application/octet-stream", name="calib.txt")
    assert calibration.status_code == 201 and calibration.json()["kind"] == "file"
    spec = _spec(upload["source"], [calibration.json()["source"]])
    assert client.post("/v1/builds", json=spec, headers=acme).status_code == 201
    # Another tenant cannot name acme's upload, nor learn that it exists.
    foreign = client.post("/v1/builds", json=spec, headers=beta)
    assert foreign.status_code == 422 and "no upload" in _fields(foreign)["source.model"]
    assert client.get("/v1/sources", headers=beta).json()["items"] == []
    listed = client.get("/v1/sources", headers=acme).json()
    assert len(listed["items"]) == 2 and listed["total_bytes"] == 1002 + 18

    assert client.delete(f"/v1/sources/{upload['digest']}", headers=beta).status_code == 404
    assert client.delete(f"/v1/sources/{upload['digest']}", headers=acme).status_code == 204
    assert not api.store.list(f"sources/acme/{upload['digest']}")
    gone = client.post("/v1/builds", json=_spec(upload["source"]), headers=acme)
    assert gone.status_code == 422


def test_uploads_that_lead_out_are_too_large_or_over_quota_are_refused(api, client):
    acme = api.token("acme")
    escaping = _upload(client, acme, _tar_gz({"../../etc/cron.d/x": b"boom"}, top=""), "application/gzip")
    assert escaping.status_code == 422 and "outside" in escaping.json()["detail"]
    linked = _upload(client, acme, _tar_gz({"config.json": b"{}"}, link=("my-model/w", "/etc/passwd")),
                     "application/gzip")
    assert linked.status_code == 422 and "not a regular file" in linked.json()["detail"]
    assert _upload(client, acme, b"x", "application/octet-stream").status_code == 422  # no ?name=
    assert _upload(client, acme, b"x", "text/plain", name="a.txt").status_code == 415
    big = _upload(client, acme, b"\x00" * (65 << 10), "application/octet-stream", name="big.bin")
    assert big.status_code == 413
    # A small archive that unpacks beyond the limit (a zip bomb) is refused as well.
    bomb = _upload(client, acme, _tar_gz({"zeros.bin": b"\x00" * (80 << 10)}), "application/gzip")
    assert bomb.status_code == 413
    for index in range(2):  # 2 × 48 KiB fill the 96 KiB quota; a third is refused
        assert _upload(client, acme, bytes([index]) * (48 << 10), "application/octet-stream",
                       name=f"part{index}.bin").status_code == 201
    over = _upload(client, acme, b"\x07" * 100, "application/octet-stream", name="more.bin")
    assert over.status_code == 429 and "quota" in over.json()["detail"]
    assert api.store.list("sources/acme") and len(client.get("/v1/sources", headers=acme).json()["items"]) == 2
    assert not [p for p in api.store.list("sources") if "more.bin" in p], "no content is kept without its row"


def _read_calibration(inputs, settings, ctx):
    out = ctx.work_dir / "seen.txt"
    out.write_text(Path(settings.calibration[0]).read_text() + "|" + settings.calibration[1])
    return {"out": out}


def test_the_worker_hands_the_stage_its_fetched_upload_in_place_of_the_reference(tmp_path):
    store = StoreConfig(str(tmp_path / "store"))
    source = tmp_path / "calib.txt"
    source.write_text("uploaded calibration text")
    ref = store.open().put_artifact("sources/acme/x", source)
    value = f"upload:{ref.digest}"
    task = StageTask(build_id="b", stage_id=1, stage_key="profile", attempt=1, run=_read_calibration, inputs={},
                     outputs=("out",), settings=ProfileSettings(calibration=[value, "ptb:train"]), store=store,
                     output_prefix="builds/b/profile/a1", uploads={value: ref})
    result = execute(task)
    assert result["ok"], result
    assert store.open().get_artifact(result["outputs"]["out"], tmp_path / "got").read_text() == \
        "uploaded calibration text|ptb:train"


def test_the_operator_cli_applies_the_same_source_roots(tmp_path, roots, monkeypatch):
    from api.cli import app
    from cluster.db import migrate

    monkeypatch.setenv("ELASTIFY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ELASTIFY_SOURCE_ROOTS", str(roots))
    monkeypatch.setenv("ELASTIFY_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    migrate(os.environ["ELASTIFY_DATABASE_URL"])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(str(roots / "tiny"), ["/etc/passwd"])))
    refused = CliRunner().invoke(app, ["admin", "build", "submit", str(spec), "--tenant", "acme"])
    assert refused.exit_code != 0 and "calibration.0" in refused.output, refused.output
    spec.write_text(json.dumps(_spec(str(roots / "tiny"), [str(roots / "calib.txt")])))
    accepted = CliRunner().invoke(app, ["admin", "build", "submit", str(spec), "--tenant", "acme"])
    assert accepted.exit_code == 0, accepted.output


def test_the_scheduler_hands_an_uploaded_model_to_the_worker_as_a_verified_artifact(api, client):
    from sqlalchemy import select

    from cluster.models import Stage
    from cluster.scheduler import Scheduler
    from workers.store import ArtifactRef

    acme = api.token("acme")
    upload = _upload(client, acme, _tar_gz({"config.json": b"{}"}), "application/gzip").json()
    build = client.post("/v1/builds", json=_spec(upload["source"]), headers=acme)
    assert build.status_code == 201, build.text
    scheduler = Scheduler(api.settings, default_registry())
    try:
        with scheduler.sessions() as session:
            profile = session.scalar(select(Stage).where(Stage.build_id == build.json()["id"], Stage.key == "profile"))
            inputs = scheduler._inputs(session, profile, "acme")
            assert inputs["model"] == ArtifactRef(f"sources/acme/{upload['digest']}", upload["digest"], 2)
            with pytest.raises(FileNotFoundError, match="no upload of tenant beta"):
                scheduler._inputs(session, profile, "beta")
    finally:
        scheduler.engine.dispose()


def test_with_configured_roots_the_worker_checks_every_path_again_as_it_resolves_it(tmp_path, roots):
    store = StoreConfig(str(tmp_path / "store"))
    (roots / "later").symlink_to("/etc")  # a link made (or changed) after the build was admitted
    common = dict(build_id="b", stage_id=1, stage_key="profile", attempt=1, run=_read_calibration,
                  outputs=("out",), store=store, output_prefix="builds/b/profile/a1", source_roots=(str(roots),))
    model = execute(StageTask(inputs={"model": ExternalInput(str(roots / "later"))},
                              settings=ProfileSettings(calibration=[str(roots / "calib.txt"), "ptb:train"]), **common))
    assert not model["ok"] and not model["retryable"] and "outside the allowed source roots" in model["error"]
    setting = execute(StageTask(inputs={}, settings=ProfileSettings(calibration=[str(roots / "later" / "passwd"),
                                                                                 "ptb:train"]), **common))
    assert not setting["ok"] and "setting calibration.0" in setting["error"]
    fine = execute(StageTask(inputs={"model": ExternalInput(str(roots / "tiny"))},
                             settings=ProfileSettings(calibration=[str(roots / "calib.txt"), "ptb:train"]), **common))
    assert fine["ok"], fine
