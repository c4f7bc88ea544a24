"""The OpenAPI document against the live API: schemathesis generates requests for every operation
(uvicorn on 127.0.0.1, PostgreSQL, an authenticated tenant) and finds no 5xx and no response that
the document does not describe."""

from __future__ import annotations

import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import ServerThread
from tests.support import services
from tests.support.api import finish_build, make_api, publish_files, spec

pytestmark = pytest.mark.integration
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def live_api(postgres_server, tmp_path_factory):
    """The API on a free loopback port with one finished build and a published package to find."""
    tmp_path = tmp_path_factory.mktemp("schemathesis")
    api = make_api(tmp_path, services.create_database(postgres_server, f"t_{uuid.uuid4().hex[:10]}"))
    headers = api.token("acme")
    from fastapi.testclient import TestClient

    build_id = TestClient(api.app).post("/v1/builds", json=spec(name="smol", version="1.0"), headers=headers).json()["id"]
    finish_build(api, build_id, gpu_seconds=2.0)
    publish_files(api, build_id, "smol", "1.0", {"model/config.json": b"{}"}, tmp_path)
    with ServerThread(api.app, port=services.free_port()) as server:
        yield server.url, headers


def test_every_operation_conforms_and_never_fails_on_the_server(live_api):
    # Each operation gets its own Hypothesis run (schemathesis' pytest plugin does not support pytest 9).
    url, headers = live_api
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures, operations, calls = {}, 0, []
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.generate], derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        def conforms(case):
            calls.append(case.operation.label)
            case.call_and_validate(headers=headers, checks=CHECKS, timeout=30)

        try:
            conforms()
        except Exception as err:  # one operation's failure must not hide another's
            failures[operation.label] = f"{type(err).__name__}: {err}"[:2000]
    assert operations >= 14
    assert len(set(calls)) == operations and len(calls) >= 10 * operations
    assert not failures, "\n\n".join(f"{label}:\n{error}" for label, error in failures.items())
