"""The composition root of the HTTP service: the API and the operator console,
siblings that never import each other, mounted on one app.

The API's app is the base (it carries the intake fast path); the console is
mounted beside it and reads the state the API's app holds (the database
engine, the clock, the replay window, the retention policies). What both need
lies below them: web/ and the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from datetime import timedelta

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.api.app import create_api
from intentledger.api.edge import DEFAULT_BODY_TIMEOUT
from intentledger.console.pages import install_console
from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW
from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.work_queue import DEFAULT_WAITING_THRESHOLD
from intentledger.engine.clock import Clock
from intentledger.engine.group_intake import IntakeGroups
from intentledger.engine.sync_writes import SyncWriter
from intentledger.providers.base import KINDS, Webhooks
from intentledger.store.group_statement import GroupStatement


def create_app(
    engine: AsyncEngine,
    clock: Clock,
    provider_name: str,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    sync_writer: SyncWriter | None = None,
    policy_for: Callable[[str], RetentionPolicy] | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    provider_kinds: frozenset[str] = frozenset(KINDS),
    webhook_readers: Mapping[str, Webhooks] | None = None,
    recheck_backoff: timedelta = timedelta(seconds=30),
    webhook_allow_private: bool = False,
    operator_queue_after: timedelta = DEFAULT_WAITING_THRESHOLD,
    replay_window: timedelta = DEFAULT_REPLAY_WINDOW,
    group_statement: GroupStatement | None = None,
) -> FastAPI:
    """The API with the console mounted beside it. Concurrent payment intents
    share a commit (engine/group_intake.py), on PostgreSQL one autocommitted
    statement on `group_statement`'s connection."""
    app = create_api(
        engine,
        clock,
        provider_name,
        lifespan=lifespan,
        sync_writer=sync_writer,
        policy_for=policy_for,
        body_timeout=body_timeout,
        provider_kinds=provider_kinds,
        webhook_readers=webhook_readers,
        recheck_backoff=recheck_backoff,
        webhook_allow_private=webhook_allow_private,
        replay_window=replay_window,
        intake_groups=IntakeGroups(engine, clock, group_statement=group_statement),
    )
    install_console(app, operator_queue_after)
    return app
