"""Bearer tokens: issued once, stored only as a SHA-256 hash."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.api.problems import Problem
from intentledger.engine.clock import Clock
from intentledger.store.ledger import Ledger

TOKEN_PREFIX = "il_"


@dataclass(frozen=True)
class Principal:
    actor: str
    is_operator: bool


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


async def create_api_key(engine: AsyncEngine, clock: Clock, actor: str, is_operator: bool) -> str:
    """Store a new key for `actor` and return its token (shown once, never stored)."""
    if not actor or len(actor) > 255 or not actor.isprintable():
        raise ValueError("an actor name is 1-255 printable characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    async with engine.begin() as conn:
        await Ledger(conn).add_api_key(hash_token(token), actor, is_operator, clock())
    return token


def _unauthorized(detail: str) -> Problem:
    return Problem(
        401,
        "unauthorized",
        "Unauthorized",
        detail,
        headers={"WWW-Authenticate": 'Bearer realm="intentledger"'},
    )


async def authenticate(request: Request) -> Principal:
    header = request.headers.get("authorization")
    if header is None:
        raise _unauthorized("missing Authorization: Bearer <token> header")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("the Authorization header must be 'Bearer <token>'")
    engine: AsyncEngine = request.app.state.engine
    async with engine.connect() as conn:
        row = await Ledger(conn).find_api_key(hash_token(token.strip()))
    if row is None:
        raise _unauthorized("unknown or revoked token")
    return Principal(actor=row.actor, is_operator=bool(row.is_operator))
