"""A live Elastify API for client and CLI tests: the real app over SQLite and a local store, served by
uvicorn on loopback in a thread. No scheduler runs; `publish` registers a signed package the way the
publish stage does (files under packages/<name>/<version>/, then the package and alias rows)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import update

from cluster.models import Alias, Attempt, Build, Package, Stage
from cluster.packages import alias_key, package_prefix
from cluster.registry import Registry, StageRegistration
from cluster.settings import Settings
from cluster.spec import parse_spec
from device_sdk.package import MANIFEST


def two_stage_registry() -> Registry:
    """first -> second; nothing runs them here, builds stay queued until cancelled."""
    return Registry([
        StageRegistration(name="first", function="workers.testing:noop", outputs=("out",)),
        StageRegistration(name="second", function="workers.testing:noop", inputs={"x": "first.out"}, outputs=("out",)),
    ])


def spec_dict(name: str = "tiny", version: str = "1.0.0", **extra) -> dict:
    return {"source": {"model": "unused"}, "levels": [1.0], "publish": {"name": name, "version": version}, **extra}


@dataclass
class LiveAPI:
    url: str
    app: object
    settings: Settings

    @property
    def sessions(self):
        return self.app.state.sessions

    @property
    def store(self):
        return self.app.state.store

    def token(self, tenant: str, admin: bool = False) -> str:
        from api.auth import create_token

        return create_token(self.sessions, tenant, admin=admin)

    def publish(self, package_dir: Path, tenant: str, aliases=("latest",)) -> str:
        """Register a built, signed package as tenant's build output; return the build id."""
        from cluster.service import submit_build
        from device_sdk.package import read_manifest

        manifest = read_manifest(package_dir)
        spec = parse_spec(spec_dict(manifest.name, manifest.version))
        build_id = submit_build(self.sessions, spec, self.app.state.registry, tenant)
        prefix = package_prefix(manifest.name, manifest.version)
        files = sorted((p for p in package_dir.rglob("*") if p.is_file()), key=lambda p: p.name == MANIFEST)
        for path in files:  # manifest last, as the publish stage does
            self.store.put_file(f"{prefix}/{path.relative_to(package_dir).as_posix()}", path)
        with self.sessions.begin() as session:
            session.execute(update(Build).where(Build.id == build_id).values(status="succeeded"))
            package = Package(name=manifest.name, version=manifest.version, build_id=build_id, uri=prefix,
                              manifest_sha256=hashlib.sha256((package_dir / MANIFEST).read_bytes()).hexdigest())
            session.add(package)
            session.flush()
            for alias in aliases:
                row = session.get(Alias, (manifest.name, alias))
                if row is None:
                    session.add(Alias(package_name=manifest.name, alias=alias, package_id=package.id))
                else:
                    row.package_id = package.id
        for alias in aliases:
            self.store.put_bytes(alias_key(manifest.name, alias), manifest.version.encode())
        return build_id

    def record_attempt(self, build_id: str, stage_key: str, gpu_seconds: float, cpu_seconds: float = 1.0) -> None:
        """A finished attempt in the ledger, as a worker would report it."""
        with self.sessions.begin() as session:
            stage = session.query(Stage).filter_by(build_id=build_id, key=stage_key).one()
            stage.attempts += 1
            session.add(Attempt(stage_id=stage.id, number=stage.attempts, worker="test", status="succeeded", exit="ok",
                                wall_seconds=gpu_seconds, cpu_seconds=cpu_seconds, gpu_seconds=gpu_seconds,
                                num_gpus=1.0))


KEY_SEED = 7


def signed_versions(root: Path) -> dict[str, Path]:
    """Two signed versions of one tiny package, tiny 1.0.0 (with per-level adapters) and 2.0.0."""
    from tests.tiny import byte_tokenizer
    from tests.unit.sdk_packages import add_recovery_adapters, build_package, signing_key, tiny_package

    key = signing_key(KEY_SEED)
    model, first = tiny_package("llama_gqa", root / "1.0.0", key)
    add_recovery_adapters(first, key)
    second = build_package(model, byte_tokenizer(), root / "2.0.0", key, version="2.0.0")
    return {"1.0.0": first, "2.0.0": second}


@contextlib.contextmanager
def api_with_packages(root: Path) -> Iterator[LiveAPI]:
    """A live app where tenant acme published tiny 1.0.0 (`latest`) and 2.0.0; tokens `acme` and `beta`."""
    packages = signed_versions(root / "built")
    with live_api(root / "home") as live:
        live.packages = packages
        live.acme = live.token("acme")
        live.beta = live.token("beta")
        live.publish(packages["1.0.0"], "acme", aliases=("latest",))
        live.publish(packages["2.0.0"], "acme", aliases=())
        yield live


@contextlib.contextmanager
def live_api(home: Path, registry: Registry | None = None) -> Iterator[LiveAPI]:
    """The app on a free loopback port until the block ends."""
    import uvicorn

    from api.app import create_app
    from cluster.db import migrate
    from tests.integration.services import free_port

    settings = Settings(home=home)
    home.mkdir(parents=True, exist_ok=True)
    migrate(settings.database_url)
    settings.ensure_signing_key()
    app = create_app(settings, registry or two_stage_registry(), ready_checks={})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API server did not start")
        time.sleep(0.02)
    try:
        yield LiveAPI(f"http://127.0.0.1:{port}", app, settings)
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.engine.dispose()
