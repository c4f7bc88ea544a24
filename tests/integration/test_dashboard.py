"""/dashboard in headless Chromium (Debian chromium + chromedriver, driven by selenium), over real builds:
PostgreSQL, SeaweedFS, Ray with 2 fake GPUs, a scheduler, and the API on loopback. The charts must show
what /v1/usage reports, the build list must follow a running build to the end, each tenant must see
only its own data, and a screenshot is kept in tests/artifacts/dashboard.png."""

from __future__ import annotations

import shutil
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import ServerThread, create_app
from api.auth import create_token
from device_sdk.client import ElastifyClient
from pipeline.contract import Resources
from tests.support import services
from tests.support.api import spec
from tests.support.control_plane import chain_registry, make_settings, started
from workers import testing

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Chromium on a closed network: no background fetches, no sandbox (root in CI), fixed window size.
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1000"]
TYPES = ["first", "second", "third"]


def gpu_seconds_served(url: str, stage_type: str) -> float:
    """elastify_gpu_seconds_total of one stage type, as Prometheus would scrape it."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(s.value for f in families if f.name == "elastify_gpu_seconds" for s in f.samples
               if s.name.endswith("_total") and s.labels["stage_type"] == stage_type)


def three_sleeps(first: float, rest: float = 0.3) -> dict:
    """Stage settings for chain_registry(workers.testing.sleep): the first stage sleeps `first` seconds."""
    return {"first": {"settings": {"seconds": first}}, "second": {"settings": {"seconds": rest}},
            "third": {"settings": {"seconds": rest}}}


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Chromium and chromedriver are needed (Debian chromium, chromium-driver): run `make services`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(condition, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met after {timeout} s")
        time.sleep(0.1)


def refreshes(driver) -> int:
    return int(driver.execute_script("return Number(document.body.dataset.refreshes || 0)"))


def bars(driver, chart: str) -> list[dict]:
    """Every bar of a chart as drawn: its data attributes and geometry."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' rect.bar')].map(r => ({"
        "category: r.dataset.category, series: r.dataset.series || null, value: Number(r.dataset.value),"
        "height: Number(r.getAttribute('height')), width: Number(r.getAttribute('width'))}))", f"#{chart}")


def table_rows(driver) -> dict[str, dict]:
    return {row["build"]: row for row in driver.execute_script(
        "return [...document.querySelectorAll('#builds tbody tr')].map(tr => ({build: tr.dataset.build,"
        "status: tr.dataset.status, progress: Number(tr.querySelector('[data-progress]').dataset.progress),"
        "width: parseFloat(tr.querySelector('[data-progress]').style.width)}))")}


def proportional(drawn: list[dict], size: str) -> None:
    """One scale for every bar of a chart: size / value is the same for all."""
    scales = [bar[size] / bar["value"] for bar in drawn]
    assert max(scales) == pytest.approx(min(scales), rel=1e-6), drawn


