"""Commands that talk to the control plane: `up`, `admin build submit|status|cancel`, `admin usage`, and the demo."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from api.progress import configure_logging, console, fail, progress_bars

build_app = typer.Typer(no_args_is_help=True, help="Submit, follow and cancel builds.")
log = logging.getLogger("elastify")


def _sessions(settings):
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.db import make_engine, migrate, session_factory

    migrate(settings.database_url)
    return session_factory(make_engine(settings.database_url))


def up(
    host: str = typer.Option("127.0.0.1", help="where the REST API listens"),
    port: int = typer.Option(8000, help="REST API port; 0 serves no API (scheduler only)"),
) -> None:
    """Run the service on this machine: scheduler + REST API + local Ray (no dashboard) + SQLite + local store.

    The same command runs production with ELASTIFY_DATABASE_URL / ELASTIFY_RAY_ADDRESS / ELASTIFY_STORE_URL.
    """
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    import contextlib

    import ray

    from api.app import ServerThread, create_app, default_registry
    from api.lifecycle import MultiNodeStoreCheck, StopRequest, StopWatch
    from cluster.embedded import running_service
    from cluster.settings import Settings

    configure_logging()
    settings = Settings.from_env()
    stop, watch = StopRequest().install(), None
    try:
        with running_service(settings, default_registry()) as scheduler:
            stop.install()  # again: ray.init put its own SIGTERM handler in place
            watch = StopWatch(stop, scheduler)
            store_check = MultiNodeStoreCheck(settings.store_url)
            api = ServerThread(create_app(settings, scheduler.registry), host, port) if port else contextlib.nullcontext()
            with api:
                console.print(f"elastify up: database {settings.database_url}, store {settings.store_url}")
                if port:
                    console.print(f"REST API on {api.url} (docs at {api.url}/docs, dashboard at {api.url}/dashboard); "
                                  "tokens: `elastify tokens create`")
                console.print(f"manifests are signed by public key {settings.public_key_b64()}; SIGTERM or Ctrl-C stops")
                try:
                    # Stop taking work at the signal; leaving these blocks stops the API, then hands the stages
                    # still running back to the queue (Scheduler.close) while Ray is still up.
                    scheduler.run(until=lambda: store_check() or stop.is_set())
                except KeyboardInterrupt:  # a second Ctrl-C
                    console.print("interrupted; running stages go back to the queue")
    finally:
        ray.shutdown()  # stops the Ray processes this one started (a joined cluster is only left)
        if watch is not None:
            watch.stopped()


@build_app.command("submit")
def build_submit(
    spec: Path = typer.Argument(..., help="BuildSpec file (YAML or JSON)"),
    tenant: str = typer.Option("default"),
    idempotency_key: str | None = typer.Option(None),
) -> None:
    """Validate a spec and queue the build; a running `elastify up` picks it up."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from api.app import default_registry
    from cluster.service import submit_build
    from cluster.settings import Settings
    from cluster.sources import SourcePolicy
    from cluster.spec import SpecError, parse_spec

    registry = default_registry()
    settings = Settings.from_env()
    try:
        # The same source roots as the API: a tenant's build reads no file a tenant could not name there.
        build_id = submit_build(_sessions(settings), parse_spec(spec, registry), registry, tenant,
                                idempotency_key, sources=SourcePolicy(settings.allowed_source_roots),
                                gpu_stage_seconds=settings.gpu_stage_seconds)
    except SpecError as err:  # SourceRefused included
        fail(str(err))
        return
    print(build_id)  # stdout, for scripts


@build_app.command("status")
def build_status(build_id: str) -> None:
    """Print a build's stages, attempts and package as JSON."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.service import build_summary
    from cluster.settings import Settings

    try:
        print(json.dumps(build_summary(_sessions(Settings.from_env()), build_id), indent=2, default=str))
    except KeyError as err:
        fail(str(err))


@build_app.command("cancel")
def build_cancel(build_id: str) -> None:
    """Cancel a build: queued stages stop at once, running Ray tasks are cancelled by the scheduler."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.service import cancel_build
    from cluster.settings import Settings

    try:
        console.print(cancel_build(_sessions(Settings.from_env()), build_id))
    except KeyError as err:
        fail(str(err))


