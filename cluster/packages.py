"""Registering a published package: files under packages/<name>/<version>/, then the package row.

Store layout (what device_sdk.pull reads from a bucket):
    packages/<name>/<version>/…      the package, manifest.json copied last
    packages/<name>/aliases/<alias>  text: the version the alias points to

Versions are immutable: publishing a name and version again is refused unless it is the very
same manifest (an identical, cached resubmission). Aliases move. The package row (with its
aliases, in one transaction) is written after every file is in place, so a reader that finds
the row finds a complete package.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from cluster.models import Alias, Build, Event, Package, utcnow
from device_sdk.format import MANIFEST


class PublishRefused(ValueError):
    """The name and version are already published with different content."""


def package_prefix(name: str, version: str) -> str:
    return f"packages/{name}/{version}"


def alias_key(name: str, alias: str) -> str:
    return f"packages/{name}/aliases/{alias}"


def name_owner(session, name: str) -> str | None:
    """The tenant whose builds published `name`: package names are one namespace, owned by one tenant."""
    return session.scalar(
        select(Build.tenant_id).join(Package, Package.build_id == Build.id).where(Package.name == name).limit(1)
    )


def register_package(ctx) -> None:
    """Register the package a stage made (its `publishes` output; ctx: cluster.scheduler.PublishContext)."""
    target = ctx.build.spec["publish"]
    name, version, aliases = target["name"], target["version"], target.get("aliases", [])
    ref = ctx.package
    index = ctx.store.read_index(ref)
    manifest_sha = next((f["sha256"] for f in index["files"] if f["path"] == MANIFEST), None)
    if manifest_sha is None:
        raise PublishRefused(f"artifact {ref.key} has no {MANIFEST}")
    prefix = package_prefix(name, version)
    with ctx.sessions() as session:
        existing = session.scalar(select(Package).where(Package.name == name, Package.version == version))
        owner = name_owner(session, name)
    if owner is not None and owner != ctx.build.tenant_id:  # nor may it move that tenant's aliases
        raise PublishRefused(f"package name {name} belongs to another tenant")
    if existing is not None:
        if existing.manifest_sha256 != manifest_sha:
            raise PublishRefused(f"{name} {version} is already published (by build {existing.build_id}); versions are immutable")
        _log(ctx, f"{name} {version} already published with the same manifest; nothing to do")
        return
    if ctx.store.exists(f"{prefix}/{MANIFEST}"):
        stored = hashlib.sha256(ctx.store.get_bytes(f"{prefix}/{MANIFEST}")).hexdigest()
        if stored != manifest_sha:
            raise PublishRefused(f"{prefix} already holds a different package; versions are immutable")
    files = sorted((f["path"] for f in index["files"]), key=lambda p: p == MANIFEST)  # manifest last
    for path in files:
        ctx.store.copy(f"{ref.key}/files/{path}", f"{prefix}/{path}")
    try:
        with ctx.sessions.begin() as session:
            package = Package(name=name, version=version, build_id=ctx.build.id, uri=prefix, manifest_sha256=manifest_sha)
            session.add(package)
            session.flush()
            for alias in aliases:
                row = session.get(Alias, (name, alias), with_for_update=True)
                if row is None:
                    session.add(Alias(package_name=name, alias=alias, package_id=package.id))
                else:
                    row.package_id, row.updated_at = package.id, utcnow()
            session.add(Event(build_id=ctx.build.id, stage_id=ctx.stage.id, kind="state",
                              message=f"published {name} {version} at {prefix}; aliases {aliases}"))
    except IntegrityError:
        raise PublishRefused(f"{name} {version} was published concurrently by another build") from None
    # Alias objects let devices resolve `latest` straight from the bucket (device_sdk.pull layout);
    # they move only once the version they name is registered.
    for alias in aliases:
        ctx.store.put_bytes(alias_key(name, alias), version.encode())


def _log(ctx, message: str) -> None:
    with ctx.sessions.begin() as session:
        session.add(Event(build_id=ctx.build.id, stage_id=ctx.stage.id, kind="state", message=message))
