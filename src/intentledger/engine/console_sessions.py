"""The console's sign-in sessions: a key signs a browser in for a while, and
signing out (or revoking the key) ends it."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.api_keys import hash_token
from intentledger.store import console_sessions as sessions
from intentledger.store.console_sessions import ConsoleKey, ConsoleSession

__all__ = ["ConsoleKey", "ConsoleSession", "find_open", "key_of", "sign_in", "sign_out"]


async def key_of(engine: AsyncEngine, token: str) -> ConsoleKey | None:
    """The live key this token names, read fresh: a key revoked a moment ago signs nobody in."""
    async with engine.connect() as conn:
        return await sessions.find_key(conn, hash_token(token))


async def sign_in(
    engine: AsyncEngine, key: ConsoleKey, now: datetime, length: timedelta
) -> ConsoleSession:
    async with engine.begin() as conn:
        return await sessions.open_session(conn, key, now, length)


async def find_open(engine: AsyncEngine, session_id: str, now: datetime) -> ConsoleSession | None:
    """The open session with this id: not expired, its key not revoked."""
    async with engine.connect() as conn:
        return await sessions.find_session(conn, session_id, now)


async def sign_out(engine: AsyncEngine, session_id: str) -> None:
    async with engine.begin() as conn:
        await sessions.close_session(conn, session_id)
