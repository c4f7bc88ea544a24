"""The monitoring files in infra/ against what `/metrics` serves: the Grafana dashboard's every PromQL expression
(parsed by a real PromQL parser, each value of its variables substituted) names only metrics, labels and label
values that the app serves, and charts every metric it serves; the Prometheus scrape config and the Kubernetes
ServiceMonitor reach the API's /metrics. And the CPU-seconds counter beside the GPU-seconds one, advancing while
attempts run."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import promql_parser
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from cluster.models import Attempt, Event, Stage, utcnow
from tests.support.api import finish_build, spec

INFRA = Path(__file__).resolve().parents[3] / "infra"
DASHBOARD = INFRA / "grafana" / "elastify-dashboard.json"
# Grafana's own variables, as it substitutes them before the query reaches Prometheus.
GRAFANA_BUILTINS = {"__rate_interval": "2m", "__interval": "30s", "__range": "24h", "__range_s": "86400",
                    "__range_ms": "86400000", "__interval_ms": "30000"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def served_metrics(api) -> dict[str, dict[str, set[str]]]:
    """{sample name: {label: values}} of /metrics, after one finished build (so every family has samples)."""
    client = TestClient(api.app)
    headers = api.token("acme")
    build_id = client.post("/v1/builds", json=spec(version="1"), headers=headers).json()["id"]
    client.post("/v1/builds", json=spec(version="2"), headers=headers)  # one left queued
    finish_build(api, build_id, gpu_seconds=4.0, cpu_seconds=3.0)
    served: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = served.setdefault(sample.name, {})
            for name, value in sample.labels.items():
                labels.setdefault(name, set()).add(value)
    return served


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target, in rows and nested panels too."""
    found = []

    def visit(panels):
        for panel in panels:
            found.extend((panel["title"], target["expr"]) for target in panel.get("targets", []) if "expr" in target)
            visit(panel.get("panels", []))

    visit(dashboard["panels"])
    return found


def expand(expr: str, variables: dict[str, list[str]]) -> list[str]:
    """The expression once per combination of the values of the dashboard variables it uses."""
    used = sorted({next(filter(None, match.groups())) for match in VARIABLE.finditer(expr)} - set(GRAFANA_BUILTINS))
    unknown = [name for name in used if name not in variables]
    assert not unknown, f"{expr!r} uses variables the dashboard does not define: {unknown}"
    expanded = []
    for values in itertools.product(*(variables[name] for name in used)):
        bound = {**GRAFANA_BUILTINS, **dict(zip(used, values, strict=True))}
        expanded.append(VARIABLE.sub(lambda match, bound=bound: bound[next(filter(None, match.groups()))], expr))
    return expanded


def selectors(node) -> list[tuple[str | None, list, list[str]]]:
    """(metric name, label matchers, labels of enclosing `by`/`without` clauses) of every vector selector."""
    found = []

    def visit(node, grouping: list[str]):
        match node:
            case promql_parser.VectorSelector():
                names = [m.value for m in node.matchers.matchers if m.name == "__name__"]
                assert all(m.op == promql_parser.MatchOp.Equal for m in node.matchers.matchers if m.name == "__name__"), \
                    "a regex on __name__ cannot be checked against /metrics"
                found.append((node.name or (names[0] if names else None), node.matchers.matchers, grouping))
            case promql_parser.MatrixSelector():
                visit(node.vector_selector, grouping)
            case promql_parser.Call():
                for arg in node.args:
                    visit(arg, grouping)
            case promql_parser.AggregateExpr():
                labels = list(node.modifier.labels) if node.modifier is not None else []
                visit(node.expr, grouping + labels)
                if node.param is not None:
                    visit(node.param, grouping)
            case promql_parser.BinaryExpr():
                visit(node.lhs, grouping)
                visit(node.rhs, grouping)
            case promql_parser.ParenExpr() | promql_parser.UnaryExpr() | promql_parser.SubqueryExpr():
                visit(node.expr, grouping)
            case promql_parser.NumberLiteral() | promql_parser.StringLiteral():
                pass
            case _:  # a node this walk does not know could hide a metric name: fail rather than skip it
                raise AssertionError(f"unhandled PromQL node {type(node).__name__}")

    visit(node, [])
    return found


def test_every_dashboard_expression_names_only_what_metrics_serves_and_charts_all_of_it(api):
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {var["name"]: [option["value"] for option in var.get("options", [])]
                 for var in dashboard["templating"]["list"] if var["type"] == "custom"}
    assert variables == {"resource": ["gpu", "cpu"]}  # the GPU-hours / CPU-hours switch
    datasources = {var["name"] for var in dashboard["templating"]["list"] if var["type"] == "datasource"}
    served = served_metrics(api)
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 8
    used = set()
    for title, expr in queries:
        for query in expand(expr, variables):
            tree = promql_parser.parse(query)  # raises on a syntax error
            found = selectors(tree)
            assert found, f"{title}: {query!r} names no metric"
            for name, matchers, grouping in found:
                assert name in served, f"{title}: {query!r} names {name!r}, which /metrics does not serve"
                used.add(name)
                for matcher in matchers:
                    if matcher.name == "__name__":
                        continue
                    assert matcher.name in served[name], f"{title}: {name} has no label {matcher.name!r}"
                    if matcher.op == promql_parser.MatchOp.Equal:
                        assert matcher.value in served[name][matcher.name], \
                            f"{title}: {name}{{{matcher.name}={matcher.value!r}}} is never served"
                missing = [label for label in grouping if label not in served[name]]
                assert not missing, f"{title}: {query!r} groups {name} by {missing}, labels it does not have"
    # The other way round: a metric /metrics serves that no panel charts is noticed here.
    assert set(served) - used == set(), f"served but charted nowhere: {sorted(set(served) - used)}"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${" + next(iter(datasources)) + "}", panel["title"]


