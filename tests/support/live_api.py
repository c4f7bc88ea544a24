"""Client and CLI tests' server: the app of tests/support/api.py (SQLite, local store, no scheduler)
served on loopback, with real signed tiny packages published in it the way the publish stage does."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from api.app import ServerThread
from api.auth import create_token
from cluster.models import Alias, Package
from cluster.packages import alias_key, package_prefix
from cluster.service import submit_build
from cluster.spec import parse_spec
from device_sdk.format import MANIFEST, read_manifest
from tests.support.api import Api, finish_build, make_api, spec
from tests.support.services import free_port

KEY_SEED = 7  # tests.support.sdk_packages.signing_key(KEY_SEED) signs the packages


@dataclass
class LiveAPI:
    api: Api
    url: str
    packages: dict[str, Path] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    def token(self, tenant: str, admin: bool = False) -> str:
        """A bearer token of `tenant` (one per tenant, made on first use)."""
        if tenant not in self.tokens:
            self.tokens[tenant] = create_token(self.api.sessions, tenant, admin=admin)
        return self.tokens[tenant]

    @property
    def acme(self) -> str:
        return self.token("acme")

    @property
    def beta(self) -> str:
        return self.token("beta")

    def publish(self, package_dir: Path, tenant: str, aliases=("latest",)) -> str:
        """Register a signed package as the output of a finished build of `tenant`; the build id."""
        manifest = read_manifest(package_dir)
        build_id = submit_build(self.api.sessions, parse_spec(spec(manifest.name, manifest.version)),
                                self.api.app.state.registry, tenant)
        finish_build(self.api, build_id)
        prefix = package_prefix(manifest.name, manifest.version)
        files = sorted((p for p in package_dir.rglob("*") if p.is_file()), key=lambda p: p.name == MANIFEST)
        for path in files:  # manifest last, as the publish stage does
            self.api.store.put_file(f"{prefix}/{path.relative_to(package_dir).as_posix()}", path)
        with self.api.sessions.begin() as session:
            package = Package(name=manifest.name, version=manifest.version, build_id=build_id, uri=prefix,
                              manifest_sha256=hashlib.sha256((package_dir / MANIFEST).read_bytes()).hexdigest())
            session.add(package)
            session.flush()
            for alias in aliases:
                session.merge(Alias(package_name=manifest.name, alias=alias, package_id=package.id))
        for alias in aliases:
            self.api.store.put_bytes(alias_key(manifest.name, alias), manifest.version.encode())
        return build_id


def signed_versions(root: Path) -> dict[str, Path]:
    """Two signed versions of one tiny package: tiny 1.0.0 (with per-level adapters) and 2.0.0."""
    from tests.support.pipeline_packages import build_package, tiny_package
    from tests.support.sdk_packages import add_recovery_adapters, signing_key
    from tests.support.tiny import byte_tokenizer

    key = signing_key(KEY_SEED)
    model, first = tiny_package("llama_gqa", root / "1.0.0", key)
    add_recovery_adapters(first, key)
    second = build_package(model, byte_tokenizer(), root / "2.0.0", key, version="2.0.0")
    return {"1.0.0": first, "2.0.0": second}


@contextlib.contextmanager
def api_with_packages(root: Path, **make_api_args) -> Iterator[LiveAPI]:
    """The app on a free loopback port, where tenant acme published tiny 1.0.0 (`latest`) and 2.0.0.

    `make_api_args` go to tests.support.api.make_api (e.g. `database_url`, `store` for S3)."""
    packages = signed_versions(root / "built")
    api = make_api(root, **make_api_args)
    with ServerThread(api.app, port=free_port()) as server:
        live = LiveAPI(api, server.url, packages)
        live.publish(packages["1.0.0"], "acme", aliases=("latest",))
        live.publish(packages["2.0.0"], "acme", aliases=())
        yield live
    api.app.state.engine.dispose()
