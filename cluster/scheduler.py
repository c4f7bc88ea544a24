"""The scheduler: lease ready stages from the database, run them on Ray, record what happened.

It holds nothing that the database does not also hold, so a new scheduler resumes any build:
stages it had in flight keep their lease until it expires, then return to the queue. Several
schedulers may share one PostgreSQL (leases are taken with FOR UPDATE SKIP LOCKED and every
status change is a conditional UPDATE); on SQLite one scheduler holds a file lock (one writer).

One tick: renew my leases, requeue expired ones, cancel what was cancelled, lease and dispatch
ready stages (or satisfy them from the cache), collect finished Ray tasks, store events, and
close builds whose stages are all done.

A database that cannot be reached (stopped, restarting, the network) does not stop the loop: it waits,
backing off, reconnects, hands back the stages it had leased but not started, and goes on; Ray tasks
that ran meanwhile are collected then.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
from sqlalchemy import exists, func, select, text, true, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import aliased

from cluster.accelerator import device_for, granted_resources
from cluster.capacity import cluster_gpus, current_capacity
from cluster.db import DATABASE_OUTAGES, is_connection_error, is_sqlite, make_engine, session_factory
from cluster.fingerprint import named_files_fingerprint, path_fingerprint, pipeline_version
from cluster.models import Artifact, Attempt, Build, Event, Stage, StageInput, utcnow
from cluster.packages import register_package
from cluster.registry import Registry
from cluster.settings import Settings
from cluster.sources import upload_digest, upload_ref
from cluster.states import TERMINAL, Status, advance
from cluster.sweeper import attempt_prefix, sweep_dead_outputs
from device_sdk.format import canonical_json
from pipeline import contract
from workers.ray_tasks import submit
from workers.runner import ExternalInput, StageTask
from workers.store import ArtifactRef, StoreError

log = logging.getLogger("elastify.scheduler")
PIPELINE_VERSION = pipeline_version()
EVENT_DRAIN_SECONDS = 0.25
TRAFFIC = ("bytes_fetched", "bytes_stored", "bytes_cached", "peak_rss_bytes")  # from the runner's result, when it reports them
STORE_SWEEP_SECONDS = 30.0  # how often dead attempts' partial outputs are looked for


class Unschedulable(RuntimeError):
    """A stage asks for more than any node of the cluster offers (permanent: not retried)."""


class SchedulerLockError(RuntimeError):
    """Another scheduler already writes to this SQLite database."""


@dataclass(frozen=True)
class RuntimeValue:
    """A value handed to stages at dispatch (not stored in the DB), e.g. the signing key."""

    provide: Callable[[Build], str]
    affects_output: bool  # if so, its sha256 (never the value) joins the cache key


@dataclass
class Inflight:
    stage_id: int
    build_id: str
    stage_key: str
    registration: contract.Stage
    attempt_id: int
    number: int
    num_gpus: float
    started: float = field(default_factory=time.monotonic)


@dataclass
class PublishContext:
    """What cluster.packages.register_package gets: the stage that made a package, and the services."""

    sessions: Any
    store: Any
    build: Build
    stage: Stage
    package: ArtifactRef  # the stage's output named by its `publishes`


def backoff_seconds(settings: Settings, attempts: int) -> float:
    return min(settings.retry_max_seconds, settings.retry_base_seconds * 2 ** max(0, attempts - 1))


class Scheduler:
    def __init__(self, settings: Settings, registry: Registry, *, owner: str | None = None,
                 runtime: dict[str, RuntimeValue] | None = None, max_inflight: int = 64):
        self.settings, self.registry, self.max_inflight = settings, registry, max_inflight
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.engine = make_engine(settings.database_url)
        self.sessions = session_factory(self.engine)
        self.store = settings.store.open()
        self.runtime = runtime if runtime is not None else default_runtime(settings)
        self.inflight: dict[Any, Inflight] = {}
        self.events = None
        self._undelivered: list[dict] = []  # events taken from the queue that a lost database did not store yet
        self._lock_handle = None
        self._last_heartbeat = self._last_sweep = self._last_drain = self._last_store_sweep = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Scheduler:
        """Take the SQLite writer lock if needed, prepare the store, open the event queue on Ray."""
        if is_sqlite(self.settings.database_url):
            self._take_sqlite_lock()
            self._requeue_expired(unexpired_too=True)
        try:
            self.store.ensure_ready()
        except StoreError as err:  # the store may come back; stages that need it retry, then fail clearly
            log.warning("artifact store not ready: %s", err)
        from ray.util.queue import Queue

        self.events = Queue(maxsize=100_000, actor_options={"num_cpus": 0})
        return self

    def _take_sqlite_lock(self) -> None:
        import fcntl

        path = Path(self.settings.database_url.split("///", 1)[-1] + ".scheduler.lock").expanduser()
        handle = open(path, "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise SchedulerLockError(f"another scheduler is running against {self.settings.database_url}") from None
        self._lock_handle = handle

    def close(self) -> None:
        """Stop: cancel my Ray tasks and hand their stages back to the queue at once."""
        for ref, info in list(self.inflight.items()):
            # Best effort: under SIGTERM the Ray head may be going down too (a Kubernetes pod stops all its
            # containers at once); the stage goes back to the queue whether or not the cancel reached Ray.
            try:
                ray.cancel(ref, force=True)
            except Exception as err:
                log.warning("could not cancel the Ray task of %s: %s", info.stage_key, err)
            self._finish_attempt(info, {"ok": False, "error": "scheduler stopped", "retryable": True}, exit="interrupted")
        self.inflight.clear()
        self._drain_events()
        if self.events is not None:
            try:
                ray.kill(self.events.actor)
            except Exception as err:
                log.warning("could not stop the event queue actor: %s", err)
            self.events = None
        if self._lock_handle is not None:
            self._lock_handle.close()
            self._lock_handle = None
        self.engine.dispose()

    def release_leases(self, error: str = "scheduler stopped", keep: frozenset[int] = frozenset()) -> int:
        """Hand every stage this scheduler holds back to the queue through the database alone, for a stop while
        Ray goes down too (its head stopped by the same SIGTERM), when close() would block on Ray. Attempts are
        charged up to now and, as in close(), the interruption spends none of the stage's attempts. The
        stages in `keep` (ids) are kept: after a database outage, those whose Ray tasks are still in flight."""
        now = utcnow()
        with self.sessions.begin() as session:
            # Wait briefly for locks: the loop may be stuck inside a transaction, holding them until the process
            # ends. Then this gives up, and the leases expire (and `up` on SQLite requeues them when it starts).
            if is_sqlite(self.settings.database_url):
                session.execute(text("PRAGMA busy_timeout = 2000"))
            else:
                session.execute(text("SET LOCAL lock_timeout = '2s'"))
            held = session.scalars(
                select(Stage).where(Stage.lease_owner == self.owner, Stage.status == Status.RUNNING.value,
                                    Stage.id.not_in(keep))
            ).all()
            for stage in held:
                running = session.scalars(select(Attempt).where(
                    Attempt.stage_id == stage.id, Attempt.worker == self.owner, Attempt.status == Status.RUNNING.value))
                for attempt in running:
                    wall = max(0.0, (now - attempt.started_at).total_seconds())
                    if advance(session, Attempt, attempt.id, Status.RUNNING, Status.FAILED, exit="interrupted",
                               error=error, ended_at=now, wall_seconds=wall, gpu_seconds=wall * attempt.num_gpus):
                        stage.attempts -= 1
                cancelled = session.scalar(select(Build.cancel_requested).where(Build.id == stage.build_id))
                self._after_failure(session, stage, error, True, cancelled)
        return len(held)

    def run(self, until: Callable[[], bool] | None = None, idle_exit: bool = False, timeout: float | None = None) -> None:
        """Tick until `until()` is true, or (with idle_exit) no work is left, or `timeout` seconds pass.
        A lost database connection is waited out (`_wait_for_database`); any other error ends the loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                busy = self.tick()
                if until is not None and until():
                    return
                if idle_exit and not busy and not self.inflight and not self._work_left():
                    return
            except DBAPIError as err:
                if not is_connection_error(err):
                    raise
                if self._wait_for_database(err, until, deadline):
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"scheduler {self.owner} still busy after {timeout} s")

    def _wait_for_database(self, err: DBAPIError, until: Callable[[], bool] | None, deadline: float | None) -> bool:
        """Wait out a database outage: back off (db_retry_base_seconds, doubling up to db_retry_max_seconds),
        drop the pool's connections and try again until the database answers, then put right what the outage
        interrupted (`_after_outage`). True if `until()` came true meanwhile (a stop asked for); a deadline
        that passes raises TimeoutError. Ray tasks keep running and are collected once it is back."""
        lost, delay = time.monotonic(), self.settings.db_retry_base_seconds
        while True:
            DATABASE_OUTAGES.error()
            log.warning("database unreachable (%s); scheduler %s retries in %g s", _first_line(err), self.owner, delay)
            if self._sleep_unless(until, delay, deadline):
                return True
            self.engine.dispose()  # connections to the server that went away are dead: open fresh ones
            try:
                with self.engine.connect() as connection:
                    connection.execute(text("SELECT 1"))
                self._after_outage()
                break
            except DBAPIError as again:
                if not is_connection_error(again):
                    raise
                err, delay = again, min(self.settings.db_retry_max_seconds, delay * 2)
        DATABASE_OUTAGES.reconnected()
        log.warning("database reachable again after %.1f s; scheduler %s resumes", time.monotonic() - lost, self.owner)
        return False

    def _sleep_unless(self, until: Callable[[], bool] | None, seconds: float, deadline: float | None) -> bool:
        """Sleep `seconds` in short steps; True as soon as `until()` is true (one that needs the database
        cannot say so now: it counts as false). Past `deadline`, TimeoutError."""
        end = time.monotonic() + seconds
        while True:
            if until is not None:
                try:
                    if until():
                        return True
                except DBAPIError as err:
                    if not is_connection_error(err):
                        raise
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"scheduler {self.owner}: the database is still unreachable at the deadline")
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.25, left))

    def _after_outage(self) -> None:
        """The database is back: renew my leases at once, and hand back to the queue the stages leased to me that
        no Ray task of mine runs (the outage cut their dispatch short, or the recording of their end); their
        attempts are charged up to now and spend none of the stage's retries."""
        self._last_heartbeat = 0.0
        orphans = self.release_leases("the database connection was lost while the stage was being dispatched",
                                      keep=frozenset(info.stage_id for info in self.inflight.values()))
        if orphans:
            log.warning("%d stages whose dispatch the outage interrupted go back to the queue", orphans)

    def run_until_done(self, build_ids: list[str], timeout: float = 600.0) -> None:
        self.run(until=lambda: all(self.status(b) in TERMINAL for b in build_ids), timeout=timeout)

    def status(self, build_id: str) -> Status:
        with self.sessions() as session:
            return Status(session.scalar(select(Build.status).where(Build.id == build_id)))

    def tick(self) -> bool:
        self._maybe_heartbeat()
        now = time.monotonic()
        if now - self._last_sweep >= min(1.0, self.settings.lease_seconds / 3):
            self._requeue_expired()
            self._finalize_open_builds()
            self._last_sweep = now
        if now - self._last_store_sweep >= STORE_SWEEP_SECONDS:
            self._sweep_store()
            self._last_store_sweep = now
        self._cancel_requested()
        dispatched = self._lease_and_dispatch()
        collected = self._collect()
        # Every drain is a round trip to the queue actor plus a transaction; draining every tick
        # cost the driver and the queue actor ~2% of a core more than this while both cores
        # computed. Four a second keep logs live; a tick that finished a stage still drains at
        # once, so its last events land with its status.
        if collected or now - self._last_drain >= EVENT_DRAIN_SECONDS:
            self._drain_events()
            self._last_drain = now
        return bool(dispatched or collected)

    # ------------------------------------------------------------------ leases

    def _lease_until(self):
        return utcnow() + timedelta(seconds=self.settings.lease_seconds)

    def _maybe_heartbeat(self) -> None:
        """Renew my leases every third of their life; also called inside long loops, since a
        lease that lapses while this scheduler is merely busy would let another one re-run the stage."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.settings.lease_seconds / 3:
            self._heartbeat()
            self._last_heartbeat = now

    def _heartbeat(self) -> None:
        with self.sessions.begin() as session:
            session.execute(
                update(Stage)
                .where(Stage.lease_owner == self.owner, Stage.status == Status.RUNNING.value)
                .values(lease_expires_at=self._lease_until())
            )
            # What a lease-expired attempt is charged up to (see _requeue_expired).
            session.execute(
                update(Attempt)
                .where(Attempt.worker == self.owner, Attempt.status == Status.RUNNING.value)
                .values(heartbeat_at=utcnow())
            )

    def _requeue_expired(self, unexpired_too: bool = False) -> None:
        """Stages whose lease ran out (their scheduler died) go back to the queue, or fail when out of attempts.

        `unexpired_too`: every other scheduler's lease, for a scheduler that holds the SQLite writer lock at start
        (no other can be running, so the holder died: its stages need not wait out their lease)."""
        lapsed = true() if unexpired_too else Stage.lease_expires_at < utcnow()
        with self.sessions.begin() as session:
            expired = session.scalars(
                select(Stage)
                .where(Stage.status == Status.RUNNING.value, lapsed, Stage.lease_owner != self.owner)
                .with_for_update(skip_locked=True)
            ).all()
            for stage in expired:
                attempt = session.scalar(
                    select(Attempt).where(Attempt.stage_id == stage.id, Attempt.status == Status.RUNNING.value)
                )
                if attempt is not None:
                    # Charge the attempt up to the last sign of life of its scheduler, not for the outage
                    # until this one noticed (a dead scheduler's Ray tasks die with it).
                    last_alive = max(attempt.heartbeat_at or attempt.started_at, attempt.started_at)
                    wall = (last_alive - attempt.started_at).total_seconds()
                    advance(session, Attempt, attempt.id, Status.RUNNING, Status.FAILED, exit="lease_expired",
                            error=f"lease of {stage.lease_owner} expired", ended_at=utcnow(), wall_seconds=wall,
                            gpu_seconds=wall * attempt.num_gpus)
                cancelled = session.scalar(select(Build.cancel_requested).where(Build.id == stage.build_id))
                self._after_failure(session, stage, f"lease of {stage.lease_owner} expired", True, cancelled)

    def _ready_stages(self, session, limit: int) -> list[Stage]:
        upstream = aliased(Stage)
        blocked = exists().where(
            StageInput.stage_id == Stage.id, StageInput.upstream_id == upstream.id,
            upstream.status != Status.SUCCEEDED.value,
        )
        now = utcnow()
        query = (
            select(Stage)
            .join(Build, Build.id == Stage.build_id)
            .where(Stage.status == Status.QUEUED.value, (Stage.not_before.is_(None)) | (Stage.not_before <= now),
                   Build.cancel_requested.is_(False), ~blocked)
            .order_by(Stage.id)
            .limit(limit)
            .with_for_update(of=Stage, skip_locked=True)
        )
        return session.scalars(query).all()

    def _lease_and_dispatch(self) -> int:
        room = self.max_inflight - len(self.inflight)
        if room <= 0:
            return 0
        with self.sessions.begin() as session:
            leased = []
            for stage in self._ready_stages(session, room):
                if advance(session, Stage, stage.id, Status.QUEUED, Status.RUNNING, lease_owner=self.owner,
                           lease_expires_at=self._lease_until(), started_at=stage.started_at or utcnow()):
                    leased.append(stage.id)
                    advance(session, Build, stage.build_id, Status.QUEUED, Status.RUNNING, started_at=utcnow())
        for stage_id in leased:
            self._maybe_heartbeat()
            self._dispatch(stage_id)
        return len(leased)

    # ------------------------------------------------------------------ dispatch

    def _upload(self, session, tenant: str, value: str) -> ArtifactRef:
        """The stored artifact of an `upload:<digest>` the build names (checked at submit; it may have been
        deleted since, which fails the stage for good)."""
        ref = upload_ref(session, tenant, value)
        if ref is None:
            raise FileNotFoundError(f"{value} is no upload of tenant {tenant} (deleted since the build was submitted?)")
        return ref

    def _inputs(self, session, stage: Stage, tenant: str) -> dict[str, ArtifactRef | ExternalInput]:
        inputs = {}
        for edge in stage.inputs:
            if edge.external is not None and upload_digest(edge.external) is not None:
                inputs[edge.name] = self._upload(session, tenant, edge.external)  # fetched and verified as an artifact
                continue
            if edge.external is not None:
                inputs[edge.name] = ExternalInput(edge.external)
                continue
            artifact = session.scalar(
                select(Artifact).where(Artifact.stage_id == edge.upstream_id, Artifact.name == edge.upstream_output)
            )
            inputs[edge.name] = ArtifactRef(artifact.uri, artifact.digest, artifact.size)
        return inputs

    def _cache_key(self, stage: Stage, registration: contract.Stage, inputs, runtime: dict[str, str],
                   tenant: str) -> str:
        """The stage's content address. It includes the tenant: the stage cache is per tenant, so an
        identical build of another tenant runs its stages anew instead of hitting ours, and a cache hit
        never tells a tenant that someone else built this model (nor hands it their artifacts)."""
        digests = {
            name: ref.digest if isinstance(ref, ArtifactRef) else path_fingerprint(ref.path)
            for name, ref in inputs.items()
        }
        hashed_runtime = {
            name: hashlib.sha256(value.encode()).hexdigest()
            for name, value in runtime.items()
            if self.runtime[name].affects_output
        }
        named = registration.settings.model_validate(stage.settings).named_paths()
        material = {
            "tenant": tenant, "stage": registration.name, "stage_version": registration.version, "pipeline": PIPELINE_VERSION,
            "settings": stage.settings, "inputs": digests, "runtime": hashed_runtime,
            "files": named_files_fingerprint(named),  # what a calibration file etc. holds, not only its name
        }
        return hashlib.sha256(canonical_json(material)).hexdigest()

    def _unschedulable(self, resources: dict) -> list[tuple[str, str]]:
        """The requests no node can ever grant: Ray would keep such a task pending for good, the
        stage "running" and its build holding the tenant's concurrency quota."""
        capacity = current_capacity(self.settings.max_task_resources)
        return capacity.problems(resources) if capacity is not None else []

    def _cached_outputs(self, session, stage: Stage, registration: contract.Stage) -> dict[str, ArtifactRef] | None:
        donors = session.scalars(
            select(Stage.id).where(Stage.cache_key == stage.cache_key, Stage.status == Status.SUCCEEDED.value,
                                   Stage.id != stage.id).order_by(Stage.id.desc()).limit(5)
        ).all()
        for donor in donors:
            rows = {a.name: a for a in session.scalars(select(Artifact).where(Artifact.stage_id == donor))}
            if not set(registration.outputs) <= set(rows):
                continue
            refs = {name: ArtifactRef(rows[name].uri, rows[name].digest, rows[name].size) for name in registration.outputs}
            if all(self.store.artifact_exists(ref) for ref in refs.values()):
                return refs
        return None

    def _dispatch(self, stage_id: int) -> None:
        with self.sessions.begin() as session:
            stage = session.get(Stage, stage_id)
            build = session.get(Build, stage.build_id)
            registration = self.registry.get(stage.type)
            try:
                inputs = self._inputs(session, stage, build.tenant_id)
                # The same Settings the spec was validated into at submit, rebuilt from its stored JSON.
                settings = registration.settings.model_validate(stage.settings)
                uploads = {value: self._upload(session, build.tenant_id, value)
                           for value in settings.named_paths() if upload_digest(value) is not None}
                runtime = {name: self.runtime[name].provide(build) for name in registration.runtime}
                if build.spec.get("cache", True):
                    stage.cache_key = self._cache_key(stage, registration, inputs, runtime, build.tenant_id)
                    cached = self._cached_outputs(session, stage, registration) if stage.cache_key else None
                else:
                    cached = None
                granted = granted_resources(stage.resources, build.spec.get("accelerator", "auto"),
                                            cluster_gpus(self.settings.max_task_resources))
                if cached is None and (unfit := self._unschedulable(granted)):
                    raise Unschedulable("; ".join(f"{name}: {message}" for name, message in unfit))
            except Exception as err:  # a missing signing key is permanent; a store that is down is not
                if is_connection_error(err):
                    raise  # the database went away: the stage goes back to the queue once it is back
                stage.attempts += 1  # a failed dispatch spends an attempt, so retries stay bounded
                self._after_failure(session, stage, f"{type(err).__name__}: {err}", isinstance(err, StoreError), False)
                return
            if cached is not None:
                session.add(Event(build_id=build.id, stage_id=stage.id, kind="state", message="cache hit"))
        if cached is not None:
            try:
                self._register_package(registration, stage_id, cached)
            except Exception as err:
                if is_connection_error(err):
                    raise
                with self.sessions.begin() as session:
                    stage = session.get(Stage, stage_id)
                    stage.attempts += 1
                    self._after_failure(session, stage, f"{type(err).__name__}: {err}", isinstance(err, StoreError), False)
                return
            self._succeed(stage_id, cached, cache_hit=True)
            return
        with self.sessions.begin() as session:
            stage = session.get(Stage, stage_id)
            # Numbers are unique per stage; `attempts` counts those that spend the retry budget.
            number = (session.scalar(select(func.max(Attempt.number)).where(Attempt.stage_id == stage_id)) or 0) + 1
            stage.attempts += 1
            attempt = Attempt(stage_id=stage.id, number=number, worker=self.owner, heartbeat_at=utcnow(),
                              num_cpus=float(granted.get("num_cpus") or 0),
                              num_gpus=float(granted.get("num_gpus") or 0))
            session.add(attempt)
            session.flush()
            task = StageTask(
                build_id=stage.build_id, stage_id=stage.id, stage_key=stage.key, attempt=number,
                run=registration.run, inputs=inputs, outputs=registration.outputs,
                settings=settings, store=self.settings.store, uploads=uploads,
                # Configured roots only: the embedded default trusts its own (demo, tests) submissions.
                source_roots=tuple(map(str, self.settings.allowed_source_roots)) if self.settings.source_roots else (),
                output_prefix=attempt_prefix(stage.build_id, stage.key, number), runtime=runtime,
                device=device_for(granted),
            )
            info = Inflight(stage.id, stage.build_id, stage.key, registration, attempt.id, number, attempt.num_gpus)
            session.add(Event(build_id=stage.build_id, stage_id=stage.id, attempt=number, kind="state",
                              message=f"dispatched attempt {number} to Ray with {granted}"))
            resources = granted
        # Submit only once the attempt row is committed: every Ray task has its record.
        try:
            self.inflight[submit(task, resources, self.events)] = info
        except Exception as err:  # e.g. resources no node can ever offer
            self._finish_attempt(info, {"ok": False, "error": f"{type(err).__name__}: {err}", "retryable": False},
                                 exit="error")

    # ------------------------------------------------------------------ results

    def _collect(self) -> int:
        if not self.inflight:
            time.sleep(self.settings.poll_seconds)
            return 0
        done, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight),
                           timeout=self.settings.poll_seconds, fetch_local=True)
        for ref in done:
            self._maybe_heartbeat()
            info = self.inflight[ref]
            exit_reason = None
            try:
                result = ray.get(ref)
            except ray.exceptions.TaskCancelledError:
                result, exit_reason = {"ok": False, "error": "cancelled", "retryable": False}, "cancelled"
            except ray.exceptions.RayError as err:  # the worker process died, or Ray lost the task
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                result = {"ok": False, "error": f"{type(err).__name__}: {first_line}", "retryable": True}
                exit_reason = "crashed"
            self._record(info, result, exit_reason)
            # Only once recorded: a database lost while recording leaves the task here, recorded on a later tick
            # (every step of _record is idempotent), instead of its stage leased to me for good with no task.
            del self.inflight[ref]
        return len(done)

    def _record(self, info: Inflight, result: dict[str, Any], exit_reason: str | None) -> None:
        if result["ok"]:
            try:
                self._register_package(info.registration, info.stage_id, result["outputs"])
            except Exception as err:  # e.g. PublishRefused (permanent) or the store went away (retry)
                if is_connection_error(err):
                    raise  # the database went away, not the stage's fault: recorded again once it is back
                result = {**result, "ok": False, "error": f"{type(err).__name__}: {err}",
                          "retryable": isinstance(err, StoreError)}
                exit_reason = "error"
        self._finish_attempt(info, result, exit=exit_reason or ("ok" if result["ok"] else "error"))
        if result["ok"]:
            self._succeed(info.stage_id, result["outputs"], cache_hit=False)

    def _register_package(self, registration: contract.Stage, stage_id: int, outputs: dict[str, ArtifactRef]) -> None:
        """A stage whose output is a finished package (`publishes`): register it under the spec's publish target."""
        if registration.publishes is None:
            return
        with self.sessions() as session:
            stage = session.get(Stage, stage_id)
            build = session.get(Build, stage.build_id)
        register_package(PublishContext(self.sessions, self.store, build, stage, outputs[registration.publishes]))

    def _finish_attempt(self, info: Inflight, result: dict[str, Any], exit: str) -> None:
        """Record the attempt's compute and outcome; on failure retry, fail or cancel the stage."""
        wall = result.get("wall_seconds") or (time.monotonic() - info.started)
        status = Status.SUCCEEDED if result["ok"] else (Status.CANCELLED if exit == "cancelled" else Status.FAILED)
        with self.sessions.begin() as session:
            ended = advance(session, Attempt, info.attempt_id, Status.RUNNING, status, exit=exit,
                            error=result.get("error"), wall_seconds=wall, cpu_seconds=result.get("cpu_seconds") or 0.0,
                            gpu_seconds=wall * info.num_gpus, ended_at=utcnow(),
                            **{name: result[name] for name in TRAFFIC if result.get(name) is not None})
            # Not ended here: recorded already (this is a retry of a recording a lost database cut short), or
            # another scheduler took the stage over. Either way its failure is not this call's to handle.
            if not result["ok"] and ended:
                stage = session.get(Stage, info.stage_id)
                if stage.status == Status.RUNNING.value and stage.lease_owner == self.owner:
                    if exit == "interrupted":  # a clean stop is not the stage's fault: don't spend an attempt
                        stage.attempts -= 1
                    self._after_failure(session, stage, result["error"], result.get("retryable", False),
                                        exit == "cancelled")
                    session.add(Event(build_id=info.build_id, stage_id=info.stage_id, attempt=info.number,
                                      kind="log", level="error", message=f"attempt {info.number} {exit}: {result['error']}"))

    def _after_failure(self, session, stage: Stage, error: str, retryable: bool, cancelled: bool) -> None:
        released = dict(lease_owner=None, lease_expires_at=None)
        if cancelled:
            advance(session, Stage, stage.id, stage.status, Status.CANCELLED, error="build cancelled",
                    finished_at=utcnow(), **released)
        elif retryable and stage.attempts < stage.max_attempts:
            delay = backoff_seconds(self.settings, stage.attempts)
            advance(session, Stage, stage.id, stage.status, Status.QUEUED, error=error,
                    not_before=utcnow() + timedelta(seconds=delay), **released)
            session.add(Event(build_id=stage.build_id, stage_id=stage.id, kind="state",
                              message=f"retrying in {delay:.1f} s after: {error}"))
        else:
            advance(session, Stage, stage.id, stage.status, Status.FAILED, error=error, finished_at=utcnow(), **released)
            # Nothing downstream can run now; stop the queued rest of the build.
            session.execute(
                update(Stage)
                .where(Stage.build_id == stage.build_id, Stage.status == Status.QUEUED.value)
                .values(status=Status.CANCELLED.value, error=f"skipped: stage {stage.key} failed", finished_at=utcnow())
            )
        self._finalize(session, stage.build_id)

    def _succeed(self, stage_id: int, outputs: dict[str, ArtifactRef], cache_hit: bool) -> None:
        with self.sessions.begin() as session:
            stage = session.get(Stage, stage_id)
            won = advance(session, Stage, stage_id, Status.RUNNING, Status.SUCCEEDED, Stage.lease_owner == self.owner,
                          cache_hit=cache_hit, finished_at=utcnow(), error=None, lease_owner=None,
                          lease_expires_at=None)
            if not won:  # our lease was taken over meanwhile; the other attempt's result counts
                log.warning("stage %s of %s was no longer ours; result dropped", stage.key, stage.build_id)
                return
            for name, ref in outputs.items():
                session.add(Artifact(stage_id=stage_id, name=name, uri=ref.key, digest=ref.digest, size=ref.size))
            self._finalize(session, stage.build_id)

    # ------------------------------------------------------------------ builds

    def _finalize(self, session, build_id: str) -> None:
        """Close the build if every stage is terminal (locks the build row, so only one closer wins)."""
        build = session.get(Build, build_id, with_for_update=True, populate_existing=True)
        if Status(build.status) in TERMINAL:
            return
        counts = dict(session.execute(
            select(Stage.status, func.count()).where(Stage.build_id == build_id).group_by(Stage.status)
        ).all())
        if counts.get(Status.QUEUED.value) or counts.get(Status.RUNNING.value):
            return
        if counts.get(Status.FAILED.value):
            error = session.scalar(
                select(Stage.key + ": " + Stage.error).where(Stage.build_id == build_id, Stage.status == Status.FAILED.value)
                .order_by(Stage.finished_at).limit(1)
            )
            new = Status.FAILED
        elif build.cancel_requested or counts.get(Status.CANCELLED.value):
            new, error = Status.CANCELLED, "cancelled"
        else:
            new, error = Status.SUCCEEDED, None
        advance(session, Build, build_id, build.status, new, error=error, finished_at=utcnow())
        session.add(Event(build_id=build_id, kind="state", message=f"build {new.value}" + (f": {error}" if error else "")))

    def _finalize_open_builds(self) -> None:
        unfinished = exists().where(Stage.build_id == Build.id,
                                    Stage.status.in_([Status.QUEUED.value, Status.RUNNING.value]))
        with self.sessions.begin() as session:
            for build_id in session.scalars(
                select(Build.id).where(Build.status.in_([Status.QUEUED.value, Status.RUNNING.value]), ~unfinished)
            ):
                self._finalize(session, build_id)

    def _cancel_requested(self) -> None:
        if not self.inflight:
            return
        with self.sessions() as session:
            doomed = set(session.scalars(
                select(Build.id).where(Build.id.in_({i.build_id for i in self.inflight.values()}),
                                       Build.cancel_requested.is_(True))
            ))
        for ref, info in list(self.inflight.items()):
            if info.build_id in doomed:
                ray.cancel(ref, force=True)  # kills the worker process: the stage really stops
                del self.inflight[ref]
                self._finish_attempt(info, {"ok": False, "error": "cancelled"}, exit="cancelled")

    def _sweep_store(self) -> None:
        """Delete partial outputs of attempts that died a while ago (cluster.sweeper); best effort."""
        grace = timedelta(seconds=max(60.0, 2 * self.settings.lease_seconds))
        try:
            sweep_dead_outputs(self.sessions, self.store, utcnow() - grace)
        except Exception as err:  # a store that is down now is swept later; the build must go on
            log.warning("store sweep failed: %s", err)

    def _work_left(self) -> bool:
        with self.sessions() as session:
            return bool(session.scalar(
                select(func.count()).select_from(Stage).where(Stage.status.in_([Status.QUEUED.value, Status.RUNNING.value]))
            ))

    # ------------------------------------------------------------------ events

    def _drain_events(self) -> None:
        if self.events is None:
            return
        try:
            count = self.events.qsize()
            batch = self.events.get_nowait_batch(count) if count else []
        except Exception:  # the queue actor is gone; events are best effort
            batch = []
        batch, self._undelivered = self._undelivered + batch, []
        if not batch:
            return
        self._undelivered = batch  # until they are committed: a lost database keeps them for the next drain
        with self.sessions.begin() as session:
            for event in batch:
                session.add(Event(
                    build_id=event["build_id"], stage_id=event.get("stage_id"), attempt=event.get("attempt"),
                    kind=event.get("kind", "log"), level=event.get("level", "info"), message=str(event.get("message", "")),
                    data=event.get("data"),
                ))
        self._undelivered = []


def _first_line(err: BaseException) -> str:
    message = str(getattr(err, "orig", None) or err).strip()
    return message.splitlines()[0] if message else type(err).__name__


def default_runtime(settings: Settings) -> dict[str, RuntimeValue]:
    return {
        "build_id": RuntimeValue(lambda build: build.id, affects_output=False),
        "signing_key": RuntimeValue(lambda build: settings.signing_key_pem().decode(), affects_output=True),
    }


