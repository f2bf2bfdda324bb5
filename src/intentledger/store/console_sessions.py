"""Console sessions: opened with an operator's key, ended by signing out, by
their expiry or by the key's revocation — each checked here, on the server,
on every request (a console is used by a few people: one indexed read a page)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.tables import api_keys, console_sessions


@dataclass(frozen=True)
class ConsoleSession:
    session_id: str
    actor: str
    is_operator: bool
    expires_at: datetime


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ConsoleKey:
    key_id: int
    actor: str
    is_operator: bool


async def find_key(conn: AsyncConnection, token_hash: str) -> ConsoleKey | None:
    """The key with this token hash, read fresh (no cache: a key revoked a moment
    ago signs nobody in); None for an unknown or revoked key."""
    key = (
        await conn.execute(
            select(api_keys.c.id, api_keys.c.actor, api_keys.c.is_operator).where(
                api_keys.c.token_hash == token_hash, api_keys.c.revoked_at.is_(None)
            )
        )
    ).first()
    return None if key is None else ConsoleKey(key.id, key.actor, bool(key.is_operator))


async def open_session(
    conn: AsyncConnection, key: ConsoleKey, now: datetime, length: timedelta
) -> ConsoleSession:
    # Expired sessions are swept here: the table holds little beyond the open ones.
    await conn.execute(delete(console_sessions).where(console_sessions.c.expires_at <= now))
    session_id = secrets.token_urlsafe(32)
    expires_at = now + length
    await conn.execute(
        insert(console_sessions).values(
            session_hash=_hash(session_id),
            api_key_id=key.key_id,
            created_at=now,
            expires_at=expires_at,
        )
    )
    return ConsoleSession(session_id, key.actor, key.is_operator, expires_at)


async def find_session(
    conn: AsyncConnection, session_id: str, now: datetime
) -> ConsoleSession | None:
    """The open session with this id: not expired, its key not revoked."""
    row = (
        await conn.execute(
            select(api_keys.c.actor, api_keys.c.is_operator, console_sessions.c.expires_at)
            .join(api_keys, api_keys.c.id == console_sessions.c.api_key_id)
            .where(
                console_sessions.c.session_hash == _hash(session_id),
                console_sessions.c.expires_at > now,
                api_keys.c.revoked_at.is_(None),
            )
        )
    ).first()
    if row is None:
        return None
    return ConsoleSession(session_id, row.actor, bool(row.is_operator), row.expires_at)


async def close_session(conn: AsyncConnection, session_id: str) -> None:
    await conn.execute(
        delete(console_sessions).where(console_sessions.c.session_hash == _hash(session_id))
    )