def test_dashboard_charts_real_builds_and_follows_a_running_one(tmp_path, pg_url, s3_store, ray_cluster, browser,
                                                                artifacts_dir):
    settings = make_settings(tmp_path, pg_url, s3_store)
    # One GPU per stage: each attempt records wall seconds × 1 GPU on the ledger.
    registry = chain_registry(testing.sleep, resources=Resources(num_cpus=0.5, num_gpus=1))
    scheduler = started(settings, registry)
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.run, kwargs={"until": stop.is_set}, daemon=True)
    loop.start()
    app = create_app(settings, registry)
    admin = create_token(app.state.sessions, "ops", admin=True)
    tokens = {tenant: create_token(app.state.sessions, tenant) for tenant in ("acme", "beta", "gamma")}
    try:
        with ServerThread(app, port=services.free_port()) as server:
            clients = {tenant: ElastifyClient(server.url, token=token) for tenant, token in tokens.items()}
            everyone = ElastifyClient(server.url, token=admin)
            finished = [clients["acme"].submit(spec("acme-model", "1", stages=three_sleeps(1.0), cache=False)).id,
                        clients["beta"].submit(spec("beta-model", "1", stages=three_sleeps(0.5), cache=False)).id]
            for build_id in finished:
                wait_for(lambda b=build_id: everyone.build(b).status == "succeeded", what=f"build {build_id}")

            # A third build runs while the page is open: its row must move from running to succeeded.
            running = clients["acme"].submit(spec("acme-model", "2", stages=three_sleeps(8.0), cache=False)).id
            wait_for(lambda: everyone.build(running).status == "running", what="the third build running")
            browser.get(f"{server.url}/dashboard#token={admin}&refresh=1000")
            assert admin not in browser.current_url  # the page drops the token from the address bar
            live = wait_for(lambda: table_rows(browser).get(running), what="the running build listed")
            # Mid-stage, /metrics already charges the running attempt (from its progress events): the GPU-seconds
            # counter of its stage type passes what the finished attempts' rows hold.
            ended = {r.stage_type: r.gpu_seconds for r in everyone.usage(group_by=["stage_type"]).rows}
            wait_for(lambda: gpu_seconds_served(server.url, "first") > ended["first"]
                     and everyone.build(running).status == "running", what="GPU-seconds advancing while the stage runs")
            assert live["status"] == "running" and live["progress"] < 1
            wait_for(lambda: everyone.build(running).status == "succeeded", what="the third build finishing")
            usage_by_day = everyone.usage(group_by=["day", "stage_type"]).raw  # the JSON, as the page reads it
            usage_by_tenant = everyone.usage(group_by=["tenant"]).raw
            usage_by_build = everyone.usage(group_by=["build"]).raw
            seen = refreshes(browser)
            wait_for(lambda: refreshes(browser) >= seen + 2, what="two page refreshes")  # both after the last attempt
            rows = table_rows(browser)
            assert {b: (r["status"], r["progress"], r["width"]) for b, r in rows.items()} == {
                b: ("succeeded", 1, 100) for b in [*finished, running]}
            browser.save_screenshot(str(artifacts_dir / "dashboard.png"))
            # GPU time was recorded, so the page shows GPU-hours without being asked.
            assert browser.execute_script("return document.getElementById('metric').value") == "gpu"

            # GPU-hours per day, stacked by stage type: one rect per (day, stage type), values from /v1/usage.
            today = datetime.now(UTC).date().isoformat()
            expected = {(r["day"], r["stage_type"]): r["gpu_hours"] for r in usage_by_day["rows"]}
            assert {day for day, _ in expected} == {today} and {t for _, t in expected} == set(TYPES)
            drawn = bars(browser, "chart-days")
            assert {(b["category"], b["series"]): b["value"] for b in drawn} == pytest.approx(expected, rel=1e-9)
            proportional(drawn, "height")
            assert all(b["height"] > 0 for b in drawn)
            total = browser.execute_script(
                "return document.querySelector('#chart-days text.total[data-category=\"' + arguments[0] + '\"]')"
                ".textContent", today)
            assert float(total) == pytest.approx(usage_by_day["total_gpu_hours"], rel=5e-3)  # 3 significant digits
            # Each build ran 3 stages with 1 GPU: its GPU time is at least the seconds it slept.
            assert usage_by_day["total_gpu_hours"] * 3600 >= (1.0 + 0.6) + (0.5 + 0.6) + (8.0 + 0.6)

            # GPU-hours per tenant (the admin sees every tenant).
            drawn = bars(browser, "chart-tenants")
            assert {b["category"]: b["value"] for b in drawn} == pytest.approx(
                {r["tenant"]: r["gpu_hours"] for r in usage_by_tenant["rows"]}, rel=1e-9)
            assert {b["category"] for b in drawn} == {"acme", "beta"}
            proportional(drawn, "width")

            # The top builds, largest first, with their values printed beside the bars.
            drawn = bars(browser, "chart-builds")
            by_build = sorted(((r["gpu_hours"], r["build"]) for r in usage_by_build["rows"]), reverse=True)
            assert [b["category"] for b in drawn] == [build for _, build in by_build]
            assert [b["value"] for b in drawn] == pytest.approx([hours for hours, _ in by_build], rel=1e-9)
            proportional(drawn, "width")
            labels = browser.execute_script(
                "return [...document.querySelectorAll('#chart-builds text.value')].map(t => t.textContent)")
            assert [float(label) for label in labels] == pytest.approx([v for v, _ in by_build], rel=5e-3)

            # The same charts in CPU-hours (what a CPU-only deployment records).
            from selenium.webdriver.support.ui import Select

            Select(browser.find_element("id", "metric")).select_by_value("cpu")
            cpu = {(r["day"], r["stage_type"]): r["cpu_hours"] for r in usage_by_day["rows"]}
            wait_for(lambda: {(b["category"], b["series"]): b["value"] for b in bars(browser, "chart-days")} == cpu,
                     what="the CPU-hour bars")
            proportional(bars(browser, "chart-days"), "height")
            assert "CPU-hours per day" in browser.find_element("css selector", "#chart-days").find_element(
                "xpath", "..").text
            Select(browser.find_element("id", "metric")).select_by_value("gpu")

            # A tenant's token shows that tenant's data only.
            browser.get(f"{server.url}/dashboard#token={tokens['beta']}&refresh=1000")
            wait_for(lambda: set(table_rows(browser)) == {finished[1]}, what="beta's own builds only")
            assert {b["category"] for b in bars(browser, "chart-tenants")} == {"beta"}
            assert {b["category"] for b in bars(browser, "chart-builds")} == {finished[1]}
            # A tenant that never used a GPU is shown CPU-hours by default.
            browser.get(f"{server.url}/dashboard#token={tokens['gamma']}&refresh=1000")
            wait_for(lambda: "CPU-hours per day" in browser.find_element("id", "panels").text, what="CPU-hours for gamma")
            assert browser.execute_script("return document.getElementById('metric').value") == "cpu"

            # A bad token: the login form comes back with the reason, and nothing is drawn.
            browser.get(f"{server.url}/dashboard#token=elst_wrong")
            wait_for(lambda: browser.execute_script("return !document.getElementById('login').hidden"),
                     what="the login form")
            assert "not accepted" in browser.find_element("id", "error").text
            assert browser.execute_script("return document.getElementById('panels').hidden")
            # The login field: a good token shows the data again, and only sessionStorage keeps it.
            browser.find_element("id", "token").send_keys(tokens["acme"])
            browser.find_element("css selector", "#login button").click()
            wait_for(lambda: set(table_rows(browser)) == {finished[0], running}, what="acme's builds after login")
            assert browser.execute_script("return sessionStorage.getItem('elastify-token')") == tokens["acme"]
            assert tokens["acme"] not in browser.current_url
    finally:
        stop.set()
        loop.join(timeout=60)
        scheduler.close()
