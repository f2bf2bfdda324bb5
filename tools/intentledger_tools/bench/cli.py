"""`intentledger bench`: the command (registered by the `intentledger.commands` entry point)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from intentledger.store.database import UnsupportedDatabase, dialect_of


def bench_command(
    database_url: Annotated[
        str,
        typer.Option(
            "--database-url",
            help="A PostgreSQL URL whose ledger tables are empty (they are emptied again after).",
        ),
    ],
    quick: Annotated[
        bool, typer.Option("--quick", help="Shorter runs of every phase: about 2 minutes.")
    ] = False,
    output: Annotated[
        Path, typer.Option("--output", help="Where to write the figures as JSON.")
    ] = Path("bench-results.json"),
    profile: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            help="Sample one API process and one worker with py-spy into this directory.",
        ),
    ] = None,
    keep_logs: Annotated[
        bool, typer.Option("--keep-logs", help="Keep the processes' logs and scripts.")
    ] = False,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Run only these phases, comma-separated: "
            "intake, pooler, standby, dispatch, latency_bound, record_delay, "
            "record_delay_news, scaling, peer, peer_dbos, scan, growth.",
        ),
    ] = None,
    allow_fast_server: Annotated[
        bool,
        typer.Option(
            "--allow-fast-server",
            help="Judge the goals even on a server with fsync or synchronous_commit off "
            "(marked as judged on a non-durable server); without it they are not judged there.",
        ),
    ] = False,
) -> None:
    """Benchmarks against pgbench and a peer, in one run.

    Throughput against pgbench running our own SQL, Procrastinate and DBOS peers, recovery scan
    and memory, each judged against its goal (docs/benchmarks.md). Prints a table; the last
    line is one JSON object."""
    # Imported here: every `intentledger` process (workers too) loads this module.
    from intentledger_tools.bench.processes import ProcessFailed
    from intentledger_tools.bench.report import json_line, table, with_goals
    from intentledger_tools.bench.runner import PHASES, Bench, BenchConfig, BenchError
    from intentledger_tools.bench.tools import ToolMissing

    err = Console(stderr=True)
    try:
        if dialect_of(database_url) != "postgresql":
            raise UnsupportedDatabase("the bench runs on PostgreSQL")
    except UnsupportedDatabase as exc:
        err.print(f"[red]{exc}: pass --database-url postgresql://...[/red]")
        raise typer.Exit(2) from exc
    phases = None
    if only is not None:
        phases = frozenset(name.strip() for name in only.split(",") if name.strip())
        unknown = phases - set(PHASES)
        if not phases or unknown:
            err.print(f"[red]--only takes phases from: {', '.join(PHASES)}[/red]")
            raise typer.Exit(2)
    config = BenchConfig.for_run(
        database_url,
        quick=quick,
        output=output,
        profile_dir=profile,
        keep_logs=keep_logs,
        phases=phases,
    )
    bench = Bench(config, err)
    failed = True
    try:
        figures = with_goals(bench.run(), allow_fast_server=allow_fast_server)
        failed = False
    except (BenchError, ProcessFailed, ToolMissing) as exc:
        err.print(f"[red]bench failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        bench.cleanup(failed)
    output.write_text(json.dumps(figures, indent=2, sort_keys=True, default=str) + "\n")
    Console(width=120).print(table(figures))
    if not figures["server_durable"]:
        err.print(f"[yellow]goals {figures['goals_note']}[/yellow]")
    err.print(f"figures written to {output}")
    print(json_line(figures), flush=True)