def test_the_dashboard_variable_switches_between_gpu_and_cpu_seconds(api):
    served = served_metrics(api)
    assert {"elastify_gpu_seconds_total", "elastify_cpu_seconds_total"} <= set(served)
    expanded = [query for _, expr in dashboard_queries(json.loads(DASHBOARD.read_text()))
                for query in expand(expr, {"resource": ["gpu", "cpu"]}) if "_seconds_total" in query]
    assert any("elastify_cpu_seconds_total" in q for q in expanded)
    assert any("elastify_gpu_seconds_total" in q for q in expanded)


def test_metrics_serve_cpu_seconds_beside_gpu_seconds_per_stage_type(api):
    client = TestClient(api.app)
    headers = api.token("acme")
    cpu_only = client.post("/v1/builds", json=spec(version="1"), headers=headers).json()["id"]
    gpu = client.post("/v1/builds", json=spec(version="2"), headers=headers).json()["id"]
    finish_build(api, cpu_only, gpu_seconds=0.0, cpu_seconds=2.5)
    finish_build(api, gpu, gpu_seconds=4.0, cpu_seconds=1.0)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["elastify_cpu_seconds"].type == "counter"

    def by_stage(family: str) -> dict[str, float]:
        return {s.labels["stage_type"]: s.value for s in families[family].samples if s.name.endswith("_total")}

    assert by_stage("elastify_cpu_seconds") == {"first": 3.5, "second": 3.5, "third": 3.5}
    assert by_stage("elastify_gpu_seconds") == {"first": 4.0, "second": 4.0, "third": 4.0}


def test_the_prometheus_scrape_config_and_servicemonitor_reach_the_apis_metrics(api):
    client = TestClient(api.app)

    def serves_metrics(path: str) -> bool:
        response = client.get(path)  # no token: Prometheus sends none
        return response.status_code == 200 and "# TYPE elastify_builds gauge" in response.text

    prometheus = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    [job] = [job for job in prometheus["scrape_configs"] if job["job_name"] == "elastify"]
    assert serves_metrics(job["metrics_path"]) and job["static_configs"][0]["targets"]

    service, monitor = yaml.safe_load_all((INFRA / "k8s" / "servicemonitor.yaml").read_text())
    assert (service["kind"], monitor["kind"]) == ("Service", "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert serves_metrics(endpoint["path"])
    [port] = [port for port in service["spec"]["ports"] if port["name"] == endpoint["port"]]

    cluster = yaml.safe_load((INFRA / "k8s" / "raycluster.yaml").read_text())
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    scheduler = {c["name"]: c for c in pod["containers"]}["scheduler"]
    [container_port] = [p for p in scheduler["ports"] if p["name"] == port["targetPort"]]
    command = scheduler["command"]
    assert command[:2] == ["elastify", "up"]
    # `up` listens where the Service sends scrapes: on every interface of the pod, on the named port.
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert int(command[command.index("--port") + 1]) == container_port["containerPort"]


def test_every_ray_container_of_the_kuberay_manifest_runs_with_ray_auth_disabled():
    cluster = yaml.safe_load((INFRA / "k8s" / "raycluster.yaml").read_text())
    pods = [cluster["spec"]["headGroupSpec"]] + cluster["spec"]["workerGroupSpecs"]
    for group in pods:
        for container in group["template"]["spec"]["containers"]:
            env = {item["name"]: item.get("value") for item in container.get("env", [])}
            assert env.get("RAY_AUTH_MODE") == "disabled", container["name"]


def test_cpu_and_gpu_seconds_advance_while_an_attempt_runs_and_never_go_back_when_it_ends(api):
    client = TestClient(api.app)
    build_id = client.post("/v1/builds", json=spec(version="1"), headers=api.token("acme")).json()["id"]

    def counters() -> tuple[float, float]:
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        return tuple(sum(s.value for s in families[name].samples
                         if s.name.endswith("_total") and s.labels["stage_type"] == "first")
                     for name in ("elastify_cpu_seconds", "elastify_gpu_seconds"))

    with api.sessions.begin() as session:
        stage = session.scalar(select(Stage).where(Stage.build_id == build_id, Stage.type == "first"))
        stage_id = stage.id
        running = Attempt(stage_id=stage_id, number=1, worker="test", status="running", num_gpus=2.0)
        session.add(running)
    assert counters() == (0.0, 0.0)

    def report(attempt: int, cpu: float, wall: float) -> None:  # a progress event as workers.runner emits it
        with api.sessions.begin() as session:
            session.add(Event(build_id=build_id, stage_id=stage_id, attempt=attempt, kind="progress", message="layers",
                              data={"done": 1, "total": 4, "cpu_seconds": cpu, "wall_seconds": wall}))

    report(1, cpu=1.5, wall=2.0)
    assert counters() == (1.5, 4.0)
    report(1, cpu=3.0, wall=4.0)
    assert counters() == (3.0, 8.0)

    with api.sessions.begin() as session:  # the final charge lands: measured on the same clocks, never less
        attempt = session.get(Attempt, running.id)
        attempt.status, attempt.exit, attempt.ended_at = "failed", "error", utcnow()
        attempt.cpu_seconds, attempt.wall_seconds, attempt.gpu_seconds = 3.25, 4.5, 9.0
        # The worker process died in the next attempt: its row has no CPU time, its reports still count.
        session.add(Attempt(stage_id=stage_id, number=2, worker="test", status="failed", exit="crashed",
                            num_gpus=2.0, ended_at=utcnow()))
    report(2, cpu=1.0, wall=1.0)
    assert counters() == (4.25, 11.0)
