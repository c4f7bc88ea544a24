"""The one state machine for builds, stages and attempts: every status change goes through here.

    queued → running → succeeded | failed | cancelled
    a stage may also go running → queued (retry, or its lease expired) and
    queued → succeeded (cache hit) | cancelled (build cancelled, or an upstream stage failed)
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED})

BUILD_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.RUNNING, Status.FAILED, Status.CANCELLED}),
    Status.RUNNING: frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}),
}
STAGE_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.RUNNING, Status.SUCCEEDED, Status.CANCELLED, Status.FAILED}),
    Status.RUNNING: frozenset({Status.QUEUED, Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}),
}
ATTEMPT_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.RUNNING: frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}),
}
TRANSITIONS = {"build": BUILD_TRANSITIONS, "stage": STAGE_TRANSITIONS, "attempt": ATTEMPT_TRANSITIONS}


# A user's retry (cluster.service.retry_build) reopens what failed or was cancelled: → queued.
# Only that explicit request does; `advance` never leaves a terminal state.
REOPENABLE = frozenset({Status.FAILED, Status.CANCELLED})


class IllegalTransition(RuntimeError):
    """A status change the state machine does not allow (a bug, or a lost race)."""


def check(kind: str, current: str, new: str) -> Status:
    current, new = Status(current), Status(new)
    if new not in TRANSITIONS[kind].get(current, frozenset()):
        raise IllegalTransition(f"{kind} cannot go from {current} to {new}")
    return new


def advance(session, model, ident, current: str, new: str, *conditions, **values) -> bool:
    """Move one Build/Stage/Attempt row from `current` to `new`, setting `values` too.

    The UPDATE only matches while the row is still in `current` (and meets `conditions`), so
    two schedulers racing on one row cannot both win: the loser gets False and moves on.
    """
    from sqlalchemy import update

    check(model.STATE_KIND, current, new)
    statement = (
        update(model)
        .where(model.id == ident, model.status == Status(current).value, *conditions)
        .values(status=Status(new).value, **values)
        .execution_options(synchronize_session=False)
    )
    return session.execute(statement).rowcount == 1


def reopen(session, model, ident, current: str, **values) -> bool:
    """Put a failed or cancelled Build/Stage row back to queued (a retry), if it is still in `current`."""
    from sqlalchemy import update

    if Status(current) not in REOPENABLE:
        raise IllegalTransition(f"{model.STATE_KIND} cannot be reopened from {current}")
    statement = (
        update(model)
        .where(model.id == ident, model.status == Status(current).value)
        .values(status=Status.QUEUED.value, **values)
        .execution_options(synchronize_session=False)
    )
    return session.execute(statement).rowcount == 1
