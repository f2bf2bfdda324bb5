"""Composition root: wires settings, database, provider and engine into processes."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.routing import Mount

from intentledger.app import create_app
from intentledger.domain.merchant_events import RetrySchedule
from intentledger.engine.clock import Clock, system_clock
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings
from intentledger.engine.reaper import Reaper
from intentledger.engine.reconciler import Reconciler
from intentledger.engine.sweeper import Sweeper
from intentledger.engine.sync_writes import SyncWriter
from intentledger.engine.webhook_sender import WebhookSender
from intentledger.engine.worker import Worker, run_worker
from intentledger.observability.logs import bind_log_context
from intentledger.observability.provider_metrics import InstrumentedProvider
from intentledger.providers.base import Provider, Webhooks
from intentledger.providers.registry import (
    ProviderConfig,
    build_provider,
    plugin_for,
    retention_policy_for,
)
from intentledger.providers.sandbox import create_sandbox_app
from intentledger.providers.sandbox.webhooks import SandboxWebhooks
from intentledger.safety_config import load_safety_rules
from intentledger.settings import Settings
from intentledger.store.database import create_ledger_engine
from intentledger.store.direct import DirectConnections, direct_connections_for
from intentledger.store.group_statement import group_statement_for
from intentledger.store.ledger import REQUEST_PATH_OWNER

SANDBOX_MOUNT = "/_sandbox"


def worker_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def provider_config(settings: Settings) -> ProviderConfig:
    """What the adapters read of the settings, as plain values."""
    return ProviderConfig(
        provider=settings.provider,
        provider_url=settings.provider_url,
        submit_timeout=settings.submit_timeout,
        worker_concurrency=settings.worker_concurrency,
        sandbox_key_retention=settings.sandbox_key_retention,
        sandbox_webhook_secret=settings.sandbox_webhook_secret,
        stripe_api_key=settings.stripe_api_key,
        stripe_api_base=settings.stripe_api_base,
        stripe_search_lag=settings.stripe_search_lag,
        stripe_webhook_secret=settings.stripe_webhook_secret,
        adyen_api_key=settings.adyen_api_key,
        adyen_merchant_account=settings.adyen_merchant_account,
        adyen_api_base=settings.adyen_api_base,
        adyen_hmac_keys=settings.adyen_hmac_keys,
    )


def instrumented_provider(
    settings: Settings, default_url: str | None, timeout: timedelta | None = None
) -> Provider:
    """The configured adapter, every call timed and counted in one place
    (observability/provider_metrics.py)."""
    return InstrumentedProvider(build_provider(provider_config(settings), default_url, timeout))


def build_dispatcher(
    settings: Settings,
    engine: AsyncEngine,
    clock: Clock,
    default_provider_url: str | None,
    identity: str,
    provider: Provider | None = None,
    direct: DirectConnections | None = None,
) -> Dispatcher:
    return Dispatcher(
        engine,
        provider or instrumented_provider(settings, default_provider_url),
        clock,
        DispatchSettings(lease=settings.lease, recheck_backoff=settings.recheck_backoff),
        identity,
        direct=direct,
    )


def build_worker(
    settings: Settings,
    engine: AsyncEngine,
    clock: Clock,
    default_provider_url: str | None,
    *,
    direct: bool = True,
) -> Worker:
    """The worker `intentledger worker` runs. `direct`: its batched first
    attempts on connections of their own (store/direct.py) on PostgreSQL;
    without, on the engine, where SQLAlchemy's events see their statements."""
    provider = instrumented_provider(settings, default_provider_url)
    identity = worker_id("worker")
    # Closed by the worker's `close`.
    connections = (
        direct_connections_for(settings.database_url, engine.dialect, settings.database_pooler)
        if direct
        else None
    )
    return Worker(
        engine,
        clock,
        settings.lease,
        identity,
        build_dispatcher(
            settings,
            engine,
            clock,
            default_provider_url,
            identity,
            provider,
            connections,
        ),
        Reconciler(
            engine,
            provider,
            clock,
            settings.recheck_backoff,
            retention_policy_for(provider_config(settings)),
            load_safety_rules(settings.safety_rules),
            identity,
            has_lookup=plugin_for(settings.provider)
            .consistency(provider_config(settings))
            .available,
        ),
        Sweeper(engine, clock, settings.stale_submitting, settings.recheck_backoff, identity),
        build_webhook_sender(settings, engine, clock, identity, connections),
        Reaper(engine, clock, settings.record_retention),
        settings.record_window,
    )


