"""Bearer tokens per tenant: issued once, stored only as their sha256, never logged.

A token is 32 random bytes (urlsafe base64) behind the prefix `elst_`; with that much entropy a
plain sha256 is a safe verifier, and looking it up by hash reveals nothing about other tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.problems import ProblemError
from cluster.models import ApiToken
from cluster.service import ensure_tenant

TOKEN_PREFIX = "elst_"
bearer = HTTPBearer(auto_error=False, description="a tenant token from `elastify tokens create`")


@dataclass(frozen=True)
class Caller:
    tenant: str
    admin: bool

    @property
    def scope(self) -> str | None:
        """The tenant every query is limited to; None for admins, who see all tenants."""
        return None if self.admin else self.tenant


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(sessions: sessionmaker[Session], tenant: str, *, admin: bool = False, name: str = "") -> str:
    """Issue a token for `tenant` (created if new); the caller sees it once, the database keeps its hash."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with sessions.begin() as session:
        ensure_tenant(session, tenant)
        session.add(ApiToken(tenant_id=tenant, token_sha256=token_hash(token), name=name, is_admin=admin))
    return token


def _unauthorized(detail: str) -> ProblemError:
    return ProblemError(401, detail, kind="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def authenticate(sessions: sessionmaker[Session], token: str) -> Caller:
    digest = token_hash(token)
    with sessions() as session:
        row = session.scalar(select(ApiToken).where(ApiToken.token_sha256 == digest))
    if row is None or row.revoked_at is not None or not hmac.compare_digest(row.token_sha256, digest):
        raise _unauthorized("the token is not valid")
    return Caller(row.tenant_id, row.is_admin)


def current_caller(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer)) -> Caller:
    """FastAPI dependency: the authenticated caller, or 401."""
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise _unauthorized("send `Authorization: Bearer <token>`")
    return authenticate(request.app.state.sessions, credentials.credentials)