def usage(by: str = typer.Option("build", help="build, stage_type, tenant or day")) -> None:
    """Wall, CPU and GPU seconds of every attempt (failed ones too), rolled up."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.ledger import usage as rollup
    from cluster.settings import Settings

    with _sessions(Settings.from_env())() as session:
        try:
            rows = rollup(session, by)
        except ValueError as err:
            fail(str(err))
            return
    table = Table(title=f"usage by {by}")
    for column in (by, "attempts", "wall s", "cpu s", "gpu s"):
        table.add_column(column, justify="right")
    for key, row in sorted(rows.items()):
        table.add_row(key, str(row["attempts"]), f"{row['wall_seconds']:.1f}", f"{row['cpu_seconds']:.1f}", f"{row['gpu_seconds']:.1f}")
    console.print(table)


def mount(app: typer.Typer) -> None:
    """Add these commands to the `elastify` CLI; the database-direct ones under `admin`
    (users go through the API: `elastify submit`, `builds`, `usage`, in api/commands/client.py)."""
    app.command("up")(up)
    admin_app = typer.Typer(no_args_is_help=True, help="Operator commands that read and write the database directly.")
    admin_app.add_typer(build_app, name="build")
    admin_app.command("usage")(usage)
    app.add_typer(admin_app, name="admin")
    app.command("demo")(embedded_demo)


# --------------------------------------------------------------------------- the demo


def demo_spec(model_dir: Path) -> dict:
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.fingerprint import pipeline_version

    # The version carries the pipeline's code digest: same code, same (cached) package; new code, new version.
    code = pipeline_version().split("+", 1)[1][:8]
    return {
        "source": {"model": str(model_dir)},
        "calibration": ["ptb:train"],
        # Six levels from 20% to the full model: each smaller one adds a recovery to the critical path.
        "levels": [0.2, 0.3, 0.5, 0.7, 0.9, 1.0],
        # The whole ElastiLM chain, sized to finish in minutes on a laptop CPU (production runs the defaults).
        "stages": {
            # Leave-one-out ranking costs a forward pass per KV group and layer for every window: 4 windows here.
            "profile": {"settings": {"windows": 8, "window_length": 128, "layer_windows": 4}},
            "elastify": {"settings": {"anchor_fraction": 0.2}},
            # The recovery corpus at demo size: 24 short answers (two shards, ~11 tokens/s a core) plus the
            # packaged passages and PTB train.
            "corpus-generate": {"settings": {"prompts": 24, "max_new_tokens": 48, "max_prompt_words": 96}},
            # Distillation on that corpus, top-down: each level goes on from the next larger one's LoRA, so
            # the levels run one after another, each on both cores and with fewer steps than cold starts need.
            "recover": {"settings": {"steps": 10, "batch_size": 4, "seq_len": 128, "eval_windows": 4, "lr": 5e-4,
                                     "warmup_steps": 2},
                        "resources": {"num_cpus": 2}},
            "latency": {"settings": {"prompt_lengths": [32, 128], "repeats": 1}},
            "tlm-score": {"settings": {"passages": 32, "passage_words": 60, "steps": 40}},
            "label": {"settings": {"tasks": ["arc_easy", "sciq"], "per_task": 10, "ratios": [0.5, 0.7, 1.0]}},
            # The decision head and the report card are the last two stages and neither keeps two cores
            # busy: one core each, side by side. The report card at demo size: 2 tasks × 20 held-out
            # items, generation health on 8 prompts × 32 tokens.
            "tlm-decision": {"settings": {"steps": 50}, "resources": {"num_cpus": 1}},
            "evaluate": {"settings": {"windows": 8, "tasks": ["arc_easy", "sciq"], "items": 20,
                                      "generation_prompts": 8, "generation_tokens": 32},
                         "resources": {"num_cpus": 1}},
        },
        "publish": {"name": "smollm2-135m-elastic", "version": f"0.1.0-{code}", "aliases": ["latest"]},
    }


def _follow(scheduler, build_id: str, on_progress):
    """An `until` callback for the scheduler loop that streams the build's events to the console."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from sqlalchemy import select

    from cluster.models import Event, Stage
    from cluster.states import TERMINAL

    seen = 0

    def until() -> bool:
        nonlocal seen
        with scheduler.sessions() as session:
            rows = session.execute(
                select(Event, Stage.key).outerjoin(Stage, Stage.id == Event.stage_id)
                .where(Event.build_id == build_id, Event.id > seen).order_by(Event.id)
            ).all()
        for event, stage_key in rows:
            seen = event.id
            if event.kind == "progress" and event.data:
                on_progress(f"{stage_key}: {event.message}", event.data["done"], event.data["total"])
            elif event.kind != "progress":
                log.info("%s%s", f"[{stage_key}] " if stage_key else "", event.message)
        return scheduler.status(build_id) in TERMINAL

    return until


