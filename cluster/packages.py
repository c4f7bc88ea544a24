"""Registering a published package: files under packages/<name>/<version>/, then the package row.

Store layout (what device_sdk.pull reads from a bucket):
    packages/<name>/<version>/…      the package, manifest.json copied last
    packages/<name>/aliases/<alias>  text: the version the alias points to

Versions are immutable: publishing a name and version again is refused unless it is the very
same manifest (an identical, cached resubmission). Aliases move. The package row (with its
aliases, in one transaction) is written after every file is in place, so a reader that finds
the row finds a complete package. The alias rows are the truth; the alias objects in the store
are derived from them and rewritten on every publish attempt (the "nothing to do" retry too), so a
crash between the row's commit and the objects' write is repaired by the retry.

Each manifest carries a signed `sequence` (device_sdk.format.Manifest): `next_sequence` is one more
than the highest registered for the name, handed to the publish stage before it signs, and a
manifest whose sequence is not above every registered one is refused here (two builds raced).
"""

from __future__ import annotations

import hashlib
import json

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


def manifest_sequence(raw: bytes) -> int:
    """The `sequence` of a manifest's bytes (0: a manifest from before sequences, or none readable)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return 0
    value = data.get("sequence", 0) if isinstance(data, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def highest_sequence(session, store, name: str) -> int:
    """The highest manifest sequence among the registered versions of `name` (0 when none has one)."""
    uris = session.scalars(select(Package.uri).where(Package.name == name)).all()
    return max((manifest_sequence(store.get_bytes(f"{uri}/{MANIFEST}")) for uri in uris), default=0)


def next_sequence(session, store, name: str) -> int:
    """The sequence the next publish of `name` signs: one more than the highest registered."""
    return highest_sequence(session, store, name) + 1


def write_alias_objects(session, store, name: str, aliases: list[str]) -> None:
    """Write each alias object from its row (what the row says now, not what this build asked for)."""
    for alias in aliases:
        row = session.get(Alias, (name, alias))
        if row is not None:
            store.put_bytes(alias_key(name, alias), session.get(Package, row.package_id).version.encode())


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
        with ctx.sessions() as session:  # a crash after the row's commit left them unwritten: repair them
            write_alias_objects(session, ctx.store, name, aliases)
        _log(ctx, f"{name} {version} already published with the same manifest; alias objects rewritten")
        return
    sequence = manifest_sequence(ctx.store.get_bytes(f"{ref.key}/files/{MANIFEST}"))
    with ctx.sessions() as session:
        highest = highest_sequence(session, ctx.store, name)
    if highest and sequence <= highest:
        raise PublishRefused(f"{name} {version} has manifest sequence {sequence}, not above sequence {highest} "
                             "already published for the name (another build published first); build it again")
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
    with ctx.sessions() as session:
        write_alias_objects(session, ctx.store, name, aliases)


def _log(ctx, message: str) -> None:
    with ctx.sessions.begin() as session:
        session.add(Event(build_id=ctx.build.id, stage_id=ctx.stage.id, kind="state", message=message))
