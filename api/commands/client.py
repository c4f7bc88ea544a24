"""Commands that talk to a running Elastify server over REST (device_sdk.client.ElastifyClient).

`submit`, `builds list|show|cancel|retry`, `logs`, `packages list|show|pull`, `aliases set`
and `usage`. The server and token come from --server/--token or ELASTIFY_SERVER/ELASTIFY_TOKEN;
the token is never printed. Tables go to stdout, progress and messages to stderr.
"""

from __future__ import annotations

import contextlib
import json
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from api.progress import console, fail, progress_bars
from device_sdk.cli import download_bar
from device_sdk.client import DEFAULT_SERVER, Build, ElastifyAPIError, ElastifyClient, LogEvent
from device_sdk.format import PackageError, atomic_write_bytes
from device_sdk.registry import pull, read_local_state
from device_sdk.trust import TrustStore

out = Console(highlight=False)  # stdout: what scripts read

Server = Annotated[str, typer.Option("--server", envvar="ELASTIFY_SERVER", help="the API's base URL",
                                     show_default=DEFAULT_SERVER)]
Token = Annotated[str | None, typer.Option("--token", envvar="ELASTIFY_TOKEN", show_default=False,
                                           help="bearer token (prefer the ELASTIFY_TOKEN variable)")]
AsJSON = Annotated[bool, typer.Option("--json", help="print the server's JSON instead of a table")]

builds_app = typer.Typer(no_args_is_help=True, help="List, inspect, cancel and retry builds.")
packages_app = typer.Typer(no_args_is_help=True, help="List, inspect and pull packages.")
aliases_app = typer.Typer(no_args_is_help=True, help="Move package aliases.")
sources_app = typer.Typer(no_args_is_help=True, help="Upload models and data that builds name as upload:<digest>.")

MAX_PIPED_WIDTH = 10_000  # characters: a piped table is as wide as its content, up to this


@contextlib.contextmanager
def connected(server: str, token: str | None) -> Iterator[ElastifyClient]:
    """A client, closed on exit; any API error becomes a clear message and a non-zero exit (2 for a 4xx)."""
    try:
        with ElastifyClient(server or DEFAULT_SERVER, token=token) as client:
            yield client
    except ElastifyAPIError as err:  # the message, then every field error a 422 lists
        if 400 <= err.status < 500:
            fail(err.describe())
        console.print(f"[bold red]error:[/] {escape(err.describe())}")
        raise typer.Exit(code=1) from None
    except ValueError as err:
        fail(str(err))


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.4f}"


def _when(moment) -> str:
    """A time as the tables show it: UTC to the second, as the server wrote it (2026-11-29T10:00:00)."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S") if moment is not None else ""


def _print_json(data) -> None:
    out.print_json(json.dumps(data, default=str))


def _print_table(title: str, columns: list[str], rows: list[list[str]], numeric: tuple[str, ...] = ()) -> None:
    """A table on stdout; `numeric` columns are right-aligned."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in numeric else "left")
    for row in rows:
        table.add_row(*row)
    if out.is_terminal:
        out.print(table)
        return
    # Piped: rich would squeeze the table into 80 columns and cut ids; print it as wide as its content.
    width = Measurement.get(out, out.options.update(width=MAX_PIPED_WIDTH), table).maximum
    Console(highlight=False, width=max(width, 1)).print(table)


# --------------------------------------------------------------------------- builds


