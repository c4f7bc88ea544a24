"""/dashboard: one HTML page and its own script, style and SVG chart code, served from api/static/.

No CDN and no third-party code: the page draws its charts itself (api/static/charts.js) from
the same /v1/usage and /v1/builds endpoints any client uses, with the caller's bearer token.
The page and its assets are public; the data behind them is not.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
ASSETS = {  # the only files served: no path from the request reaches the filesystem
    "dashboard.js": "text/javascript",
    "charts.js": "text/javascript",
    "dashboard.css": "text/css",
}
# The page loads only its own scripts and styles and talks only to this origin.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/dashboard")
def dashboard_page() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers=SECURITY_HEADERS)


@router.get("/dashboard/{asset}")
def dashboard_asset(asset: str) -> FileResponse:
    if asset not in ASSETS:
        raise HTTPException(status_code=404, detail=f"no dashboard asset {asset!r}")
    return FileResponse(STATIC / asset, media_type=ASSETS[asset], headers=SECURITY_HEADERS)
