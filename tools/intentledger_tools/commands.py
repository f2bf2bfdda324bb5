"""The tools' commands of `intentledger` (registered through the
`intentledger.commands` entry points of tools/pyproject.toml). Their modules are
imported when a command runs: every `intentledger` process loads this one."""

from __future__ import annotations

import asyncio
import signal
from typing import Annotated, Any, cast

import typer
from rich.console import Console

from intentledger.domain.durations import format_duration

# Errors stay one line each, whatever the terminal's width (logs, CI).
err = Console(stderr=True, soft_wrap=True)


def demo(
    timeout: Annotated[float, typer.Option(help="Give up watching after this many seconds.")] = 90,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the temporary ledger.")] = False,
) -> None:
    """Send one payment per sandbox scenario to a throwaway service and watch each path."""
    from intentledger_tools.demo import run_demo

    raise typer.Exit(run_demo(Console(), timeout, keep))


def chaos(
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help="A PostgreSQL URL (required, but with --failover-every, which brings its "
            "own cluster).",
        ),
    ] = None,
    operations: Annotated[int, typer.Option(help="Payments to send.")] = 2000,
    workers: Annotated[int, typer.Option(help="Worker processes.")] = 3,
    api: Annotated[int, typer.Option(help="API processes.")] = 2,
    kill_every: Annotated[float, typer.Option(help="Seconds between SIGKILLs (randomised).")] = 2,
    restart_db_cmd: Annotated[
        str | None, typer.Option(help="Shell command that restarts the database, run once.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 1,
    timeout: Annotated[
        float,
        typer.Option(
            help="Seconds the whole run may take, load and drain: it never runs past them."
        ),
    ] = 600,
    mutation: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="blind-retry: the workers run a deliberately broken build "
            "(intentledger_tools.blind_retry) that the run must catch.",
        ),
    ] = None,
    provider: Annotated[
        str,
        typer.Option(
            help="sandbox (started by the run), stripe (--stripe-api-base) or adyen "
            "(--adyen-api-base and --adyen-truth-base: the suite's Adyen fake)."
        ),
    ] = "sandbox",
    stripe_api_base: Annotated[
        str | None, typer.Option(help="Where a stripe fleet sends (INTENTLEDGER_STRIPE_API_KEY).")
    ] = None,
    stripe_truth_base: Annotated[
        str | None,
        typer.Option(help="Where the checker lists Stripe's PaymentIntents (default: API base)."),
    ] = None,
    adyen_api_base: Annotated[
        str | None,
        typer.Option(help="Where an adyen fleet sends: the host alone (INTENTLEDGER_ADYEN_*)."),
    ] = None,
    adyen_truth_base: Annotated[
        str | None,
        typer.Option(
            help="The Adyen fake's control base (tests/adyen_fake.py): the run sets its "
            "credentials, mixes and notifications there and reads its truth."
        ),
    ] = None,
    database_pooler: Annotated[
        str,
        typer.Option(
            envvar="INTENTLEDGER_DATABASE_POOLER",
            help="INTENTLEDGER_DATABASE_POOLER: none, or pgbouncer (--database-url is a "
            "PgBouncer in transaction mode).",
        ),
    ] = "none",
    rate: Annotated[
        float | None,
        typer.Option(min=0.1, help="Payments a second, steadily (a soak); default: bursts."),
    ] = None,
    retention: Annotated[
        str | None,
        typer.Option(
            help="A soak's record retention and replay window, e.g. 5m (test-only floors "
            "lifted): the fleet reaps as it goes and the report samples the tables' sizes."
        ),
    ] = None,
    load_seconds: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            help="Spread the bursts over at least this many seconds (kills come only "
            "while the load runs); default: as fast as the fleet takes them.",
        ),
    ] = None,
    sandbox_key_retention: Annotated[
        str,
        typer.Option(
            help="The sandbox's idempotency-key retention, e.g. 24h: short (the default) "
            "so that late cases reach the safety review's 'a person decides' within a run; "
            "production-like to see how much settles without a person."
        ),
    ] = "30s",
    failover_every: Annotated[
        float | None,
        typer.Option(
            min=1.0,
            help="Run on a high-availability cluster of the run's own (pg_auto_failover: a "
            "monitor and three PostgreSQL nodes, a synchronous standby) and kill its primary "
            "about this many seconds apart while the load runs.",
        ),
    ] = None,
    failover_mode: Annotated[
        str,
        typer.Option(
            help="How a primary dies: postmaster (its postmaster SIGKILLed), node (every "
            "process of its node, as a machine dies) or both (in turn)."
        ),
    ] = "both",
    asynchronous_replication: Annotated[
        bool,
        typer.Option(
            "--asynchronous-replication",
            help="The counterexample: the cluster replicates asynchronously "
            "(synchronous_commit=local) and each kill comes right after commits no standby "
            "has. Expected to lose acknowledged intents, which the run must report.",
        ),
    ] = False,
) -> None:
    """Payments under SIGKILLs, a database restart or failovers, and provider faults,
    checked against the provider's truth. The last line is a JSON report; any violation
    exits 1."""
    from intentledger.store.database import Pooler, dialect_of
    from intentledger_tools.chaos import (
        MUTATIONS,
        ChaosConfig,
        FailoverMode,
        print_report,
        run_chaos,
    )

    if failover_every is None and asynchronous_replication:
        err.print("[red]--asynchronous-replication needs --failover-every[/red]")
        raise typer.Exit(2)
    if failover_mode not in ("postmaster", "node", "both"):
        err.print("[red]--failover-mode is postmaster, node or both[/red]")
        raise typer.Exit(2)
    if failover_every is not None:
        if database_url is not None or restart_db_cmd is not None:
            err.print(
                "[red]--failover-every runs on a cluster of its own: leave out "
                "--database-url and --restart-db-cmd[/red]"
            )
            raise typer.Exit(2)
        # Replaced by the cluster's URL once it is up (run_chaos).
        database_url = "postgresql://"
    elif database_url is None or dialect_of(database_url) != "postgresql":
        err.print("[red]chaos runs on PostgreSQL: pass --database-url postgresql://...[/red]")
        raise typer.Exit(2)
    from intentledger.domain.durations import parse_duration

    try:
        kept_for = parse_duration(retention) if retention is not None else None
    except ValueError as exc:
        err.print(f"[red]--retention: {exc}[/red]")
        raise typer.Exit(2) from exc
    try:
        key_retention = parse_duration(sandbox_key_retention)
    except ValueError as exc:
        err.print(f"[red]--sandbox-key-retention: {exc}[/red]")
        raise typer.Exit(2) from exc
    if not key_retention:
        err.print("[red]--sandbox-key-retention must be more than 0[/red]")
        raise typer.Exit(2)
    from intentledger_tools.short_retention import SHORTEST_TEST_REPLAY_WINDOW

    if kept_for is not None and kept_for < SHORTEST_TEST_REPLAY_WINDOW:
        err.print(
            f"[red]--retention must be at least {format_duration(SHORTEST_TEST_REPLAY_WINDOW)}: "
            "the client retries a lost answer for up to 2 minutes[/red]"
        )
        raise typer.Exit(2)
    if database_pooler not in ("none", "pgbouncer"):
        err.print("[red]--database-pooler is none or pgbouncer[/red]")
        raise typer.Exit(2)
    if mutation is not None and mutation not in MUTATIONS:
        err.print(f"[red]--mutation is one of: {', '.join(MUTATIONS)}[/red]")
        raise typer.Exit(2)
    if (
        provider not in ("sandbox", "stripe", "adyen")
        or (provider == "stripe") != bool(stripe_api_base)
        or (provider == "adyen") != bool(adyen_api_base and adyen_truth_base)
    ):
        err.print(
            "[red]--provider is sandbox, stripe with --stripe-api-base, or adyen with "
            "--adyen-api-base and --adyen-truth-base[/red]"
        )
        raise typer.Exit(2)
    config = ChaosConfig(
        database_url,
        operations,
        workers,
        api,
        kill_every,
        restart_db_cmd,
        seed,
        timeout,
        mutation,
        provider,
        stripe_api_base,
        stripe_truth_base,
        cast(Pooler, database_pooler),  # one of the two, checked above
        rate,
        kept_for,
        load_seconds,
        key_retention,
        adyen_api_base=adyen_api_base,
        adyen_truth_base=adyen_truth_base,
        failover_every=failover_every,
        failover_mode=cast(FailoverMode, failover_mode),  # checked above
        asynchronous_replication=asynchronous_replication,
    )

    async def main() -> dict[str, Any]:
        # SIGTERM cancels the run like Ctrl-C: run_chaos's cleanup then stops
        # every process it started before this one exits.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_chaos(config, Console(stderr=True))

    try:
        report = asyncio.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt) as exc:
        err.print("chaos stopped; every process it started has been stopped")
        raise typer.Exit(130) from exc
    print_report(report, Console(stderr=True))
    raise typer.Exit(1 if report["violations"] else 0)
