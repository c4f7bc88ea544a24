"""A frozen dependency cannot freeze the API (46.6): readiness checks time out on threads of their own,
and /healthz and sync routes keep answering while 50 /readyz wait on a check that never returns."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from api.routes import health


def test_fifty_readyz_on_a_frozen_store_leave_healthz_and_sync_routes_answering(api, monkeypatch):
    monkeypatch.setattr(health, "READY_CHECK_TIMEOUT_S", 0.5)
    thawed = threading.Event()

    def frozen_store() -> str:  # what a SIGSTOPped store looks like to boto3: a call that does not return
        thawed.wait(30)
        return "reachable"

    api.app.state.ready_checks = {"database": lambda: "reachable", "store": frozen_store}

    async def scenario():
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            readiness = [asyncio.create_task(client.get("/readyz")) for _ in range(50)]
            await asyncio.sleep(0.1)  # the readiness checks are now waiting on the store
            started = time.monotonic()
            # /v1/keys/signing is a sync route: it needs a thread of the shared pool the checks used to take.
            healthz, signing = await asyncio.gather(client.get("/healthz"), client.get("/v1/keys/signing"))
            others_s = time.monotonic() - started
            answers = await asyncio.wait_for(asyncio.gather(*readiness), 10)
            return healthz, signing, others_s, answers, time.monotonic() - started

    try:
        healthz, signing, others_s, answers, readyz_s = asyncio.run(scenario())
    finally:
        thawed.set()
    assert healthz.json() == {"status": "ok"} and signing.status_code == 200 and others_s < 2
    assert readyz_s < 2
    assert {a.status_code for a in answers} == {503}
    assert {a.json()["checks"]["store"]["detail"] for a in answers} == {"no answer within 0.5 s"}
    assert all(a.json()["checks"]["database"]["ok"] for a in answers)
