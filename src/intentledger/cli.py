"""`intentledger`: serve, worker, migrate, keys, sandbox, ops; bench, chaos and demo come
with the tools (tools/)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from importlib.metadata import entry_points
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console

from intentledger import eventloop
from intentledger.domain.durations import format_duration
from intentledger.ops_cli import ops_app
from intentledger.settings import Settings

app = typer.Typer(
    help="intentledger: durable idempotent payment intents, honest about unknown outcomes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Manage API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(ops_app, name="ops")
# Errors stay one line each, whatever the terminal's width (logs, CI).
err = Console(stderr=True, soft_wrap=True)

log = logging.getLogger("intentledger")

# serve and worker wait for an unreachable database, backing off to this.
DATABASE_WAIT_CAP_SECONDS = 30.0

# Every setting is also a flag; a flag given on the command line beats the environment.
DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url", help="INTENTLEDGER_DATABASE_URL: sqlite:///FILE or postgresql://..."
    ),
]
DatabasePooler = Annotated[
    str | None,
    typer.Option(
        "--database-pooler",
        help="INTENTLEDGER_DATABASE_POOLER: none, or pgbouncer (a pooler in transaction mode)",
    ),
]
Provider = Annotated[str | None, typer.Option("--provider", help="INTENTLEDGER_PROVIDER")]
ProviderUrl = Annotated[
    str | None, typer.Option("--provider-url", help="INTENTLEDGER_PROVIDER_URL")
]
SubmitTimeout = Annotated[
    str | None, typer.Option("--submit-timeout", help="INTENTLEDGER_SUBMIT_TIMEOUT, e.g. 10s")
]
SyncTimeout = Annotated[
    str | None,
    typer.Option(
        "--sync-timeout",
        help="INTENTLEDGER_SYNC_TIMEOUT: provider writes in a request (a worker's sweeper "
        "must outwait them too)",
    ),
]
Lease = Annotated[str | None, typer.Option("--lease", help="INTENTLEDGER_LEASE, e.g. 5m")]
RecheckBackoff = Annotated[
    str | None, typer.Option("--recheck-backoff", help="INTENTLEDGER_RECHECK_BACKOFF, e.g. 30s")
]
StaleSubmitting = Annotated[
    str | None, typer.Option("--stale-submitting", help="INTENTLEDGER_STALE_SUBMITTING, e.g. 2m")
]
KeyRetention = Annotated[
    str | None,
    typer.Option("--sandbox-key-retention", help="INTENTLEDGER_SANDBOX_KEY_RETENTION, e.g. 24h"),
]
SandboxWebhookSecret = Annotated[
    str | None,
    typer.Option("--sandbox-webhook-secret", help="INTENTLEDGER_SANDBOX_WEBHOOK_SECRET"),
]
SandboxDatabase = Annotated[
    str | None, typer.Option("--sandbox-database", help="INTENTLEDGER_SANDBOX_DATABASE")
]
Concurrency = Annotated[
    int | None,
    typer.Option("--worker-concurrency", "--concurrency", help="INTENTLEDGER_WORKER_CONCURRENCY"),
]
Batch = Annotated[
    int | None, typer.Option("--worker-batch", "--batch", help="INTENTLEDGER_WORKER_BATCH")
]
PollInterval = Annotated[
    str | None, typer.Option("--poll-interval", help="INTENTLEDGER_POLL_INTERVAL, e.g. 200ms")
]
RecordWindow = Annotated[
    str | None,
    typer.Option(
        "--record-window", help="INTENTLEDGER_RECORD_WINDOW, e.g. 2ms (0: no wait for company)"
    ),
]
SweepInterval = Annotated[
    str | None, typer.Option("--sweep-interval", help="INTENTLEDGER_SWEEP_INTERVAL, e.g. 15s")
]
HeaderTimeout = Annotated[
    str | None, typer.Option("--header-timeout", help="INTENTLEDGER_HEADER_TIMEOUT, e.g. 10s")
]
BodyTimeout = Annotated[
    str | None, typer.Option("--body-timeout", help="INTENTLEDGER_BODY_TIMEOUT, e.g. 30s")
]
MaxConnections = Annotated[
    int | None, typer.Option("--max-connections", help="INTENTLEDGER_MAX_CONNECTIONS")
]
StripeApiBase = Annotated[
    str | None, typer.Option("--stripe-api-base", help="INTENTLEDGER_STRIPE_API_BASE")
]
StripeSearchLag = Annotated[
    str | None, typer.Option("--stripe-search-lag", help="INTENTLEDGER_STRIPE_SEARCH_LAG, e.g. 1m")
]
AdyenApiBase = Annotated[
    str | None,
    typer.Option("--adyen-api-base", help="INTENTLEDGER_ADYEN_API_BASE, without the version"),
]
AdyenMerchantAccount = Annotated[
    str | None,
    typer.Option("--adyen-merchant-account", help="INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT"),
]
# Named so that a person who looks for it learns where the key goes: a command
# line is visible to every user of the machine (`ps`), so it is refused here.
StripeApiKey = Annotated[
    str | None,
    typer.Option(
        "--stripe-api-key",
        help="Not taken as a flag: the Stripe secret key is read from the environment only "
        "(INTENTLEDGER_STRIPE_API_KEY), since every user of the machine can read a command "
        "line (`ps`).",
        show_default=False,
    ),
]
WebhookAllowPrivate = Annotated[
    bool | None,
    typer.Option(
        "--webhook-allow-private",
        help="INTENTLEDGER_WEBHOOK_ALLOW_PRIVATE: merchant webhooks to loopback/private "
        "addresses and plain http (development and tests only)",
    ),
]
WebhookTimeout = Annotated[
    str | None, typer.Option("--webhook-timeout", help="INTENTLEDGER_WEBHOOK_TIMEOUT, e.g. 10s")
]
WebhookInFlight = Annotated[
    int | None, typer.Option("--webhook-in-flight", help="INTENTLEDGER_WEBHOOK_IN_FLIGHT")
]
WebhookRetryFirst = Annotated[
    str | None,
    typer.Option("--webhook-retry-first", help="INTENTLEDGER_WEBHOOK_RETRY_FIRST, e.g. 10s"),
]
WebhookRetryLongest = Annotated[
    str | None,
    typer.Option("--webhook-retry-longest", help="INTENTLEDGER_WEBHOOK_RETRY_LONGEST, e.g. 6h"),
]
WebhookConcurrency = Annotated[
    int | None, typer.Option("--webhook-concurrency", help="INTENTLEDGER_WEBHOOK_CONCURRENCY")
]
WebhookRetryFor = Annotated[
    str | None,
    typer.Option("--webhook-retry-for", help="INTENTLEDGER_WEBHOOK_RETRY_FOR, e.g. 3d"),
]
OperatorQueueAfter = Annotated[
    str | None,
    typer.Option(
        "--operator-queue-after",
        help="INTENTLEDGER_OPERATOR_QUEUE_AFTER: the console's work queue shows an unresolved "
        "operation once it is this old, e.g. 15m",
    ),
]
ReplayWindow = Annotated[
    str | None,
    typer.Option(
        "--replay-window",
        help="INTENTLEDGER_REPLAY_WINDOW: equal retries replay this long after a key's first "
        "use, then 409 key-expired, e.g. 30d",
    ),
]
RecordRetention = Annotated[
    str | None,
    typer.Option(
        "--record-retention",
        help="INTENTLEDGER_RECORD_RETENTION: settled operations' bulky rows are kept this "
        "long, then reaped, e.g. 400d",
    ),
]
ReapInterval = Annotated[
    str | None,
    typer.Option("--reap-interval", help="INTENTLEDGER_REAP_INTERVAL: how often a worker reaps"),
]
LogFormat = Annotated[
    str | None, typer.Option("--log-format", help="INTENTLEDGER_LOG_FORMAT: text or json")
]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        help="INTENTLEDGER_METRICS_PORT: serve this worker's metrics at /metrics on this port",
    ),
]
MetricsHost = Annotated[
    str | None,
    typer.Option(
        "--metrics-host",
        help="INTENTLEDGER_METRICS_HOST: the address the worker's metrics listen on "
        "(default 0.0.0.0, every interface), e.g. 127.0.0.1",
    ),
]
SafetyRules = Annotated[
    str | None, typer.Option("--safety-rules", help="INTENTLEDGER_SAFETY_RULES: a TOML file")
]


def load_settings(**flags: Any) -> Settings:
    given = {name: value for name, value in flags.items() if value is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"])
            err.print(f"[red]invalid setting {name}:[/red] {error['msg']}")
        raise typer.Exit(2) from exc


def _refuse_stripe_api_key_flag(given: str | None) -> None:
    if given is not None:
        err.print(
            "[red]--stripe-api-key is not taken on the command line (every user of the "
            "machine can read it with `ps`): set INTENTLEDGER_STRIPE_API_KEY in the "
            "environment instead[/red]"
        )
        raise typer.Exit(2)


def _log_stop_and_die_on(signals: tuple[signal.Signals, ...], what: str) -> None:
    """Say that `what` stopped, then end by the signal as before (uvicorn gives
    a signal it shut down for back to the handler it found: this one)."""

    def stopped(number: int, _frame: object) -> None:
        log.info("%s stopped (%s)", what, signal.Signals(number).name)
        signal.signal(number, signal.SIG_DFL)
        signal.raise_signal(number)

    for sig in signals:
        signal.signal(sig, stopped)


def _configure_logging(settings: Settings) -> None:
    from intentledger.observability.logs import configure_logging

    configure_logging(settings.log_format)


def _require_provider(settings: Settings) -> None:
    """Refuse an unknown provider or its missing configuration (a Stripe key)
    at start-up, in one line, before anything is served or sent."""
    from intentledger.providers.registry import ProviderNotConfigured, check_provider
    from intentledger.service import provider_config

    try:
        check_provider(provider_config(settings))
    except ProviderNotConfigured as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc


def _require_schema(settings: Settings, *, wait_for_database: bool = False) -> None:
    """Refuse a database that is missing, not UTF-8 or not migrated, in one line.
    With `wait_for_database` (serve, worker) an unreachable database is waited
    for, with backoff, instead of ending the process: it may be restarting."""
    import psycopg
    from sqlalchemy.exc import OperationalError

    from intentledger.store.database import UnsupportedDatabase
    from intentledger.store.schema_check import SchemaNotCurrent, require_current_schema

    delay = 1.0
    while True:
        try:
            require_current_schema(settings.database_url, settings.database_pooler)
            return
        except (SchemaNotCurrent, UnsupportedDatabase) as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from exc
        except (OperationalError, psycopg.OperationalError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if not wait_for_database:
                err.print(f"[red]the database is not reachable: {reason}[/red]")
                raise typer.Exit(1) from exc
            log.warning("the database is not reachable (%s); trying again in %.0f s", reason, delay)
            time.sleep(delay)
            delay = min(delay * 2, DATABASE_WAIT_CAP_SECONDS)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    no_workers: Annotated[bool, typer.Option("--no-workers", help="Run the API alone.")] = False,
    database_url: DatabaseUrl = None,
    database_pooler: DatabasePooler = None,
    provider: Provider = None,
    provider_url: ProviderUrl = None,
    submit_timeout: SubmitTimeout = None,
    sync_timeout: SyncTimeout = None,
    lease: Lease = None,
    recheck_backoff: RecheckBackoff = None,
    stale_submitting: StaleSubmitting = None,
    sandbox_key_retention: KeyRetention = None,
    sandbox_database: SandboxDatabase = None,
    sandbox_webhook_secret: SandboxWebhookSecret = None,
    concurrency: Concurrency = None,
    batch: Batch = None,
    poll_interval: PollInterval = None,
    record_window: RecordWindow = None,
    sweep_interval: SweepInterval = None,
    safety_rules: SafetyRules = None,
    stripe_api_base: StripeApiBase = None,
    stripe_search_lag: StripeSearchLag = None,
    adyen_api_base: AdyenApiBase = None,
    adyen_merchant_account: AdyenMerchantAccount = None,
    stripe_api_key: StripeApiKey = None,
    header_timeout: HeaderTimeout = None,
    body_timeout: BodyTimeout = None,
    max_connections: MaxConnections = None,
    webhook_allow_private: WebhookAllowPrivate = None,
    webhook_timeout: WebhookTimeout = None,
    webhook_in_flight: WebhookInFlight = None,
    webhook_retry_first: WebhookRetryFirst = None,
    webhook_retry_for: WebhookRetryFor = None,
    webhook_retry_longest: WebhookRetryLongest = None,
    webhook_concurrency: WebhookConcurrency = None,
    operator_queue_after: OperatorQueueAfter = None,
    replay_window: ReplayWindow = None,
    log_format: LogFormat = None,
    record_retention: RecordRetention = None,
    reap_interval: ReapInterval = None,
) -> None:
    """Run the HTTP API and the operator console (/console), plus the dispatcher
    (unless --no-workers) and the sandbox provider."""
    from intentledger.http_server import server_options
    from intentledger.service import SANDBOX_MOUNT, build_service_app, mounts_sandbox

    _refuse_stripe_api_key_flag(stripe_api_key)
    settings = load_settings(
        database_url=database_url,
        database_pooler=database_pooler,
        provider=provider,
        provider_url=provider_url,
        submit_timeout=submit_timeout,
        sync_timeout=sync_timeout,
        lease=lease,
        recheck_backoff=recheck_backoff,
        stale_submitting=stale_submitting,
        sandbox_key_retention=sandbox_key_retention,
        sandbox_database=sandbox_database,
        sandbox_webhook_secret=sandbox_webhook_secret,
        worker_concurrency=concurrency,
        worker_batch=batch,
        poll_interval=poll_interval,
        record_window=record_window,
        sweep_interval=sweep_interval,
        safety_rules=safety_rules,
        stripe_api_base=stripe_api_base,
        stripe_search_lag=stripe_search_lag,
        adyen_api_base=adyen_api_base,
        adyen_merchant_account=adyen_merchant_account,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        max_connections=max_connections,
        webhook_allow_private=webhook_allow_private,
        webhook_timeout=webhook_timeout,
        webhook_in_flight=webhook_in_flight,
        webhook_retry_first=webhook_retry_first,
        webhook_retry_for=webhook_retry_for,
        webhook_retry_longest=webhook_retry_longest,
        webhook_concurrency=webhook_concurrency,
        operator_queue_after=operator_queue_after,
        replay_window=replay_window,
        log_format=log_format,
        record_retention=record_retention,
        reap_interval=reap_interval,
    )
    _configure_logging(settings)
    _require_provider(settings)
    _require_schema(settings, wait_for_database=True)
    local_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    service = build_service_app(
        settings, own_url=f"http://{local_host}:{port}", with_workers=not no_workers
    )
    # Through logging, so that with --log-format json every line is JSON.
    log.info(
        "intentledger serving on http://%s:%s (workers: %s)",
        host,
        port,
        "off" if no_workers else "on",
    )
    if mounts_sandbox(settings):
        log.warning(
            "the provider is the built-in sandbox at %s, a test provider with no "
            "authentication: not for real money",
            SANDBOX_MOUNT,
        )
    _log_stop_and_die_on(
        (signal.SIGINT, signal.SIGTERM), f"intentledger serving on http://{host}:{port}"
    )
    eventloop.freeze_what_starts_with_the_process()
    # A sandbox request may be withholding its answer on purpose: do not wait for it.
    eventloop.serve(
        service,
        host=host,
        port=port,
        log_level="warning",
        # uvicorn's own lines go through the root handler: JSON when asked.
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=5,
        **server_options(settings.header_timeout.total_seconds(), settings.max_connections),
    )


@app.command()
def worker(
    database_url: DatabaseUrl = None,
    database_pooler: DatabasePooler = None,
    provider: Provider = None,
    provider_url: ProviderUrl = None,
    submit_timeout: SubmitTimeout = None,
    sync_timeout: SyncTimeout = None,
    lease: Lease = None,
    recheck_backoff: RecheckBackoff = None,
    stale_submitting: StaleSubmitting = None,
    sandbox_key_retention: KeyRetention = None,
    concurrency: Concurrency = None,
    batch: Batch = None,
    poll_interval: PollInterval = None,
    record_window: RecordWindow = None,
    sweep_interval: SweepInterval = None,
    safety_rules: SafetyRules = None,
    stripe_api_base: StripeApiBase = None,
    stripe_search_lag: StripeSearchLag = None,
    adyen_api_base: AdyenApiBase = None,
    adyen_merchant_account: AdyenMerchantAccount = None,
    webhook_allow_private: WebhookAllowPrivate = None,
    webhook_timeout: WebhookTimeout = None,
    webhook_in_flight: WebhookInFlight = None,
    webhook_retry_first: WebhookRetryFirst = None,
    webhook_retry_for: WebhookRetryFor = None,
    webhook_retry_longest: WebhookRetryLongest = None,
    webhook_concurrency: WebhookConcurrency = None,
    log_format: LogFormat = None,
    record_retention: RecordRetention = None,
    reap_interval: ReapInterval = None,
    replay_window: ReplayWindow = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    stripe_api_key: StripeApiKey = None,
) -> None:
    """Run the dispatcher alone (point --provider-url at a running provider)."""
    _refuse_stripe_api_key_flag(stripe_api_key)
    from intentledger.engine.clock import system_clock
    from intentledger.service import build_worker, run_workers
    from intentledger.store.database import create_ledger_engine

    settings = load_settings(
        database_url=database_url,
        database_pooler=database_pooler,
        provider=provider,
        provider_url=provider_url,
        submit_timeout=submit_timeout,
        sync_timeout=sync_timeout,
        lease=lease,
        recheck_backoff=recheck_backoff,
        stale_submitting=stale_submitting,
        sandbox_key_retention=sandbox_key_retention,
        worker_concurrency=concurrency,
        worker_batch=batch,
        poll_interval=poll_interval,
        record_window=record_window,
        sweep_interval=sweep_interval,
        safety_rules=safety_rules,
        stripe_api_base=stripe_api_base,
        stripe_search_lag=stripe_search_lag,
        adyen_api_base=adyen_api_base,
        adyen_merchant_account=adyen_merchant_account,
        webhook_allow_private=webhook_allow_private,
        webhook_timeout=webhook_timeout,
        webhook_in_flight=webhook_in_flight,
        webhook_retry_first=webhook_retry_first,
        webhook_retry_for=webhook_retry_for,
        webhook_retry_longest=webhook_retry_longest,
        webhook_concurrency=webhook_concurrency,
        log_format=log_format,
        record_retention=record_retention,
        reap_interval=reap_interval,
        replay_window=replay_window,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    _configure_logging(settings)
    _require_provider(settings)
    _require_schema(settings, wait_for_database=True)

    async def main() -> None:
        engine = create_ledger_engine(settings.database_url, pooler=settings.database_pooler)
        try:
            worker = build_worker(settings, engine, system_clock, None)
        except ValueError as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from exc
        stop = asyncio.Event()
        stopped_by: list[signal.Signals] = []
        loop = asyncio.get_running_loop()

        def stop_on(sig: signal.Signals) -> None:
            stopped_by.append(sig)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_on, sig)
        if settings.metrics_port is not None:
            from prometheus_client import start_http_server

            # prometheus_client's own server, in a thread: the worker's counters
            # only (the ledger's gauges come from the API's /metrics).
            start_http_server(settings.metrics_port, addr=settings.metrics_host)
            log.info(
                "worker metrics at http://%s/metrics",
                _host_port(settings.metrics_host, settings.metrics_port),
            )
        log.info("intentledger worker %s started", worker.worker_id)
        try:
            await run_workers(worker, settings, stop)
        finally:
            await engine.dispose()
        log.info(
            "intentledger worker %s stopped (%s)",
            worker.worker_id,
            stopped_by[0].name if stopped_by else "done",
        )

    eventloop.freeze_what_starts_with_the_process()
    eventloop.run(main())


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@app.command()
def reap(
    database_url: DatabaseUrl = None,
    database_pooler: DatabasePooler = None,
    record_retention: RecordRetention = None,
    replay_window: ReplayWindow = None,
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=10_000, help="operations per transaction")
    ] = 500,
    log_format: LogFormat = None,
) -> None:
    """Remove the bulky rows of settled operations past the record retention
    (provider answers, request bodies, done outbox rows), in bounded batches;
    never an unresolved, flagged or still-refunding operation's. On PostgreSQL
    the answers go with their partition once it is past the retention.
    Workers also do it every --reap-interval."""
    from intentledger.engine.clock import system_clock
    from intentledger.engine.reaper import Reaper
    from intentledger.store.database import create_ledger_engine, dialect_of
    from intentledger.store.reaping import Reaped

    settings = load_settings(
        database_url=database_url,
        database_pooler=database_pooler,
        record_retention=record_retention,
        replay_window=replay_window,
        log_format=log_format,
    )
    _configure_logging(settings)
    _require_schema(settings)

    async def main() -> Reaped:
        engine = create_ledger_engine(settings.database_url, pooler=settings.database_pooler)
        try:
            with err.status("reaping") as status:

                def shown(so_far: Reaped) -> None:
                    status.update(f"reaping: {so_far.operations} operation(s) so far")

                return await Reaper(engine, system_clock, settings.record_retention, batch).reap(
                    shown
                )
        finally:
            await engine.dispose()

    done = asyncio.run(main())
    if dialect_of(settings.database_url) == "postgresql":
        # The answers go with their partition (store/partitions.py).
        details = (
            f"{done.detail_partitions} partition(s) of observation details dropped "
            f"({done.details_moved_out} detail(s) still needed moved out first)"
        )
    else:
        details = f"{done.observation_details} observation detail(s) cleared"
    typer.echo(
        f"reaped {done.operations} operation(s) settled over "
        f"{format_duration(settings.record_retention)} ago: {details}, "
        f"{done.outbox_rows} done outbox row(s) deleted"
    )


@app.command()
def providers() -> None:
    """List the installed provider adapters: the kinds each carries, the key
    retention the safety review weighs for it, and its lookup (how consistent,
    or none and what stands in for it)."""
    from rich.table import Table

    from intentledger.providers.registry import plugins
    from intentledger.service import provider_config

    config = provider_config(load_settings())
    table = Table(title="provider adapters (entry points: intentledger.providers)")
    # At most 160 columns in all (with the borders), and the lookup wide enough
    # that its first line is never folded: it is read as one.
    table.add_column("name", overflow="fold", max_width=28)
    table.add_column("kinds", overflow="fold", max_width=16)
    table.add_column("key retention", overflow="fold", max_width=45)
    table.add_column("lookup", overflow="fold", min_width=56)
    for plugin in plugins().values():
        policy = plugin.retention(config)
        consistency = plugin.consistency(config)
        if consistency.available:
            lag = "strong" if consistency.lag is None else f"may lag {consistency.lag}"
            lookup = f"lookup: by our reference, {lag}\n{consistency.note}"
        else:
            # What stands in for it: a same-key resend only while the provider
            # still keeps the key, and notifications.
            within = _in_days(policy.minimum)
            lookup = (
                f"lookup: none (same-key resend within {within}, notifications)\n{consistency.note}"
            )
        table.add_row(
            f"{plugin.name}\n{plugin.summary}",
            ", ".join(sorted(plugin.kinds)),
            policy.note,
            lookup,
        )
    Console(width=160).print(table)


def _in_days(span: timedelta) -> str:
    """A key retention as `intentledger providers` shows it: whole days as "7 d"."""
    if span >= timedelta(days=1) and not span % timedelta(days=1):
        return f"{span.days} d"
    return format_duration(span)


@app.command()
def migrate(database_url: DatabaseUrl = None, database_pooler: DatabasePooler = None) -> None:
    """Bring the database schema up to date."""
    from intentledger.store.database import UnsupportedDatabase
    from intentledger.store.migrate import MigrationRefused, upgrade

    settings = load_settings(database_url=database_url, database_pooler=database_pooler)
    _configure_logging(settings)
    try:
        before, after = upgrade(
            settings.database_url,
            retention=settings.record_retention,
            pooler=settings.database_pooler,
        )
    except (UnsupportedDatabase, MigrationRefused) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    if before is None:
        err.print(f"created the schema (revision {after})")
    elif before == after:
        err.print(f"the schema is up to date (revision {after})")
    else:
        err.print(f"upgraded the schema from revision {before} to {after}")


@keys_app.command("create")
def keys_create(
    actor: Annotated[str, typer.Option("--actor", help="Who the key acts for.")],
    operator: Annotated[bool, typer.Option("--operator", help="Grant the operator role.")] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Create an API key; its token is printed once, as the last line."""
    from intentledger.engine.api_keys import create_api_key
    from intentledger.engine.clock import system_clock
    from intentledger.store.database import create_ledger_engine

    settings = load_settings(database_url=database_url)
    _require_schema(settings)

    async def main() -> str:
        engine = create_ledger_engine(settings.database_url, pooler=settings.database_pooler)
        try:
            return await create_api_key(engine, system_clock, actor, operator)
        finally:
            await engine.dispose()

    try:
        token = asyncio.run(main())
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    from intentledger.engine.api_keys import hash_token

    stored = hash_token(token)
    [made] = _keys_work(
        database_url,
        lambda ledger, _now: _found(ledger.api_keys(), lambda row: row.token_hash == stored),
    )
    err.print(
        f"key {made.id} (fingerprint {stored[:12]}) created for actor {actor!r}"
        f"{' (operator)' if operator else ''}; `intentledger keys revoke {made.id}` "
        "revokes it. The token, shown this once; store it now:"
    )
    print(token)


