"""The store sweeper: delete what dead attempts uploaded and nothing references.

A worker writes a stage's outputs under `builds/<build>/<stage>/a<attempt>/`; the scheduler records
them as Artifact rows only when the attempt succeeds. An attempt that failed, crashed, was cancelled
or lost its lease may have uploaded part of an output first (a 108 MB weights file, say), and nothing
would ever read or delete it. The sweeper deletes such an attempt's prefix once the attempt has been
over for a grace period (a force-cancelled Ray task may still be finishing a write), unless an
Artifact row (its own stage's, or a cache hit's that reuses it) points into the prefix. It marks the
attempt swept, so each prefix is listed once. The scheduler runs it periodically; it is idempotent
and safe with several schedulers (a prefix deleted twice is deleted once).
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import exists, select, update

from cluster.models import Artifact, Attempt, Stage, utcnow
from cluster.states import Status
from workers.store import ArtifactStore

log = logging.getLogger("elastify.sweeper")
DEAD = (Status.FAILED.value, Status.CANCELLED.value)


def attempt_prefix(build_id: str, stage_key: str, number: int) -> str:
    """Where attempt `number` of a stage writes its outputs (the scheduler's StageTask.output_prefix)."""
    return f"builds/{build_id}/{stage_key}/a{number}"


def sweep_dead_outputs(sessions, store: ArtifactStore, ended_before: datetime, limit: int = 100) -> dict[str, int]:
    """Delete the outputs of up to `limit` failed or cancelled attempts that ended before `ended_before`
    and that no Artifact row references; return {prefix: objects deleted} of the prefixes deleted."""
    with sessions() as session:
        dead = session.execute(
            select(Attempt.id, Attempt.number, Stage.build_id, Stage.key)
            .join(Stage, Stage.id == Attempt.stage_id)
            .where(Attempt.status.in_(DEAD), Attempt.ended_at.is_not(None), Attempt.ended_at < ended_before,
                   Attempt.outputs_swept_at.is_(None))
            .order_by(Attempt.id).limit(limit)
        ).all()
    deleted: dict[str, int] = {}
    for attempt_id, number, build_id, stage_key in dead:
        prefix = attempt_prefix(build_id, stage_key, number)
        with sessions() as session:
            referenced = session.scalar(select(exists().where(
                (Artifact.uri == prefix) | Artifact.uri.startswith(prefix + "/", autoescape=True))))
        if not referenced:
            count = store.delete_prefix(prefix)
            if count:
                deleted[prefix] = count
                log.info("swept %d objects of dead attempt %s", count, prefix)
        with sessions.begin() as session:
            session.execute(update(Attempt).where(Attempt.id == attempt_id).values(outputs_swept_at=utcnow()))
    return deleted
