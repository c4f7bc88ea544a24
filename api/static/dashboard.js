"use strict";
// The GPU-hour dashboard: reads /v1/usage and /v1/builds with the caller's bearer token and
// redraws every few seconds. The token comes from the URL fragment (#token=…, which never
// reaches the server's logs) or the login field, and is kept in sessionStorage only.
(() => {
  const KEY = "elastify-token";
  const $ = (id) => document.getElementById(id);
  let refreshMs = 5000;
  let timer = null;
  let generation = 0;  // bumped on every start/logout: answers for an older token are dropped
  // Whether the fragment or the viewer picked GPU- or CPU-hours; until then the page picks (chooseMetric).
  let metricChosen = false;

  // Settings from the fragment: #token=…&refresh=ms&metric=gpu|cpu. The token moves to sessionStorage and
  // out of the address bar.
  function readFragment() {
    const params = new URLSearchParams(location.hash.slice(1));
    if (params.get("refresh")) refreshMs = Math.max(1000, Number(params.get("refresh")) || 5000);
    if (params.get("metric") in METRICS) { $("metric").value = params.get("metric"); metricChosen = true; }
    if (params.get("token")) sessionStorage.setItem(KEY, params.get("token"));
    if (location.hash) history.replaceState(null, "", location.pathname + location.search);
  }

  class Unauthorised extends Error {}

  async function api(path) {
    const response = await fetch(path, { headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY)}`,
      Accept: "application/json" } });
    if (response.status === 401) throw new Unauthorised("the token was not accepted");
    if (!response.ok) {
      let problem = {};
      try { problem = await response.json(); } catch (_) { /* not problem+json */ }
      throw new Error(`${path}: ${response.status} ${problem.title || response.statusText}` +
        (problem.detail ? ` (${problem.detail})` : ""));
    }
    return response.json();
  }

  const hours = (seconds) => seconds / 3600;
  const METRICS = { gpu: { name: "GPU-hours", short: "GPU h" }, cpu: { name: "CPU-hours", short: "CPU h" } };
  const metric = () => $("metric").value;  // "gpu" or "cpu": which *_hours / *_seconds field is drawn

  // GPU-hours when any GPU time was ever recorded, else CPU-hours: a CPU-only deployment's GPU charts would
  // be empty. Re-decided on every refresh until the viewer picks, so the first GPU stage switches the page.
  function chooseMetric(byTenant) {
    if (metricChosen) return;
    $("metric").value = byTenant.rows.some((row) => row.gpu_seconds > 0) ? "gpu" : "cpu";
  }

  function daysByStageType(report, field) {
    const days = [...new Set(report.rows.map((row) => row.day))].sort();
    const types = [...new Set(report.rows.map((row) => row.stage_type))].sort();
    const series = types.map((type) => ({
      name: type,
      values: days.map((day) => report.rows.filter((r) => r.day === day && r.stage_type === type)
        .reduce((sum, r) => sum + r[field], 0)),
    }));
    return { days, series };
  }

  function renderBuilds(page) {
    const body = $("builds").tBodies[0];
    body.replaceChildren(...page.items.map((build) => {
      const row = document.createElement("tr");
      row.dataset.build = build.id;
      row.dataset.status = build.status;
      const cell = (content, className) => {
        const td = document.createElement("td");
        if (className) td.className = className;
        if (content instanceof Node) td.appendChild(content); else td.textContent = content;
        row.appendChild(td);
        return td;
      };
      cell(build.id);
      cell(`${build.name} ${build.version}`);
      cell(build.tenant);
      const status = document.createElement("span");
      status.className = `status ${build.status}`;
      status.textContent = build.status;
      cell(status);
      const bar = document.createElement("div");
      bar.className = `progress ${build.status}`;
      bar.title = `${build.stages_done} of ${build.stages_total} stages`;
      const fill = document.createElement("div");
      fill.style.width = `${(100 * build.progress).toFixed(1)}%`;
      fill.dataset.progress = build.progress;
      bar.appendChild(fill);
      const progress = document.createElement("span");
      progress.append(bar, ` ${build.stages_done}/${build.stages_total}`);
      cell(progress);
      cell(Charts.format(hours(build[`${metric()}_seconds`])), "num");
      cell(new Date(build.created_at + (build.created_at.endsWith("Z") ? "" : "Z")).toLocaleString(), "num");
      return row;
    }));
  }

  async function refresh(run) {
    clearTimeout(timer);
    try {
      const [byDay, byTenant, byBuild, builds] = await Promise.all([
        api("/v1/usage?group_by=day&group_by=stage_type"),
        api("/v1/usage?group_by=tenant"),
        api("/v1/usage?group_by=build"),
        api("/v1/builds?limit=50"),
      ]);
      if (run !== generation) return;
      chooseMetric(byTenant);
      const field = `${metric()}_hours`, { name, short } = METRICS[metric()];
      document.querySelectorAll(".metric-name").forEach((span) => { span.textContent = name; });
      $("metric-column").textContent = short;
      const { days, series } = daysByStageType(byDay, field);
      Charts.stackedBars($("chart-days"), days, series, { unit: short, label: `${name} per day by stage type` });
      Charts.horizontalBars($("chart-tenants"),
        byTenant.rows.map((r) => ({ label: r.tenant, value: r[field] })).sort((a, b) => b.value - a.value),
        { unit: short, label: `${name} per tenant`, colourIndex: 2 });
      const names = Object.fromEntries(builds.items.map((b) => [b.id, `${b.name} ${b.version}`]));
      Charts.horizontalBars($("chart-builds"),
        byBuild.rows.filter((r) => r[field] > 0).sort((a, b) => b[field] - a[field]).slice(0, 10)
          .map((r) => ({ label: r.build, value: r[field], title: names[r.build] ? `${r.build} (${names[r.build]})` : r.build })),
        { unit: short, label: `top builds by ${name}`, colourIndex: 4, emptyText: `no ${name} recorded yet` });
      renderBuilds(builds);
      $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}, every ${refreshMs / 1000} s`;
      $("error").hidden = true;
      $("panels").hidden = false;
      document.body.dataset.refreshes = Number(document.body.dataset.refreshes || 0) + 1;
    } catch (error) {
      if (run !== generation) return;
      if (error instanceof Unauthorised) return logout(error.message);
      $("error").textContent = String(error.message || error);
      $("error").hidden = false;
    }
    timer = setTimeout(() => refresh(run), refreshMs);
  }

  function logout(message) {
    generation += 1;
    clearTimeout(timer);
    sessionStorage.removeItem(KEY);
    $("panels").hidden = true;
    $("logout").hidden = true;
    $("metric-choice").hidden = true;
    $("login").hidden = false;
    $("error").textContent = message || "";
    $("error").hidden = !message;
  }

  function start() {
    $("login").hidden = true;
    $("logout").hidden = false;
    $("metric-choice").hidden = false;
    generation += 1;
    refresh(generation);
  }

  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("token").value.trim());
    $("token").value = "";
    start();
  });
  $("logout").addEventListener("click", () => logout());
  $("metric").addEventListener("change", () => { metricChosen = true; start(); });
  function begin() {
    metricChosen = false;
    readFragment();
    if (sessionStorage.getItem(KEY)) start(); else logout();
  }
  window.addEventListener("hashchange", begin);  // a new #token=… on the open page switches to it
  begin();
})();
