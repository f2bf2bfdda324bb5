"""`intentledger demo`: every sandbox scenario, watched live on a throwaway service."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from intentledger.domain.currencies import format_amount
from intentledger.engine.api_keys import create_api_key
from intentledger.engine.clock import system_clock
from intentledger.ports import free_port
from intentledger.store.database import create_ledger_engine
from intentledger.store.migrate import upgrade

SCENARIOS = (
    "pm_ok",
    "pm_declined",
    "pm_slow",
    "pm_timeout_after_execute",
    "pm_timeout_before_execute",
    "pm_lookup_lag",
    "pm_unavailable",
    "pm_rate_limited",
    "pm_blackhole",
)
# Short names keep a path readable: ACC → SUB → UNK → DUE → SAFE → SUB → KNOWN.
SHORT = {
    "ACCEPTED": "ACC",
    "SUBMITTING": "SUB",
    "UNKNOWN": "UNK",
    "RECONCILIATION_DUE": "DUE",
    "SAFETY_REVIEW": "SAFE",
    "MANUAL_REVIEW": "MANUAL",
    "OUTCOME_KNOWN": "KNOWN",
    "CANCELLED": "CANC",
}
RESTING = frozenset({"OUTCOME_KNOWN", "MANUAL_REVIEW", "CANCELLED"})


@dataclass
class Watched:
    scenario: str
    operation_id: str
    path: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    state: str = "ACCEPTED"
    outcome: str | None = None
    next_action: str = "submit"
    charges: int = 0
    amount: str = ""


async def _new_key(database_url: str) -> str:
    engine = create_ledger_engine(database_url)
    try:
        return await create_api_key(engine, system_clock, "demo", is_operator=False)
    finally:
        await engine.dispose()


def _table(watched: list[Watched], elapsed: float) -> Table:
    table = Table(
        title=f"intentledger demo — {elapsed:4.1f}s",
        caption="ACC accepted · SUB submitting · UNK unknown · DUE reconciliation due · "
        "SAFE safety review · MANUAL manual review · KNOWN outcome known",
        expand=True,
    )
    table.add_column("scenario", no_wrap=True)
    table.add_column("amount", no_wrap=True)
    table.add_column("path through states", overflow="fold")
    table.add_column("decisions", overflow="fold")
    table.add_column("now", no_wrap=True)
    table.add_column("charges", justify="right")
    for item in watched:
        now = item.state + (f" ({item.outcome})" if item.outcome else f" → {item.next_action}")
        path = " → ".join(SHORT.get(state, state) for state in item.path)
        table.add_row(
            item.scenario, item.amount, path, ", ".join(item.decisions), now, str(item.charges)
        )
    return table


def _refresh(client: httpx.Client, item: Watched) -> None:
    events = client.get(f"/v1/operations/{item.operation_id}/events").json()["data"]
    item.path = [e["to_state"] for e in events if e["type"] == "transition"]
    item.decisions = [e["rule"] for e in events if e["type"] == "decision"]
    record: dict[str, Any] = client.get(f"/v1/operations/{item.operation_id}").json()
    item.state, item.outcome, item.next_action = (
        record["state"],
        record["outcome"],
        record["next_action"],
    )
    item.amount = format_amount(record["amount"], record["currency"])
    charges = client.get("/_sandbox/charges", params={"reference": item.operation_id})
    item.charges = len(charges.json()["data"])


def run_demo(console: Console, timeout: float, keep: bool) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="intentledger-demo-"))
    database_url = f"sqlite:///{workdir / 'ledger.db'}"
    upgrade(database_url)
    token = asyncio.run(_new_key(database_url))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (workdir / "serve.log").open("wb")
    # Short timings so every path completes in seconds; a 10 s key retention so
    # the blackhole reaches a person quickly.
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "intentledger.cli",
            "serve",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--sandbox-database",
            str(workdir / "sandbox.db"),
            "--submit-timeout",
            "1500ms",
            "--recheck-backoff",
            "1s",
            "--sandbox-key-retention",
            "10s",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as client:
            _wait_healthy(client, server, workdir)
            console.print(f"service on {url}, ledger {database_url}")
            watched = [
                Watched(
                    scenario,
                    client.post(
                        "/v1/payments",
                        json={"amount": 1000, "currency": "EUR", "payment_method": scenario},
                        headers={"Idempotency-Key": f"demo-{scenario}"},
                    ).json()["id"],
                )
                for scenario in SCENARIOS
            ]
            started = time.monotonic()
            with Live(_table(watched, 0), console=console, refresh_per_second=4) as live:
                while True:
                    for item in watched:
                        _refresh(client, item)
                    elapsed = time.monotonic() - started
                    live.update(_table(watched, elapsed))
                    if all(item.state in RESTING for item in watched) or elapsed > timeout:
                        break
                    time.sleep(0.3)
        unsettled = [item.scenario for item in watched if item.state not in RESTING]
        if unsettled:
            console.print(f"[yellow]still moving after {timeout:.0f}s: {', '.join(unsettled)}[/]")
        console.print(
            f"Inspect any of them: intentledger ops show ID --database-url {database_url}"
            if keep
            else "Run with --keep to inspect the ledger afterwards."
        )
        return 1 if unsettled else 0
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()
        if not keep:
            for path in sorted(workdir.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            workdir.rmdir()


def _wait_healthy(client: httpx.Client, server: subprocess.Popen[bytes], workdir: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the service exited: see {workdir / 'serve.log'}")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the service did not become healthy within 30 s")
