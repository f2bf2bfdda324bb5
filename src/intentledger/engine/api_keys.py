"""API keys: issued once, stored only as a SHA-256 hash of the token."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.clock import Clock
from intentledger.store.ledger import Ledger
from intentledger.store.tables import ACTOR_LENGTH

TOKEN_PREFIX = "il_"


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: the key's actor, and whether it holds the operator role."""

    actor: str
    is_operator: bool


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def fingerprint(token: str) -> str:
    """What `keys create` and `keys list` show to tell keys apart: the start of
    the stored hash, which says nothing usable about the token."""
    return hash_token(token)[:12]


async def create_api_key(engine: AsyncEngine, clock: Clock, actor: str, is_operator: bool) -> str:
    """Store a new key for `actor` and return its token (shown once, never stored)."""
    if not actor or len(actor) > ACTOR_LENGTH or not actor.isprintable():
        raise ValueError(f"an actor name is 1-{ACTOR_LENGTH} printable characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    async with engine.begin() as conn:
        await Ledger(conn).add_api_key(hash_token(token), actor, is_operator, clock())
    return token


async def principal_of_hash(engine: AsyncEngine, token_hash: str) -> Principal | None:
    """The principal of the live key stored under `token_hash`, or None."""
    async with engine.connect() as conn:
        row = await Ledger(conn).find_api_key(token_hash)
    if row is None:
        return None
    return Principal(actor=row.actor, is_operator=bool(row.is_operator))