async def _found(rows: Awaitable[Sequence[Any]], wanted: Callable[[Any], bool]) -> list[Any]:
    return [row for row in await rows if wanted(row)]


def _keys_work(database_url: str | None, work: Any) -> Any:
    """Run `work(ledger, now)` in one transaction on a migrated database."""
    from intentledger.engine.clock import system_clock
    from intentledger.store.database import create_ledger_engine
    from intentledger.store.ledger import Ledger

    settings = load_settings(database_url=database_url)
    _require_schema(settings)

    async def main() -> Any:
        engine = create_ledger_engine(settings.database_url, pooler=settings.database_pooler)
        try:
            async with engine.begin() as conn:
                return await work(Ledger(conn), system_clock())
        finally:
            await engine.dispose()

    return asyncio.run(main())


@keys_app.command("list")
def keys_list(database_url: DatabaseUrl = None) -> None:
    """Every API key: id, fingerprint, actor, role, when made and revoked (never the token)."""
    from rich import box
    from rich.table import Table

    from intentledger.ops_cli import print_table

    rows = _keys_work(database_url, lambda ledger, _now: ledger.api_keys())
    table = Table(title="API keys", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    # What `keys revoke` takes is never cut; the rest gives way at 80 columns.
    table.add_column("id", no_wrap=True)
    table.add_column("fingerprint", no_wrap=True)
    for column in ("actor", "role", "created", "revoked"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            str(row.id),
            row.token_hash[:12],
            row.actor,
            "operator" if row.is_operator else "actor",
            _to_the_second(row.created_at),
            _to_the_second(row.revoked_at) if row.revoked_at else "",
        )
    print_table(table)


def _to_the_second(at: datetime) -> str:
    """UTC to the second: what a person compares, and narrow enough for 80 columns."""
    return at.strftime("%Y-%m-%d %H:%M:%S UTC")


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[
        str, typer.Argument(help="The key's id or its fingerprint, as `keys list` shows them.")
    ],
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke a key: it authenticates nothing once each API process's short auth
    cache (at most 60 s) has let it go."""

    async def revoke(ledger: Any, now: datetime) -> Any:
        matches = await _found(ledger.api_keys(), lambda row: _names_key(key, row))
        if len(matches) != 1:
            return len(matches)
        return await ledger.revoke_api_key(matches[0].id, now)

    row = _keys_work(database_url, revoke)
    if isinstance(row, int):
        err.print(
            f"[red]no key {key!r}: give its id or fingerprint from `intentledger keys list`[/red]"
            if row == 0
            else f"[red]{key!r} names {row} keys: give the id[/red]"
        )
        raise typer.Exit(1)
    err.print(f"key {row.id} (fingerprint {row.token_hash[:12]}, actor {row.actor!r}) revoked")


def _names_key(given: str, row: Any) -> bool:
    """A key is named by its id or its fingerprint (the first 12 characters of
    the stored hash, as `keys create` and `keys list` print it)."""
    given = given.strip()
    return given == str(row.id) or (len(given) == 12 and row.token_hash.startswith(given.lower()))


@app.command()
def sandbox(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8100,
    sandbox_key_retention: KeyRetention = None,
    sandbox_database: SandboxDatabase = None,
) -> None:
    """Run the sandbox provider alone, at /_sandbox."""
    from intentledger.service import build_standalone_sandbox

    settings = load_settings(
        sandbox_key_retention=sandbox_key_retention, sandbox_database=sandbox_database
    )
    err.print(
        f"sandbox provider on http://{host}:{port}/_sandbox (truth in {settings.sandbox_database})"
    )
    # A provider takes on new connections while busy (eventloop.EAGER_ACCEPT_LOOP).
    eventloop.serve(
        build_standalone_sandbox(settings),
        eager_accept=True,
        host=host,
        port=port,
        log_level="warning",
    )


def _register_tool_commands() -> None:
    """`bench`, `chaos` and `demo` come from the intentledger-tools distribution
    (tools/), which only the dev and bench installs have: the service's own wheel
    carries no workshop code, so without the tools these commands do not exist.

    Only these three names: Typer keeps the last command registered under a
    name, so an installed package that offered `worker` or `serve` would
    replace the service's own (the chaos run's broken build is a worker)."""
    for command in entry_points(group="intentledger.commands"):
        if command.name in TOOL_COMMANDS:
            app.command(command.name)(command.load())


TOOL_COMMANDS = frozenset({"bench", "chaos", "demo"})


_register_tool_commands()


if __name__ == "__main__":  # pragma: no cover
    app()
