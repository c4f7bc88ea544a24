"""The real thing, small: SmolLM2 profile → elastify → evaluate → publish on Ray, PostgreSQL and SeaweedFS.

The ElastiLM stages are switched off here; tests/integration/test_elastilm_chain.py runs them.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from api.app import default_registry
from cluster.models import Alias, Package
from cluster.packages import package_prefix
from cluster.service import build_summary, submit_build
from cluster.spec import parse_spec
from device_sdk.trust import verify_package
from tests.support.control_plane import make_settings, small_elastic_spec, started

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smollm2_build_publishes_a_signed_verified_package(tmp_path, smollm2_dir, pg_url, s3_store, ray_cluster):
    settings = make_settings(tmp_path, pg_url, s3_store, lease_seconds=30.0)
    registry = default_registry()
    spec = parse_spec(small_elastic_spec(smollm2_dir, "smollm2-test", ["latest", "stable"]))
    scheduler = started(settings, registry)
    try:
        build_id = submit_build(scheduler.sessions, spec, registry)
        scheduler.run_until_done([build_id], timeout=900)
        summary = build_summary(scheduler.sessions, build_id)
        assert summary["status"] == "succeeded", summary
        assert [s["key"] for s in summary["stages"]] == ["profile", "elastify", "evaluate", "publish"]

        # Download the published package from S3 and verify every file and the signature.
        prefix = package_prefix("smollm2-test", "0.0.1")
        local = tmp_path / "pulled"
        for key in scheduler.store.list(prefix):
            scheduler.store.get_file(key, local / key[len(prefix) + 1 :])
        manifest = verify_package(local, settings.public_key_b64())
        assert manifest.build_id == build_id
        assert [level.name for level in manifest.elastic.levels] == ["0.5", "1.0"]
        assert all("ppl:ptb:test" in level.quality for level in manifest.elastic.levels)
        with scheduler.sessions() as session:
            package = session.scalar(select(Package).where(Package.name == "smollm2-test"))
            aliases = {a.alias: a.package_id for a in session.scalars(select(Alias))}
        assert package.uri == prefix and aliases == {"latest": package.id, "stable": package.id}

        # An identical resubmission is served from the cache and publishing it again is a no-op.
        again = submit_build(scheduler.sessions, spec, registry)
        scheduler.run_until_done([again], timeout=300)
        repeat = build_summary(scheduler.sessions, again)
        assert repeat["status"] == "succeeded" and repeat["cache_hits"] == 4
        assert all(s["attempts"] == [] for s in repeat["stages"])
        assert repeat["package"]["uri"] == prefix
    finally:
        scheduler.close()