DEMO_KEY_PREFIX = "demo-"


def cancel_stale_demos(sessions, current_key: str) -> list[str]:
    """Cancel unfinished demo builds other than `current_key`'s. A demo's key carries the
    pipeline's code digest, so another key is an interrupted demo of other code, and the embedded
    scheduler would otherwise finish its stages before starting this one's."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from sqlalchemy import select

    from cluster.models import Build
    from cluster.service import cancel_build
    from cluster.states import TERMINAL

    with sessions() as session:
        stale = session.scalars(select(Build.id).where(
            Build.idempotency_key.startswith(DEMO_KEY_PREFIX), Build.idempotency_key != current_key,
            Build.status.not_in([status.value for status in TERMINAL]))).all()
    for build_id in stale:
        cancel_build(sessions, build_id)
        log.info("cancelled build %s, an unfinished demo of other code", build_id)
    return list(stale)


def embedded_demo() -> None:
    """Build SmolLM2-135M end to end in embedded mode and print the package path and stage times."""
    # lazy: torch and the pipeline load only when this command runs (api imports without torch)
    from api.app import default_registry
    from cluster.embedded import running_service
    from cluster.packages import package_prefix
    from cluster.service import build_summary, submit_build
    from cluster.settings import Settings
    from cluster.spec import parse_spec
    from pipeline.assets import prepare_smollm2

    configure_logging()
    settings = Settings.from_env()
    registry = default_registry()
    spec = parse_spec(demo_spec(prepare_smollm2(progress=log.info)), registry)
    started = time.perf_counter()
    key = f"{DEMO_KEY_PREFIX}{spec.content_hash()}"
    with running_service(settings, registry) as scheduler:
        # Keyed by content: an interrupted demo resumes its build, a finished one is shown again.
        cancel_stale_demos(scheduler.sessions, key)
        build_id = submit_build(scheduler.sessions, spec, scheduler.registry, idempotency_key=key)
        log.info("build %s", build_id)
        with progress_bars() as on_progress:
            scheduler.run(until=_follow(scheduler, build_id, on_progress), timeout=3600)
        summary = build_summary(scheduler.sessions, build_id)
        store = scheduler.store
    _stage_table(summary)
    if summary["status"] != "succeeded":
        fail(f"build {build_id} {summary['status']}: {summary['error']}")
    prefix = package_prefix(spec.publish.name, spec.publish.version)
    where = store.local_path(prefix) or f"{settings.store_url}/{prefix}"
    console.print(f"package {spec.publish.name} {spec.publish.version}: {where}")
    console.print(f"verify with public key {settings.public_key_b64()}")
    console.print(f"build {build_id} took {time.perf_counter() - started:.1f} s ({summary['cache_hits']} stages from cache)")
    local = store.local_path(prefix)
    if local is not None:  # an S3 store: `elastify-device pull` it first
        # lazy: torch and the pipeline load only when this command runs (api imports without torch)
        from device_sdk.runtime import ElasticModel

        model = ElasticModel.load(Path(local), public_key=settings.public_key_b64())
        console.print(_level_table(level_continuations(model)))
        model.latency_profile = demo_profile(model)
        console.print(_slo_table(slo_servings(model)))


DEMO_PROMPT = "The capital of France is"
DEMO_LEVELS = ("1.0", "0.7", "0.5")
# Two requests as an app would send them, an instruction or a passage and then a question that `keep`
# spares from compression (a bare question compressed to a third says nothing); each under a loose and a
# tight SLO (fractions of the full model's TTFT, TPOT).
DEMO_INSTRUCTION = ("You are a science tutor for school children. Answer the question below in a few plain words, "
                    "and do not add anything else.")
DEMO_PASSAGE = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
                "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
                "to 1889 as the centrepiece of the 1889 World's Fair.")
DEMO_REQUESTS = tuple((f"{context}\n{question}", question) for context, question in (
    (DEMO_INSTRUCTION, "Question: Which gas do plants take in from the air?\nAnswer:"),
    (DEMO_PASSAGE, "Question: Who is the tower named after?\nAnswer:")))
DEMO_SLOS = ((1.5, 1.2), (0.6, 0.8))  # loose: (1, 1) is the full model racing its own prediction


def level_continuations(model, prompt: str = DEMO_PROMPT, levels: tuple[str, ...] = DEMO_LEVELS,
                        max_new_tokens: int = 12) -> list[tuple[str, str, str]]:
    """(level, active fraction, greedy continuation of `prompt`) on the published package, served by the
    device SDK as a device would, so a newcomer sees what each level says before choosing one."""
    rows = []
    for level in levels:
        shape = model.manifest.elastic.level(level)
        text = model.generate(prompt, max_new_tokens=max_new_tokens, level=shape.name).text
        rows.append((shape.name, f"{shape.active_fraction:.2f}", text))
    return rows


def demo_profile(model):
    """This device's profile of the levels an SLO decision may pick (and the full model, which SLO fractions
    are of), as `elastify-device profile` measures it, at the demo's prompt lengths: seconds, where the quick
    estimate's 8- and 32-token line misjudges even the full model on these prompts."""
    from device_sdk.measure import measure_profile  # lazy: torch; api modules import without it

    shapes = [model.manifest.elastic.level(name) for name in model.available_levels()]
    names = sorted({shape.name for shape in shapes if shape.usable} | {shapes[-1].name}, key=float)
    return measure_profile(model, levels=names, prompt_lengths=(16, 48, 96), decode_tokens=8, repeats=2)


