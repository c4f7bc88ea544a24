"""REST API, packages: listing, versions, the manifest byte for byte, downloads with HTTP Range from
a local store, aliases, and names that try to escape (SQLite, local store)."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from cluster.models import Alias
from cluster.packages import alias_key
from tests.support.api import finish_build, publish_files, spec

WEIGHTS = bytes(range(256)) * 40  # 10240 bytes


@pytest.fixture
def acme(api, client, tmp_path):
    headers = api.token("acme")
    for version in ("1.0", "1.1"):
        build_id = client.post("/v1/builds", json=spec(name="smol", version=version), headers=headers).json()["id"]
        finish_build(api, build_id)
        publish_files(api, build_id, "smol", version, {"model/weights.safetensors": WEIGHTS + version.encode(),
                                                       "model/config.json": b"{}"}, tmp_path)
    client.put("/v1/packages/smol/aliases/latest", json={"version": "1.1"}, headers=headers)
    return headers


def test_list_versions_and_manifest(api, client, acme):
    packages = client.get("/v1/packages", headers=acme).json()["items"]
    assert len(packages) == 1
    assert packages[0] | {"updated_at": None} == {"name": "smol", "tenant": "acme", "versions": 2,
                                                  "latest_version": "1.1", "aliases": {"latest": "1.1"},
                                                  "updated_at": None}
    versions = client.get("/v1/packages/smol/versions", headers=acme).json()["items"]
    assert [(v["version"], v["aliases"]) for v in versions] == [("1.0", []), ("1.1", ["latest"])]
    raw = client.get("/v1/packages/smol/1.0/manifest", headers=acme)
    assert hashlib.sha256(raw.content).hexdigest() == versions[0]["manifest_sha256"]  # exactly as stored
    assert raw.headers["etag"] == f'"{versions[0]["manifest_sha256"]}"'
    assert client.get("/v1/packages/smol/latest/manifest", headers=acme).json()["version"] == "1.1"  # by alias
    assert client.get("/v1/packages/smol/9.9/manifest", headers=acme).status_code == 404
    assert client.get("/v1/packages/other/versions", headers=acme).status_code == 404


def test_download_whole_ranges_resume_and_unsatisfiable(client, acme):
    url = "/v1/packages/smol/1.0/files/model/weights.safetensors"
    expected = WEIGHTS + b"1.0"
    whole = client.get(url, headers=acme)
    assert whole.status_code == 200 and whole.content == expected
    assert whole.headers["accept-ranges"] == "bytes"
    # Resume a download cut in the middle.
    middle = len(expected) // 2
    rest = client.get(url, headers={**acme, "Range": f"bytes={middle}-"})
    assert rest.status_code == 206
    assert rest.headers["content-range"] == f"bytes {middle}-{len(expected) - 1}/{len(expected)}"
    assert expected[:middle] + rest.content == expected
    window = client.get(url, headers={**acme, "Range": "bytes=10-19"})
    assert window.status_code == 206 and window.content == expected[10:20]
    suffix = client.get(url, headers={**acme, "Range": "bytes=-5"})
    assert suffix.content == expected[-5:]
    past = client.get(url, headers={**acme, "Range": f"bytes={len(expected)}-"})
    assert past.status_code == 416 and past.headers["content-type"] == "application/problem+json"
    assert past.headers["content-range"] == f"bytes */{len(expected)}"
    assert client.get("/v1/packages/smol/1.0/files/manifest.json", headers=acme).status_code == 200


@pytest.mark.parametrize("path", ["../../../etc/passwd", "model/../../x", ".hidden", "model/%2e%2e/x", "a%01b", "model%2F..%2F..%2Fx"])
def test_file_paths_that_escape_are_refused(client, acme, path):
    response = client.get(f"/v1/packages/smol/1.0/files/{path}", headers=acme)
    assert response.status_code in (404, 422), response.text
    assert response.headers["content-type"] == "application/problem+json"


def test_only_files_the_manifest_lists_are_served(client, acme):
    missing = client.get("/v1/packages/smol/1.0/files/model/secret.bin", headers=acme)
    assert missing.status_code == 404 and "has no file" in missing.json()["detail"]


def test_alias_moves_in_the_database_and_the_store(api, client, acme):
    moved = client.put("/v1/packages/smol/aliases/stable", json={"version": "1.0"}, headers=acme)
    assert moved.status_code == 200 and moved.json()["version"] == "1.0"
    again = client.put("/v1/packages/smol/aliases/stable", json={"version": "1.1"}, headers=acme)
    assert again.json()["version"] == "1.1"
    assert api.store.get_bytes(alias_key("smol", "stable")) == b"1.1"  # what devices read from a bucket
    with api.sessions() as session:
        assert {a.alias for a in session.scalars(select(Alias))} == {"latest", "stable"}
    assert client.put("/v1/packages/smol/aliases/stable", json={"version": "7"}, headers=acme).status_code == 404
    for bad in ("Bad", "..", "a%0Ab", "aliases"):
        response = client.put(f"/v1/packages/smol/aliases/{bad}", json={"version": "1.0"}, headers=acme)
        assert response.status_code in (404, 422), bad
        assert response.headers["content-type"] == "application/problem+json"
    assert client.put("/v1/packages/smol/aliases/ok", json={"version": 1}, headers=acme).status_code == 422


def test_exports_published_beside_the_package_are_served_as_their_index_lists(api, client, acme, tmp_path):
    import json

    from cluster.packages import package_prefix
    from device_sdk.format import EXPORTS_INDEX

    # As publish stores them: the exports and their index land before the package is first read.
    gguf = b"GGUF" + bytes(60)
    index = {"package": "smol", "version": "2.0", "files": [
        {"level": "0.5", "format": "gguf", "type": "f16", "path": "0.5/gguf/smol-0.5-f16.gguf", "size": len(gguf)}]}
    prefix = package_prefix("smol", "2.0")
    source = tmp_path / "export.gguf"
    source.write_bytes(gguf)
    api.store.put_file(f"{prefix}/exports/0.5/gguf/smol-0.5-f16.gguf", source)
    api.store.put_file(f"{prefix}/exports/0.5/gguf/unlisted.bin", source)
    api.store.put_bytes(f"{prefix}/{EXPORTS_INDEX}", json.dumps(index).encode())
    build_id = client.post("/v1/builds", json=spec(name="smol", version="2.0"), headers=acme).json()["id"]
    finish_build(api, build_id)
    publish_files(api, build_id, "smol", "2.0", {"model/weights.safetensors": WEIGHTS + b"exports"}, tmp_path)

    listed = client.get(f"/v1/packages/smol/2.0/files/{EXPORTS_INDEX}", headers=acme)
    assert listed.status_code == 200 and listed.json()["files"][0]["level"] == "0.5"
    served = client.get("/v1/packages/smol/2.0/files/exports/0.5/gguf/smol-0.5-f16.gguf", headers=acme)
    assert served.status_code == 200 and served.content == gguf
    # only what the index lists, and only for the version that has it
    assert client.get("/v1/packages/smol/2.0/files/exports/0.5/gguf/unlisted.bin", headers=acme).status_code == 404
    assert client.get(f"/v1/packages/smol/1.1/files/{EXPORTS_INDEX}", headers=acme).status_code == 404