def submit(
    spec: Annotated[Path, typer.Argument(help="BuildSpec file (YAML or JSON)")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream the build's progress until it ends")] = False,
    idempotency_key: Annotated[str | None, typer.Option(help="resubmitting with the same key returns the same build")] = None,
    server: Server = "",
    token: Token = None,
) -> None:
    """Submit a build; prints its id on stdout."""
    import yaml

    try:
        body = yaml.safe_load(spec.read_text())
    except OSError as err:
        fail(f"cannot read {spec}: {err.strerror}")
    except yaml.YAMLError as err:
        fail(f"{spec} is not valid YAML or JSON: {err}")
    if not isinstance(body, dict):
        fail(f"{spec} must hold a mapping (a BuildSpec), not {type(body).__name__}")
    with connected(server, token) as client:
        build = client.submit(body, idempotency_key=idempotency_key)
        print(build.id)
        if follow:
            _follow(client, build.id)


def _follow(client: ElastifyClient, build_id: str) -> None:
    """Per-stage progress bars and state lines from the SSE log until the build ends; exit 1 unless it succeeded."""
    with progress_bars() as on_progress:
        summary = client.build(build_id)
        on_progress("stages", summary.stages_done, summary.stages_total)

        def show(event: LogEvent) -> None:
            if event.kind == "progress" and event.data:
                on_progress(f"{event.stage}: {event.message}", event.data["done"], event.data["total"])
                return
            where = f"[{event.stage}] " if event.stage else ""
            console.print(f"{where}{event.message}", markup=False, highlight=False)
            if event.kind == "state":
                now = client.build(build_id)
                on_progress("stages", now.stages_done, now.stages_total)

        build = client.wait(build_id, on_progress=show)
    _stage_table(build)
    if build.status != "succeeded":
        console.print(f"[bold red]build {build_id} {build.status}[/]" + (f": {build.error}" if build.error else ""))
        raise typer.Exit(code=1)
    if build.package is not None:
        console.print(f"published {build.package.name} {build.package.version}")


@builds_app.command("list")
def builds_list(
    status: Annotated[str | None, typer.Option(help="queued, running, succeeded, failed or cancelled")] = None,
    name: Annotated[str | None, typer.Option(help="package name the build publishes")] = None,
    owner: Annotated[str | None, typer.Option(help="tenant (admins only see other tenants)")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many builds")] = 50,
    as_json: AsJSON = False,
    server: Server = "",
    token: Token = None,
) -> None:
    """Builds, newest first."""
    with connected(server, token) as client:
        builds = []
        for build in client.iter_builds(status=status, name=name, owner=owner, limit=min(limit, 100)):
            builds.append(build)
            if len(builds) >= limit:
                break
    if as_json:
        _print_json([b.raw for b in builds])
        return
    _print_table(f"{len(builds)} builds", ["id", "package", "tenant", "status", "stages", "GPU h", "created"],
                 [[b.id, f"{b.name} {b.version}", b.tenant, b.status, f"{b.stages_done}/{b.stages_total}",
                   _hours(b.gpu_seconds), _when(b.created_at)] for b in builds], numeric=("stages", "GPU h"))


@builds_app.command("show")
def builds_show(build_id: str, as_json: AsJSON = False, server: Server = "", token: Token = None) -> None:
    """A build's stages, attempts, cache hits and compute."""
    with connected(server, token) as client:
        build = client.build(build_id)
    if as_json:
        _print_json(build.raw)
        return
    out.print(f"build {build.id} ({build.name} {build.version}, tenant {build.tenant}): "
              f"{build.status}, {build.stages_done}/{build.stages_total} stages, "
              f"{build.cache_hits} from cache, {_hours(build.gpu_seconds)} GPU h, {_hours(build.cpu_seconds)} CPU h")
    if build.error:
        out.print(f"error: {build.error}", markup=False)
    _stage_table(build)


def _stage_table(build: Build) -> None:
    rows = []
    for stage in build.stages:
        progress = stage.progress
        rows.append([stage.key, stage.status, "hit" if stage.cache_hit else "", str(len(stage.attempts)),
                     f"{progress.done}/{progress.total}" if progress else "",
                     f"{sum(a.wall_seconds for a in stage.attempts):.1f}", f"{stage.gpu_seconds:.1f}"])
    columns = ["stage", "status", "cache", "attempts", "progress", "wall s", "GPU s"]
    _print_table(f"stages of {build.id}", columns, rows, numeric=tuple(columns[2:]))


@builds_app.command("cancel")
def builds_cancel(build_id: str, server: Server = "", token: Token = None) -> None:
    """Cancel a build: queued stages stop at once, running ones are cancelled by the scheduler."""
    with connected(server, token) as client:
        build = client.cancel(build_id)
    console.print(f"build {build_id}: {build.status}" + (" (cancellation requested)" if build.cancel_requested else ""))


@builds_app.command("retry")
def builds_retry(
    build_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    server: Server = "",
    token: Token = None,
) -> None:
    """Re-run a failed or cancelled build's unfinished stages; finished ones are reused."""
    with connected(server, token) as client:
        build = client.retry(build_id)
        console.print(f"build {build_id}: {build.status}")
        if follow:
            _follow(client, build_id)


def logs(
    build_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep streaming until the build ends")] = False,
    server: Server = "",
    token: Token = None,
) -> None:
    """A build's log: state changes, stage logs and progress."""
    with connected(server, token) as client:
        if not follow:
            print(client.logs_text(build_id), end="")
            return
        for event in client.logs(build_id):
            if event.event == "end":
                console.print(f"build {event.json()['status']}")
                return
            entry = event.log_event()
            stage = f" [{entry.stage}]" if entry.stage else ""
            line = f"{_when(entry.time)}{stage} {entry.message}"
            if entry.kind == "progress":  # one line per report; `submit --follow` draws them as bars
                done = entry.data or {}
                line += f" {done.get('done')}/{done.get('total')}"
            print(line, flush=True)


# --------------------------------------------------------------------------- packages


@packages_app.command("list")
def packages_list(as_json: AsJSON = False, server: Server = "", token: Token = None) -> None:
    """Your packages, with their latest version and aliases."""
    with connected(server, token) as client:
        packages = list(client.iter_packages())
    if as_json:
        _print_json([p.raw for p in packages])
        return
    _print_table(f"{len(packages)} packages", ["name", "versions", "latest", "aliases", "updated"],
                 [[p.name, str(p.versions), p.latest_version,
                   ", ".join(f"{a} → {v}" for a, v in sorted(p.aliases.items())), _when(p.updated_at)]
                  for p in packages])


@packages_app.command("show")
def packages_show(
    name: str,
    version: Annotated[str | None, typer.Argument(help="a version: print its manifest summary")] = None,
    as_json: AsJSON = False,
    server: Server = "",
    token: Token = None,
) -> None:
    """A package's versions, or one version's manifest."""
    with connected(server, token) as client:
        if version is None:
            versions = list(client.iter_versions(name))
        else:
            manifest = client.manifest(name, version)
    if version is None:
        if as_json:
            _print_json([v.raw for v in versions])
            return
        _print_table(f"versions of {name}", ["version", "aliases", "build", "manifest sha256", "created"],
                     [[v.version, ", ".join(v.aliases), v.build_id, v.manifest_sha256[:16], _when(v.created_at)]
                      for v in versions])
        return
    if as_json:
        _print_json(manifest)
        return
    levels = manifest.get("elastic", {}).get("levels", [])
    out.print(f"{manifest['name']} {manifest['version']} (format {manifest['format_version']}, build {manifest.get('build_id')})")
    out.print(f"source: {manifest.get('source', {}).get('model')}")
    _print_table(f"{len(manifest['files'])} files, {sum(f['size'] for f in manifest['files']):,} bytes; levels",
                 ["level", "active fraction", "adapter", "quality"],
                 [[str(level.get("name", level.get("ratio"))), f"{level.get('active_fraction', 0):.3f}",
                   level.get("adapter") or "",
                   ", ".join(f"{metric} {value:.4g}" for metric, value in (level.get("quality") or {}).items())]
                  for level in levels])


@packages_app.command("pull")
def packages_pull(
    name: str,
    version: Annotated[str, typer.Argument(help="a version or an alias such as latest")] = "latest",
    public_key: Annotated[str | None, typer.Option(envvar="ELASTIFY_PUBLIC_KEY",
                                                   help="the publisher's base64 Ed25519 key; default: "
                                                        "the key pinned for NAME (elastify-device trust)")] = None,
    trust_server_key: Annotated[bool, typer.Option(
        "--trust-server-key", help="verify against the key this server serves and pin it for NAME "
                                   "(trust on first use: only for a server you trust)")] = False,
    max_level: Annotated[str | None, typer.Option(help="fetch only what levels up to this one need")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="default ~/.cache/elastify/packages")] = None,
    server: Server = "",
    token: Token = None,
) -> None:
    """Download a package through the API, verify every byte and the signature, and install it.

    The signature is checked against, in order: --public-key, the key pinned for NAME, or, with
    --trust-server-key only, the server's own key (pinned once the package verifies). Nothing else."""
    store = TrustStore()
    try:
        pinned = store.pinned(name)
    except PackageError as err:
        fail(str(err))
    if public_key is None and pinned is None and not trust_server_key:
        fail(f"no key to verify {name!r} with: pass --public-key KEY, pin one with "
             f"`elastify-device trust add {name} KEY`, or trust this server's key with --trust-server-key")
    with connected(server, token) as client:
        server_key = None
        if public_key is None and pinned is None:
            public_key = server_key = client.signing_key()
            console.print(f"verifying against the server's key {server_key} (--trust-server-key)")
        try:
            with download_bar(f"{name} {version}") as on_progress:
                path = pull(name, version, registry=client, public_key=public_key, max_level=max_level,
                            cache_dir=cache_dir, on_progress=on_progress)
            if server_key is not None:  # pinned only once a package verified against it
                store.add(name, server_key)
                console.print(f"pinned the server's key for {name} in {store.path}")
        except PackageError as err:
            fail(str(err))
        except ConnectionError as err:
            console.print(f"[bold red]error:[/] {escape(str(err))}")
            raise typer.Exit(code=1) from None
    state = read_local_state(path)
    held = "every level" if state["max_level"] is None else f"levels <= {state['max_level']}"
    console.print(f"verified {name} {state['version']} ({held}, {state['bytes']:,} bytes)")
    print(path)


@aliases_app.command("set")
def aliases_set(name: str, alias: str, version: str, server: Server = "", token: Token = None) -> None:
    """Point ALIAS of package NAME at VERSION."""
    with connected(server, token) as client:
        moved = client.set_alias(name, alias, version)
    console.print(f"{moved.name} {moved.alias} → {moved.version}")


# --------------------------------------------------------------------------- init

SPEC_TEMPLATE = """\
# A build spec for {label} ({family}: {layers} layers, hidden size {hidden}, {heads} attention heads,
# {kv_heads} key/value heads, vocabulary {vocab}). Written by `elastify init`; see examples/builds/ for more.
#   elastify submit {out} --follow
source:
  # The model as this machine sees it: a server reads it under its source roots, or upload it first
  # (`elastify sources upload DIR`) and put the printed upload:<digest> here.
  model: {model}
# quick: profile, elastify, a short recovery, evaluate; default: the whole ElastiLM chain; full: plus experts and export
preset: {preset}
levels: [0.5, 0.7, 1.0]  # fractions of the model kept; 1.0 is the full model
stages: {{}}  # per-stage enabled/settings/resources, over the preset: e.g. recover: {{settings: {{steps: 48}}}}
publish:
  name: {name}
  version: 0.1.0  # a version already published is refused (409): bump it for every build
"""


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """A model directory: `model` itself if it is one, else a Hub id looked up in the local Hugging Face
    cache only (never downloaded); a ValueError names the cache directory searched."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    searched = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(model, cache_dir=searched, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        raise ValueError(f"{model} is neither a model directory nor a model in the Hugging Face cache "
                         f"{searched} (only the local cache is searched: download it there first)") from None


def init(
    model: Annotated[str, typer.Argument(help="a model directory, or a Hub id already in the local HF cache")],
    preset: Annotated[str, typer.Option(help="quick, default or full")] = "quick",
    out: Annotated[Path, typer.Option("--out", "-o", help="where to write the spec")] = Path("spec.yaml"),
    cache_dir: Annotated[Path | None, typer.Option(envvar="HF_HUB_CACHE", show_default=False,
                                                   help="the Hugging Face cache to search")] = None,
    force: Annotated[bool, typer.Option(help="overwrite OUT")] = False,
) -> None:
    """Write a commented build spec for MODEL, its family and shape read from its config.json."""
    # lazy: the CLI starts without the control plane (SQLAlchemy models); init loads it when it runs
    from cluster.spec import Preset, parse_spec

    if preset not in typing.get_args(Preset):
        fail(f"--preset must be one of {', '.join(typing.get_args(Preset))}, not {preset!r}")
    if out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite it")
    try:
        directory = resolve_model(model, cache_dir)
        config = json.loads((directory / "config.json").read_text())
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot read {directory / 'config.json'}: {err.strerror}")
    name = re.sub(r"[^a-z0-9._-]+", "-", model.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-._")[:120] or "model"
    text = SPEC_TEMPLATE.format(
        label=model, family=config.get("model_type", "unknown family"), layers=config.get("num_hidden_layers", "?"),
        hidden=config.get("hidden_size", "?"), heads=config.get("num_attention_heads", "?"),
        kv_heads=config.get("num_key_value_heads", config.get("num_attention_heads", "?")),
        vocab=config.get("vocab_size", "?"), out=out, model=json.dumps(str(directory)), preset=preset,
        name=f"{name}-elastic")
    parse_spec(text)  # what init writes is a valid spec
    atomic_write_bytes(out, text.encode())
    console.print(f"wrote {out} for {directory}")


# --------------------------------------------------------------------------- usage


def usage(
    by: Annotated[str, typer.Option(help="comma-separated groups: tenant, build, stage_type, day")] = "stage_type",
    build: Annotated[str | None, typer.Option(help="only this build")] = None,
    stage_type: Annotated[str | None, typer.Option(help="only this stage type")] = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant (admins)")] = None,
    since: Annotated[str | None, typer.Option(help="from this UTC day, YYYY-MM-DD")] = None,
    until: Annotated[str | None, typer.Option(help="up to this UTC day, YYYY-MM-DD")] = None,
    as_json: AsJSON = False,
    server: Server = "",
    token: Token = None,
) -> None:
    """GPU-hours and CPU-hours of every attempt (failed ones too), rolled up."""
    groups = [g.strip() for g in by.split(",") if g.strip()]
    with connected(server, token) as client:
        report = client.usage(group_by=groups, build=build, stage_type=stage_type, tenant=tenant, since=since, until=until)
    if as_json:
        _print_json(report.raw)
        return
    measures = ["attempts", "GPU h", "CPU h", "wall s"]
    _print_table(f"usage by {', '.join(report.group_by)}: {report.total_gpu_hours:.4f} GPU h, "
                 f"{report.total_cpu_hours:.4f} CPU h", [*report.group_by, *measures],
                 [[*(str(getattr(row, g)) for g in report.group_by), str(row.attempts), f"{row.gpu_hours:.4f}",
                   f"{row.cpu_hours:.4f}", f"{row.wall_seconds:.1f}"] for row in report.rows],
                 numeric=tuple(measures))


# --------------------------------------------------------------------------- sources


def _upload_body(path: Path) -> tuple[bytes, str, dict | None]:
    """(body, Content-Type, query) of POST /v1/sources: a directory as tar.gz (links followed, so an HF cache
    snapshot of symlinks sends its files), a file as itself with its name (the suffix tells .gguf from .jsonl)."""
    import io
    import tarfile

    if path.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz", dereference=True) as archive:
            archive.add(path, arcname=path.name)
        return buffer.getvalue(), "application/gzip", None
    if path.is_file():
        return path.read_bytes(), "application/octet-stream", {"name": path.name}
    fail(f"{path} is neither a file nor a directory")
    raise AssertionError  # fail() exits


@sources_app.command("upload")
def sources_upload(
    path: Annotated[Path, typer.Argument(help="a model directory (sent as tar.gz) or one file (.gguf, .jsonl, .txt)")],
    as_json: AsJSON = False, server: Server = "", token: Token = None,
) -> None:
    """Upload a source; prints `upload:<digest>` on stdout, to name as source.model, calibration, a corpus, …"""
    body, media, query = _upload_body(path)
    with connected(server, token) as client:
        upload = client.request("POST", "/v1/sources", params=query, body=body, timeout=3600,
                                headers={"Content-Type": media, "Accept": "application/json"}).json()
    if as_json:
        _print_json(upload)
        return
    console.print(f"{upload['kind']} {escape(upload['name'])}: {upload['size']} bytes")
    print(upload["source"])  # stdout, for scripts


@sources_app.command("list")
def sources_list(as_json: AsJSON = False, server: Server = "", token: Token = None) -> None:
    """Your uploads, the bytes they hold and your quota."""
    with connected(server, token) as client:
        listed = client.request("GET", "/v1/sources", headers={"Accept": "application/json"}).json()
    if as_json:
        _print_json(listed)
        return
    _print_table(f"uploads: {listed['total_bytes']} of {listed['quota_bytes']} bytes",
                 ["source", "kind", "name", "bytes", "created"],
                 [[u["source"], u["kind"], u["name"], str(u["size"]), str(u["created_at"])] for u in listed["items"]],
                 numeric=("bytes",))


def mount(app: typer.Typer) -> None:
    """Add the REST client commands to the `elastify` CLI."""
    app.command("init")(init)
    app.command("submit")(submit)
    app.add_typer(builds_app, name="builds")
    app.command("logs")(logs)
    app.add_typer(packages_app, name="packages")
    app.add_typer(aliases_app, name="aliases")
    app.add_typer(sources_app, name="sources")
    app.command("usage")(usage)