def slo_servings(model, requests=DEMO_REQUESTS, slos=DEMO_SLOS, max_new_tokens: int = 12) -> list[dict]:
    """Each (prompt, kept end) served under each SLO as the device SDK decides it: the chosen prompt ratio
    and level, whether the device's profile predicted any usable cell to meet the SLO, the measured TTFT
    and TPOT against their targets, and the text."""
    # lazy: torch and the pipeline load only when this command runs (api imports without torch)
    from device_sdk.latency import SLO

    rows = []
    for prompt, keep in requests:
        for ttft, tpot in slos:
            slo = SLO.fraction(ttft=ttft, tpot=tpot)
            served = model.generate(prompt, slo=slo, max_new_tokens=max_new_tokens, keep=keep)
            rows.append({"prompt": prompt, "slo": (ttft, tpot), "ratio": served.decision.prompt_ratio,
                         "level": served.level, "feasible": served.decision.feasible,
                         "ttft_ms": served.ttft_ms, "tpot_ms": served.tpot_ms, "slo_met": served.slo_met,
                         "text": served.text})
    return rows


def _level_table(rows: list[tuple[str, str, str]]) -> Table:
    table = Table(title=f"greedy continuations of {DEMO_PROMPT!r}")
    for column in ("level", "active params", "continuation"):
        table.add_column(column, justify="left" if column == "continuation" else "right")
    for level, fraction, text in rows:
        table.add_row(level, fraction, Text(repr(text)))  # as text: a "[…]" the model writes is no markup
    return table


def _slo_table(rows: list[dict]) -> Table:
    table = Table(title="served under an SLO (TTFT, TPOT as fractions of the full model's): the SDK's choice")
    for column in ("prompt", "SLO", "ratio, level", "TTFT ms", "TPOT ms", "met", "text"):
        table.add_column(column, justify="left" if column in ("prompt", "text") else "right")
    for row in rows:
        prompt = row["prompt"] if len(row["prompt"]) <= 40 else f"…{row['prompt'][-38:]}"
        tpot = "-" if row["tpot_ms"] is None else f"{row['tpot_ms']:.1f}"
        table.add_row(Text(repr(prompt)), f"{row['slo'][0]}, {row['slo'][1]}", f"{row['ratio']}, {row['level']}",
                      f"{row['ttft_ms']:.0f}", tpot, _met(row), Text(repr(row["text"])))
    return table


def _met(row: dict) -> str:
    """Whether the SLO was met, and where it was not, whether any usable cell could have met it on this device."""
    if row["slo_met"]:
        return "yes"
    return "no" if row["feasible"] else "no: no usable cell can"


def _stage_table(summary: dict) -> None:
    table = Table(title=f"build {summary['id']}: {summary['status']}")
    for column in ("stage", "status", "from cache", "attempts", "wall s", "cpu s"):
        table.add_column(column, justify="right")
    for stage in summary["stages"]:
        wall = sum(a["wall_seconds"] for a in stage["attempts"])
        cpu = sum(a["cpu_seconds"] for a in stage["attempts"])
        table.add_row(stage["key"], stage["status"], "yes" if stage["cache_hit"] else "no", str(len(stage["attempts"])),
                      f"{wall:.1f}", f"{cpu:.1f}")
    console.print(table)
