"""/docs is served from the installed Swagger UI files: the page names no other host, and what it loads is served."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient


def test_docs_reference_no_external_url_and_every_asset_they_load_is_served(api):
    client = TestClient(api.app)
    page = client.get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "://" not in page.text, "the docs page names another host"
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(assets)
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200 and response.content, asset
    assert "openapi.json" in page.text and client.get("/openapi.json").status_code == 200
    assert client.get("/docs/oauth2-redirect").status_code == 200