def build_webhook_sender(
    settings: Settings,
    engine: AsyncEngine,
    clock: Clock,
    identity: str,
    direct: DirectConnections | None = None,
) -> WebhookSender:
    """`direct`: the worker's own connections, for the sender's idle look."""
    return WebhookSender(
        engine,
        clock,
        identity,
        direct=direct,
        timeout=settings.webhook_timeout,
        in_flight_per_endpoint=settings.webhook_in_flight,
        concurrency=settings.webhook_concurrency,
        schedule=RetrySchedule(
            settings.webhook_retry_first, settings.webhook_retry_longest, settings.webhook_retry_for
        ),
        allow_private=settings.webhook_allow_private,
    )


async def run_workers(worker: Worker, settings: Settings, stop: asyncio.Event) -> None:
    # Every line this worker's tasks log names it (tasks inherit the context).
    bind_log_context(worker=worker.worker_id)
    try:
        await run_worker(
            worker,
            stop,
            settings.worker_concurrency,
            settings.poll_interval,
            settings.sweep_interval,
            settings.worker_batch,
            settings.reap_interval,
        )
    finally:
        await worker.close()


def build_service_app(
    settings: Settings,
    *,
    own_url: str,
    with_workers: bool,
    clock: Clock = system_clock,
) -> FastAPI:
    """The `serve` process: API, sandbox mount (when it is the provider) and workers."""
    engine = create_ledger_engine(settings.database_url, pooler=settings.database_pooler)
    group_statement = group_statement_for(settings.database_url, pooler=settings.database_pooler)
    sandbox_url = own_url.rstrip("/") + SANDBOX_MOUNT if mounts_sandbox(settings) else None

    sync_dispatcher = build_dispatcher(
        settings,
        engine,
        clock,
        sandbox_url,
        worker_id(REQUEST_PATH_OWNER),
        instrumented_provider(settings, sandbox_url, timeout=settings.request_path_timeout),
    )
    sync_writer = SyncWriter(engine, clock, sync_dispatcher, settings.lease)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = None
        if with_workers:
            worker = build_worker(settings, engine, clock, sandbox_url)
            task = asyncio.create_task(run_workers(worker, settings, stop))
        try:
            yield
        finally:
            stop.set()
            if task is not None:
                await task
            await sync_dispatcher.provider.aclose()
            await engine.dispose()
            if group_statement is not None:
                await group_statement.close()

    app = create_app(
        engine,
        clock,
        settings.provider,
        lifespan=lifespan,
        sync_writer=sync_writer,
        policy_for=retention_policy_for(provider_config(settings)),
        body_timeout=settings.body_timeout.total_seconds(),
        provider_kinds=plugin_for(settings.provider).kinds,
        webhook_readers=webhook_readers(settings),
        recheck_backoff=settings.recheck_backoff,
        webhook_allow_private=settings.webhook_allow_private,
        operator_queue_after=settings.operator_queue_after,
        replay_window=settings.replay_window,
        group_statement=group_statement,
    )
    if mounts_sandbox(settings):
        webhooks = None
        if settings.sandbox_webhook_secret:
            webhooks = SandboxWebhooks(
                own_url.rstrip("/") + "/v1/provider-webhooks/sandbox",
                settings.sandbox_webhook_secret,
            )
        app.mount(SANDBOX_MOUNT, build_sandbox_app(settings, webhooks))
    return app


def webhook_readers(settings: Settings) -> dict[str, Webhooks]:
    """The configured provider's webhook verifier, if its secret is set."""
    reader = plugin_for(settings.provider).webhooks(provider_config(settings))
    return {settings.provider: reader} if reader is not None else {}


def mounts_sandbox(settings: Settings) -> bool:
    """Only a serve process that is its own provider mounts the sandbox: it is an
    unauthenticated test provider that creates charges and lists every actor's
    beneficiaries, so it never sits beside an API that talks to another provider."""
    return settings.provider == "sandbox" and settings.provider_url is None


def build_sandbox_app(settings: Settings, webhooks: SandboxWebhooks | None = None) -> Starlette:
    return create_sandbox_app(
        settings.sandbox_database, settings.sandbox_key_retention, webhooks=webhooks
    )


def build_standalone_sandbox(settings: Settings) -> Starlette:
    """`intentledger sandbox`: the provider alone, under the same /_sandbox prefix."""
    return Starlette(routes=[Mount(SANDBOX_MOUNT, build_sandbox_app(settings))])
