"""Issue 16's probe in `make test`: a hostile tenant's inputs against a live `elastify up` on the session's
PostgreSQL, SeaweedFS and Ray (tests/support/probe_service.py) are all refused, nothing hangs, /healthz keeps
answering, and nothing they sent is left in the database or the store."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support import services
from tests.support.probe_service import probe

pytestmark = pytest.mark.integration

# Every kind of input the probe replays; a case list that lost a group would pass vacuously.
GROUPS = {"levels", "settings", "capacity", "sources", "traversal", "query", "body size", "content type",
          "cross-tenant", "device"}


def test_a_hostile_tenant_is_refused_everything_and_leaves_nothing_behind(tmp_path, postgres_server, seaweedfs,
                                                                          ray_cluster):
    database_url = services.create_database(postgres_server, f"t_{uuid.uuid4().hex[:10]}")
    results = probe(tmp_path / "probe", database_url, f"s3://t-{uuid.uuid4().hex[:10]}/elastify", seaweedfs,
                    ray_cluster)
    (tmp_path / "probe_service.json").write_text(json.dumps(results, indent=2))
    cases = results["cases"]

    assert {case["group"] for case in cases} == GROUPS
    accepted = [f"{c['group']}/{c['name']}: {c['outcome']} {c['message']}" for c in cases if not c["refused"]]
    assert accepted == [], "\n".join(accepted)
    assert results["hangs"] == []
    for case in cases:  # a refusal says why: the API with its 4xx, elastify-device with a non-zero exit
        assert case["message"], case
        if case["expected"].isdigit():
            assert case["outcome"] == int(case["expected"]) and 400 <= case["outcome"] < 500, case
        elif case["expected"] == "refused":
            assert case["outcome"] not in (0, None), case
    controls = results["controls"]  # what B is refused, A gets; a tampered installed copy is replaced
    assert controls["A's build"] == "succeeded" and controls["A's usage rows"] > 0, controls
    assert controls["A reads its manifest"] == 200 and controls["refused pulls installed nothing"], controls
    assert controls["pull replaced a copy altered after install"], controls
    health = results["healthz"]
    assert health["failures"] == [] and health["polls"] >= 10, health
    assert results["rows_changed"] == {}
    assert results["objects_added"] == [] and results["objects_removed"] == []
    assert results["upload_scratch_left"] == []
