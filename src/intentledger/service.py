"""Composition root: wires settings, database, provider and engine into processes."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.api.app import create_app
from intentledger.engine.clock import Clock, system_clock
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings, run_dispatcher
from intentledger.providers.registry import build_provider
from intentledger.providers.sandbox import create_sandbox_app
from intentledger.settings import Settings
from intentledger.store.database import create_ledger_engine

SANDBOX_MOUNT = "/_sandbox"


def worker_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def build_dispatcher(
    settings: Settings, engine: AsyncEngine, clock: Clock, default_provider_url: str | None
) -> Dispatcher:
    return Dispatcher(
        engine,
        build_provider(settings, default_provider_url),
        clock,
        DispatchSettings(lease=settings.lease, recheck_backoff=settings.recheck_backoff),
        worker_id("worker"),
    )


async def run_workers(
    settings: Settings, engine: AsyncEngine, dispatcher: Dispatcher, stop: asyncio.Event
) -> None:
    try:
        await run_dispatcher(dispatcher, stop, settings.worker_concurrency, settings.poll_interval)
    finally:
        await dispatcher.provider.aclose()


def build_service_app(
    settings: Settings,
    *,
    own_url: str,
    with_workers: bool,
    clock: Clock = system_clock,
) -> FastAPI:
    """The `serve` process: API, sandbox mount (when it is the provider) and workers."""
    engine = create_ledger_engine(settings.database_url)
    sandbox_url = own_url.rstrip("/") + SANDBOX_MOUNT if settings.provider == "sandbox" else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = None
        if with_workers:
            dispatcher = build_dispatcher(settings, engine, clock, sandbox_url)
            task = asyncio.create_task(run_workers(settings, engine, dispatcher, stop))
        try:
            yield
        finally:
            stop.set()
            if task is not None:
                await task
            await engine.dispose()

    app = create_app(engine, clock, settings.provider, lifespan=lifespan)
    if settings.provider == "sandbox":
        app.mount(SANDBOX_MOUNT, build_sandbox_app(settings))
    return app


def build_sandbox_app(settings: Settings) -> FastAPI:
    return create_sandbox_app(settings.sandbox_database, settings.sandbox_key_retention)


def build_standalone_sandbox(settings: Settings) -> FastAPI:
    """`intentledger sandbox`: the provider alone, under the same /_sandbox prefix."""
    outer = FastAPI(title="intentledger sandbox provider")
    outer.mount(SANDBOX_MOUNT, build_sandbox_app(settings))
    return outer
