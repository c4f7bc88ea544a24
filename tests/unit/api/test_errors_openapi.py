"""REST API, the edges: problem+json for every error, body size limits, the OpenAPI document,
health, readiness, the signing key, Prometheus metrics, and the `tokens`/`tenants` commands."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select
from typer.testing import CliRunner

from api.app import create_app
from cluster.models import ApiToken, Tenant
from tests.support.api import finish_build, spec


@pytest.fixture
def client(api):
    return TestClient(api.app, raise_server_exceptions=False)


def _is_problem(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == status and body["title"] and body["instance"] == response.request.url.path
    return body


def test_unknown_routes_methods_and_crashes_are_problems(api, client):
    _is_problem(client.get("/v1/nothing"), 404)
    _is_problem(client.delete("/v1/builds"), 405)

    @api.app.get("/v1/boom")
    def boom():
        raise RuntimeError("secret internals")

    body = _is_problem(client.get("/v1/boom"), 500)
    assert "secret internals" not in body["detail"]


def test_request_bodies_over_the_limit_are_413(api, client):
    headers = api.token("acme")
    big = b'{"x": "' + b"a" * (1 << 20) + b'"}'
    _is_problem(client.post("/v1/builds", content=big, headers={**headers, "Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit still holds
        for _ in range(20):
            yield b"a" * (100 << 10)

    _is_problem(client.post("/v1/builds", content=chunks(), headers={**headers, "Content-Type": "application/json"}), 413)
    assert client.post("/v1/builds", json=spec(), headers=headers).status_code == 201


def test_a_body_that_is_not_json_is_415_after_authentication(api, client):
    import json

    headers = api.token("acme")
    body = json.dumps(spec())
    for media in ("text/plain", "application/x-yaml", "application/x-www-form-urlencoded", None):
        sent = {**headers, "Content-Type": media} if media else headers
        problem = _is_problem(client.post("/v1/builds", content=body, headers=sent), 415)
        assert "application/json" in problem["detail"]
    _is_problem(client.put("/v1/packages/pkg/aliases/stable", content='{"version": "1"}',
                           headers={**headers, "Content-Type": "text/plain"}), 415)
    _is_problem(client.post("/v1/builds", content=body, headers={"Content-Type": "text/plain"}), 401)
    for media in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        assert client.post("/v1/builds", content=body, headers={**headers, "Content-Type": media}).status_code in (
            200, 201)


def test_openapi_documents_every_error_as_a_problem_with_an_example(client):
    doc = client.get("/openapi.json").json()
    assert "Problem" in doc["components"]["schemas"] and "HTTPValidationError" not in doc["components"]["schemas"]
    operations = [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()]
    assert len(operations) >= 14
    for path, method, op in operations:
        codes = {int(c) for c in op["responses"]}
        assert 500 in codes, (path, method)
        if op.get("security"):
            assert 401 in codes, (path, method)
        if "requestBody" in op:
            assert 413 in codes and 422 in codes, (path, method)
        for code, response in op["responses"].items():
            if int(code) >= 400 and path != "/readyz":
                media = response["content"]["application/problem+json"]
                assert media["schema"] == {"$ref": "#/components/schemas/Problem"}
                assert media["example"]["status"] == int(code)
    submit = doc["paths"]["/v1/builds"]["post"]
    assert {"200", "201", "409", "429"} <= set(submit["responses"])
    assert submit["requestBody"]["content"]["application/json"]["example"]["publish"]["name"]
    download = doc["paths"]["/v1/packages/{name}/{version}/files/{path}"]["get"]
    assert {"200", "206", "307", "416"} <= set(download["responses"])


def test_health_readiness_and_signing_key(api, tmp_path, monkeypatch):
    client = TestClient(api.app)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    key = client.get("/v1/keys/signing").json()
    assert key["algorithm"] == "ed25519" and key["public_key"] == api.settings.public_key_b64()
    assert len(base64.b64decode(key["public_key"])) == 32

    def down() -> str:
        raise ConnectionError("store unreachable")

    api.app.state.ready_checks = {"database": lambda: "ok", "store": down}
    not_ready = client.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["checks"]["store"] == {"ok": False, "detail": "ConnectionError: store unreachable"}
    # The default checks include Ray, which this process has not joined (the integration tests
    # in the same session may have: pretend otherwise).
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    default = TestClient(create_app(api.settings))
    checks = default.get("/readyz").json()["checks"]
    assert checks["database"]["ok"] and checks["store"]["ok"] and not checks["ray"]["ok"]


def test_metrics_report_builds_queue_durations_gpu_seconds_and_lease_expiries(api):
    client = TestClient(api.app)
    headers = api.token("acme")
    done = client.post("/v1/builds", json=spec(version="1"), headers=headers).json()["id"]
    client.post("/v1/builds", json=spec(version="2"), headers=headers)
    finish_build(api, done, gpu_seconds=4.0)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    builds = {s.labels["state"]: s.value for s in families["elastify_builds"].samples}
    assert builds["succeeded"] == 1 and builds["queued"] == 1 and builds["failed"] == 0
    assert families["elastify_queue_depth"].samples[0].value == 3
    histogram = {(s.name, s.labels["stage_type"], s.labels.get("le")): s.value
                 for s in families["elastify_stage_duration_seconds"].samples}
    assert histogram[("elastify_stage_duration_seconds_bucket", "first", "1.0")] == 0
    assert histogram[("elastify_stage_duration_seconds_bucket", "first", "5.0")] == 1
    assert histogram[("elastify_stage_duration_seconds_sum", "first", None)] == 5.0
    gpu = {s.labels["stage_type"]: s.value for s in families["elastify_gpu_seconds"].samples if s.name.endswith("_total")}
    assert gpu == {"first": 4.0, "second": 4.0, "third": 4.0}
    assert families["elastify_lease_expiries"].samples[0].value == 0


def test_tokens_and_quota_commands(api, monkeypatch):
    from api.cli import app as cli

    monkeypatch.setenv("ELASTIFY_DATABASE_URL", api.settings.database_url)
    runner = CliRunner()
    created = runner.invoke(cli, ["tokens", "create", "--tenant", "newco"])
    assert created.exit_code == 0, created.output
    token = created.stdout.strip().splitlines()[-1]
    assert token.startswith("elst_")
    assert TestClient(api.app).get("/v1/builds", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    quota = runner.invoke(cli, ["tenants", "set-quota", "newco", "--gpu-hours-per-month", "5", "--max-concurrent-builds", "1"])
    assert quota.exit_code == 0, quota.output
    with api.sessions() as session:
        row = session.scalar(select(Tenant).where(Tenant.id == "newco"))
        assert (row.gpu_hours_per_month, row.max_concurrent_builds) == (5.0, 1)
    listed = runner.invoke(cli, ["tokens", "list", "--tenant", "newco"])
    assert listed.exit_code == 0 and "newco" in listed.output and token not in listed.output
    with api.sessions() as session:
        token_id = session.scalar(select(ApiToken.id).where(ApiToken.tenant_id == "newco"))
    assert runner.invoke(cli, ["tokens", "revoke", str(token_id)]).exit_code == 0
    assert TestClient(api.app).get("/v1/builds", headers={"Authorization": f"Bearer {token}"}).status_code == 401
    assert runner.invoke(cli, ["tokens", "revoke", "999"]).exit_code == 2
    bad = runner.invoke(cli, ["tokens", "create", "--tenant", "../etc"])
    assert bad.exit_code == 2 and "must match" in bad.output
    assert runner.invoke(cli, ["tenants", "set-quota", "newco"]).exit_code == 2


def test_cli_errors_print_brackets_as_text_not_as_rich_markup(api, monkeypatch):
    from api.cli import app as cli
    from cluster.spec import NAME_PATTERN

    monkeypatch.setenv("ELASTIFY_DATABASE_URL", api.settings.database_url)
    monkeypatch.setenv("COLUMNS", "200")
    refused = CliRunner().invoke(cli, ["tokens", "create", "--tenant", "Bad Tenant"])
    assert refused.exit_code == 2
    assert f"must match {NAME_PATTERN}" in refused.output and "[a-z0-9]" in NAME_PATTERN


def test_the_documents_examples_are_valid_instances_of_their_models(client):
    import api.schemas

    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    with_examples = {name: s["examples"] for name, s in schemas.items() if s.get("examples")}
    assert {"BuildOut", "BuildSummaryOut", "UsageReport", "PackageOut", "Problem", "SigningKey"} <= set(with_examples)
    for name, examples in with_examples.items():
        model = getattr(api.schemas, name, None)
        if model is None:  # the request model BuildSpec lives in cluster.spec
            continue
        for example in examples:
            model.model_validate(example)


def test_readiness_of_an_api_process_that_has_not_joined_ray_checks_the_cluster_address(api, monkeypatch):
    import dataclasses
    import socket

    monkeypatch.setattr("ray.is_initialized", lambda: False)  # as if the integration tests had not joined Ray

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        up = TestClient(create_app(dataclasses.replace(api.settings, ray_address=f"ray://127.0.0.1:{port}")))
        assert up.get("/readyz").json()["checks"]["ray"] == {"ok": True, "detail": f"ray://127.0.0.1:{port} accepts connections"}
    down = TestClient(create_app(dataclasses.replace(api.settings, ray_address=f"127.0.0.1:{port}")))
    response = down.get("/readyz")
    assert response.status_code == 503 and "ConnectionRefusedError" in response.json()["checks"]["ray"]["detail"]


def test_submit_checks_every_stage_setting_and_names_every_bad_field_before_writing(api):
    from cluster.models import Build, Stage

    client = TestClient(create_app(api.settings))  # the default registry: pipeline.chain's stages
    headers = api.token("acme")
    bad = spec(levels=[0.5, 0.4], stages={
        "elastify": {"settings": {"align": 0, "seed": "x"}},
        "profile": {"settings": {"windows": 0, "layer_method": "zzz"}},
        "recover": {"settings": {"steps": -1}},
        "clone-collect": {"enabled": True, "settings": {"budgets": []}},
        "recolour": {},
    })
    body = _is_problem(client.post("/v1/builds", json=bad, headers=headers), 422)
    errors = {e["field"]: e["message"] for e in body["errors"]}
    assert set(errors) == {"body.levels", "body.stages.elastify.settings.align", "body.stages.elastify.settings.seed",
                           "body.stages.profile.settings.windows", "body.stages.profile.settings.layer_method",
                           "body.stages.recover.settings.steps", "body.stages.clone-collect.settings.budgets",
                           "body.stages.recolour"}
    assert "'loo' or 'block_influence'" in errors["body.stages.profile.settings.layer_method"]
    assert "registered stages" in errors["body.stages.recolour"]
    with api.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Build)) == 0

    model = api.settings.home / "models" / "m"  # under the embedded default's source roots
    good = spec(levels=[0.5, 1.0], stages={"elastify": {"settings": {"align": 16}}}, source={"model": str(model)})
    created = client.post("/v1/builds", json=good, headers=headers)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["stages"] == {"elastify": {"enabled": True, "settings": {"align": 16},
                                                             "max_attempts": None, "resources": None}}
    with api.sessions() as session:
        elastify = session.scalar(select(Stage).where(Stage.key == "elastify"))
    # The stored settings are the validated model's: the spec's values, defaults and what the chain supplies.
    assert elastify.settings["align"] == 16 and elastify.settings["levels"] == [0.5, 1.0]
    assert elastify.settings["name"] == "test" and elastify.settings["anchor_fraction"] == 0.2


@pytest.mark.parametrize(("stage", "setting", "value"), [
    ("elastify", "align", 0), ("elastify", "align", "x"), ("profile", "windows", -1), ("profile", "layer_method", "zzz"),
])
def test_each_bad_setting_value_of_the_probe_is_a_422_naming_it_and_writes_nothing(api, stage, setting, value):
    from cluster.models import Build

    client = TestClient(create_app(api.settings))  # the default registry: pipeline.chain's stages
    response = client.post("/v1/builds", json=spec(levels=[0.5, 1.0], stages={stage: {"settings": {setting: value}}}),
                           headers=api.token("acme"))
    body = _is_problem(response, 422)
    assert [e["field"] for e in body["errors"]] == [f"body.stages.{stage}.settings.{setting}"]
    with api.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Build)) == 0


def test_a_research_lever_is_checked_under_experimental_and_unknown_at_the_top(api):
    client = TestClient(create_app(api.settings))  # the default registry: pipeline.chain's stages
    headers = api.token("acme")
    for settings, field, says in [
        ({"experimental": {"unlikelihood": 1.0}}, "body.stages.recover.settings.experimental", "on_policy above 0"),
        ({"loss": "lm", "experimental": {"on_policy": 0.5}}, "body.stages.recover.settings.experimental", "'distill'"),
        ({"experimental": {"on_policy": 2.0}}, "body.stages.recover.settings.experimental.on_policy", "1"),
        ({"on_policy": 0.5}, "body.stages.recover.settings.on_policy", "'experimental'"),  # its old place
    ]:
        response = client.post("/v1/builds", json=spec(levels=[0.5, 1.0], stages={"recover": {"settings": settings}}),
                               headers=headers)
        errors = {e["field"]: e["message"] for e in _is_problem(response, 422)["errors"]}
        assert list(errors) == [field] and says in errors[field], errors

    model = api.settings.home / "models" / "m"  # under the embedded default's source roots
    good = spec(levels=[0.5, 1.0], source={"model": str(model)},
                stages={"recover": {"settings": {"experimental": {"on_policy": 0.5, "unlikelihood": 1.0}}}})
    created = client.post("/v1/builds", json=good, headers=headers)
    assert created.status_code == 201, created.text


def test_openapi_shows_every_stages_settings_schema(api):
    from api.app import default_registry

    doc = TestClient(create_app(api.settings)).get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    stages = schemas["Stages"]["properties"]
    assert set(stages) == {stage.name for stage in default_registry()}
    assert schemas["Stages"]["additionalProperties"] is False
    for stage in default_registry():
        settings = stage.settings.__name__
        if stage.settings.model_fields:
            assert set(schemas[settings]["properties"]) == set(stage.settings.model_fields), settings
    elastify = schemas["ElastifySettings"]["properties"]
    assert elastify["align"]["exclusiveMinimum"] == 0 and elastify["order"]["enum"] == ["taylor", "random"]
    assert schemas["ProfileSettings"]["properties"]["layer_method"]["enum"] == ["loo", "block_influence"]
    body = doc["paths"]["/v1/builds"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/BuildSpec"}
