"""Authentication is cached per app: a known key is read once, an unknown one every time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.app import create_app
from intentledger.engine.api_keys import Principal, create_api_key
from intentledger.engine.clock import system_clock
from intentledger.web.auth import PrincipalCache


class StatementLog:
    """Every statement the engine sends, as SQL text."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.statements: list[str] = []
        event.listen(engine.sync_engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.statements.append(statement)

    def api_key_reads(self) -> int:
        return sum("FROM api_keys" in s for s in self.statements)


@pytest.fixture
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine, system_clock, "sandbox")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def test_a_known_key_is_read_once_and_an_unknown_one_every_time(
    engine: AsyncEngine, client: httpx.AsyncClient
) -> None:
    token = await create_api_key(engine, system_clock, "alice", False)
    log = StatementLog(engine)

    def get(token: str) -> Any:
        return client.get("/v1/operations/op_missing", headers={"Authorization": f"Bearer {token}"})

    assert (await get(token)).status_code == 404  # authenticated; the operation is not there
    assert log.api_key_reads() == 1
    assert (await get(token)).status_code == 404
    assert log.api_key_reads() == 1, "the second request must not read the key again"

    for _ in range(2):
        response = await get("il_not-a-key")
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert log.api_key_reads() == 3, "an unknown token is looked up every time"


async def test_separate_apps_do_not_share_the_cache(engine: AsyncEngine) -> None:
    token = await create_api_key(engine, system_clock, "alice", False)
    log = StatementLog(engine)
    for _ in range(2):
        app = create_app(engine, system_clock, "sandbox")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            response = await c.get(
                "/v1/operations/op_missing", headers={"Authorization": f"Bearer {token}"}
            )
        assert response.status_code == 404
    assert log.api_key_reads() == 2


def test_entries_expire_and_the_cache_stays_bounded() -> None:
    now = [0.0]
    cache = PrincipalCache(ttl=60.0, max_entries=2, monotonic=lambda: now[0])
    alice = Principal("alice", False)
    cache.put("a", alice)
    now[0] = 59.9
    assert cache.get("a") == alice
    now[0] = 60.0
    assert cache.get("a") is None, "an entry lives ttl seconds, then the database is asked again"

    cache.put("a", alice)
    cache.put("b", Principal("bob", False))
    cache.put("c", Principal("carol", True))
    assert cache.get("a") is None, "the oldest entry makes room"
    assert cache.get("c") == Principal("carol", True)
