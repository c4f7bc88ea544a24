"""Pull through the API when the store is S3 (SeaweedFS): the API answers every file with a 307 to a
presigned URL, and the SDK follows it without the bearer token, with Range, resuming and verifying."""

from __future__ import annotations

import pytest

from device_sdk.client import ElastifyClient
from device_sdk.format import WEIGHTS
from device_sdk.registry import pull, read_local_state, verify_local
from tests.support.live_api import KEY_SEED, api_with_packages
from tests.support.sdk_packages import public_bytes, signing_key

pytestmark = pytest.mark.integration
KEY = public_bytes(signing_key(KEY_SEED))


def test_pull_through_the_api_from_presigned_s3_urls(tmp_path, pg_url, s3_store, monkeypatch):
    from device_sdk import registry as registry_module

    monkeypatch.setattr(registry_module, "CHUNK", 4096)
    sent = []  # every request the client made: (host, had an Authorization header, Range)

    with api_with_packages(tmp_path, database_url=pg_url, store=s3_store) as live:
        client = ElastifyClient(live.url, token=live.acme)

        def recording(request):  # an httpx event hook: every request sent, redirects included
            sent.append((request.url.netloc.decode(), "Authorization" in request.headers, request.headers.get("Range")))

        client.http.event_hooks = {"request": [recording], "response": []}

        class Interrupted(Exception):
            pass

        def stop_half_way(done, total):
            if done > total // 2:
                raise Interrupted

        cache = tmp_path / "cache"
        with pytest.raises(Interrupted):
            pull("tiny", "latest", registry=client, public_key=KEY, cache_dir=cache, workers=1,
                 on_progress=stop_half_way)
        first_pass = len(sent)
        path = pull("tiny", "latest", registry=client, public_key=KEY, cache_dir=cache, workers=1)
        verify_local(path, KEY)
        partial = pull("tiny", "1.0.0", registry=client, public_key=KEY, cache_dir=tmp_path / "partial",
                       max_level=0.5)
        assert read_local_state(partial)["max_level"] == "0.5"
        verify_local(partial, KEY)

    api_host = live.url.removeprefix("http://")
    s3_host = s3_store.endpoint_url.removeprefix("http://")
    assert {host for host, _, _ in sent} == {api_host, s3_host}  # files came from the object store
    assert all(not auth for host, auth, _ in sent if host == s3_host)  # the token never left the API
    assert all(auth for host, auth, _ in sent if host == api_host)
    resumed = [r for host, _, r in sent[first_pass:] if host == s3_host and r and not r.startswith("bytes=0-")]
    assert resumed  # the second pull asked the store for the rest only
    assert (path / WEIGHTS).stat().st_size == (live.packages["1.0.0"] / WEIGHTS).stat().st_size
