"""What a merchant's webhook endpoint costs a group record (issue 39).

python -m intentledger_tools.bench.news_cost --database-url URL [--group 20] [--rounds 20]
                                            [--deliveries 1000]

A group record settles the answers of many payments in one transaction, and
every settlement is news a merchant may listen for (`operation.outcome_known`).
The bench's phases have no endpoint, so none of its figures shows what the
news costs. This measures one group record of `--group` success answers,
`--rounds` times, for a merchant with no endpoint and then for one with an
endpoint taking every event, alternated twice: the statements the group record
sends, its wall time and the process's CPU per payment (`process_time`), each
the mean over the rounds, and beside them the CPU per payment of the real
claim and pre-submit that come before it (a pre-submit is no news). No provider is
called: the answers are handed to the group record as a provider's call
would hand them.

Then the news's delivery: `--deliveries` events for one endpoint (the
provider stand-in's merchant-webhook route, in a process of its own), and a
worker's merchant-webhook sender (`engine/webhook_sender.py`, as `intentledger
worker` configures it by default) run until every one is delivered: its CPU
per delivery (`process_time`, the sender alone in this process but for a
count of what is left every 50 ms), the statements it sent per delivery (on
an engine of its own), and deliveries a second. `--deliveries 0` leaves it out.

It migrates the database and leaves its rows behind (payments, events, an
endpoint per merchant): give it a throwaway database. The last line is the
figures as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger import eventloop
from intentledger.domain.canonical import request_hash
from intentledger.domain.transport import Classification, ProviderAnswer, Transport, Verdict
from intentledger.engine import intake
from intentledger.engine.announcements import new_event_id
from intentledger.engine.batch_dispatch import pre_submit
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings
from intentledger.engine.settlement_queue import Sent, answered_now, record_together
from intentledger.engine.webhook_endpoints import new_endpoint_id, new_secret
from intentledger.ports import free_port
from intentledger.providers.sandbox_client import SandboxProvider
from intentledger.service import build_webhook_sender
from intentledger.settings import Settings
from intentledger.store import merchant_events
from intentledger.store.batches import BatchLedger
from intentledger.store.database import create_ledger_engine
from intentledger.store.migrate import upgrade
from intentledger.store.tables import webhook_deliveries
from intentledger.store.webhooks import WebhookStore
from intentledger_tools.bench.stand_in import MERCHANT_WEBHOOKS, until_answering

ROUTE = "POST /v1/payments"
LEASE = timedelta(minutes=5)
WORKER = "news-cost"
# Nothing listens here: no delivery is attempted, only written.
UNUSED_URL = "http://127.0.0.1:9/news-cost"


def _clock() -> datetime:
    return datetime.now(UTC)


async def _accept(engine: AsyncEngine, actor: str, count: int) -> None:
    body = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}
    for _ in range(count):
        intent = intake.Intent(
            actor=actor,
            route=ROUTE,
            idempotency_key=secrets.token_hex(8),
            request_hash=request_hash(actor, ROUTE, body),
            body=body,
            provider="sandbox",
        )
        await intake.accept(engine, _clock, intent)


async def _listen(engine: AsyncEngine, actor: str, url: str = UNUSED_URL) -> str:
    endpoint_id = new_endpoint_id()
    async with engine.begin() as conn:
        await WebhookStore(conn).insert_endpoint(
            endpoint_id=endpoint_id,
            actor=actor,
            url=url,
            events=None,
            secret=new_secret(),
            created_at=_clock(),
        )
    return endpoint_id


async def _one_group(
    dispatcher: Dispatcher, actor: str, size: int
) -> tuple[int, float, float, float]:
    """Accept `size` payments, claim and pre-submit them, and settle them in one
    group record: its statements, wall seconds and CPU seconds, and the CPU
    seconds of the claim and the pre-submit before it."""
    engine = dispatcher.engine
    await _accept(engine, actor, size)
    claim_cpu = time.process_time()
    async with engine.begin() as conn:
        rows = await BatchLedger(conn).claim_outbox_rows(_clock(), LEASE, WORKER, size)
    prepared, others = await pre_submit(dispatcher, rows)
    claim_cpu = time.process_time() - claim_cpu
    if others or len(prepared) != size:
        raise RuntimeError(f"expected {size} first attempts, got {len(prepared)} and {len(others)}")
    sent = [
        Sent(
            item,
            ProviderAnswer(
                Transport.RESPONSE,
                status=200,
                provider_reference=f"ch_{item.row.id}",
                detail={"id": f"ch_{item.row.id}", "status": "succeeded"},
                mapped=Classification(Verdict.SUCCEEDED, "charge succeeded"),
            ),
            answered_now(),
        )
        for item in prepared
    ]
    statements = 0

    def count(*_: Any) -> None:
        nonlocal statements
        statements += 1

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        settled = await record_together(dispatcher, sent)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)
    if len(settled) != size:
        raise RuntimeError(f"the group record settled {len(settled)} of {size}")
    return statements, wall, cpu, claim_cpu


# An operation's news as a group record writes it, about its size.
PAYLOAD = json.dumps(
    {
        "type": "operation.outcome_known",
        "timestamp": "2026-12-05T18:00:00.000000Z",
        "data": {"id": "op_" + "0" * 24, "state": "OUTCOME_KNOWN", "padding": "x" * 800},
    }
)


async def _pending(engine: AsyncEngine, endpoint_id: str) -> int:
    async with engine.connect() as conn:
        counted = await conn.execute(
            select(func.count())
            .select_from(webhook_deliveries)
            .where(
                webhook_deliveries.c.endpoint_id == endpoint_id,
                webhook_deliveries.c.status == "pending",
            )
        )
        return int(counted.scalar_one())


async def measure_sender(engine: AsyncEngine, deliveries: int) -> dict[str, Any]:
    """`deliveries` events delivered to the stand-in by one sender."""
    port = free_port()
    stand_in = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "intentledger_tools.bench.stand_in", "--port", str(port)),
        *("--delay-seconds", "0"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        # The group records' events went to an address nobody answers: not
        # the sender's to try.
        async with engine.begin() as conn:
            await conn.execute(
                update(webhook_deliveries)
                .where(webhook_deliveries.c.status == "pending")
                .values(status="cancelled", finished_at=_clock())
            )
        url = f"http://127.0.0.1:{port}{MERCHANT_WEBHOOKS}"
        actor = f"receiving-{secrets.token_hex(4)}"
        endpoint_id = await _listen(engine, actor, url)
        for start in range(0, deliveries, 50):
            async with engine.begin() as conn:
                await merchant_events.add_events(
                    conn,
                    [
                        merchant_events.NewEvent(
                            new_event_id(),
                            actor,
                            "operation.outcome_known",
                            f"op_{n}",
                            PAYLOAD,
                            [endpoint_id],
                        )
                        for n in range(start, min(deliveries, start + 50))
                    ],
                    _clock(),
                )
        settings = Settings(webhook_allow_private=True)
        await until_answering(port)
        statements = 0

        def count(*_: Any) -> None:
            nonlocal statements
            statements += 1

        # The sender's engine is its own: the harness counts what is left on
        # another, so every statement counted is the sender's.
        sending = create_ledger_engine(str(engine.url.render_as_string(hide_password=False)))
        sender = build_webhook_sender(settings, sending, _clock, WORKER)
        # Ample for the stand-in, which answers at once: a sender that stops
        # delivering fails the measurement instead of retrying for days.
        deadline = time.monotonic() + 60 + deliveries / 10
        stop = asyncio.Event()
        cpu, wall = time.process_time(), time.perf_counter()
        event.listen(sending.sync_engine, "before_cursor_execute", count)
        running = asyncio.create_task(sender.run(stop, settings.poll_interval))
        try:
            while left := await _pending(engine, endpoint_id):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sender left {left} of {deliveries} undelivered")
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await running
            event.remove(sending.sync_engine, "before_cursor_execute", count)
            await sender.aclose()
            await sending.dispose()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        stand_in.kill()
        await stand_in.wait()
    figures = {
        "deliveries": deliveries,
        "deliveries_per_s": round(deliveries / wall, 1),
        "sender_cpu_ms_per_delivery": round(cpu / deliveries * 1000, 3),
        "sender_statements_per_delivery": round(statements / deliveries, 2),
    }
    print(
        f"the sender: {deliveries} deliveries at {figures['deliveries_per_s']}/s, "
        f"{figures['sender_cpu_ms_per_delivery']} ms of CPU and "
        f"{figures['sender_statements_per_delivery']} statements a delivery",
        flush=True,
    )
    return figures


async def measure(
    database_url: str, group: int, rounds: int, deliveries: int = 0
) -> dict[str, Any]:
    upgrade(database_url)
    engine = create_ledger_engine(database_url)
    provider = SandboxProvider(UNUSED_URL, timedelta(seconds=1))
    dispatcher = Dispatcher(
        engine, provider, _clock, DispatchSettings(LEASE, timedelta(seconds=30)), WORKER
    )
    try:
        silent, listening = f"silent-{secrets.token_hex(4)}", f"listening-{secrets.token_hex(4)}"
        await _listen(engine, listening)
        await _one_group(dispatcher, silent, group)  # warm-up: connections, plans
        await _one_group(dispatcher, listening, group)
        figures: dict[str, Any] = {"group": group, "rounds": rounds, "passes": []}
        for actor, label in (
            (silent, "none"),
            (listening, "one"),
            (silent, "none"),
            (listening, "one"),
        ):
            taken = [await _one_group(dispatcher, actor, group) for _ in range(rounds)]
            statements = sum(t[0] for t in taken) / rounds
            wall_ms = sum(t[1] for t in taken) / rounds * 1000
            cpu_ms = sum(t[2] for t in taken) / rounds / group * 1000
            claim_cpu_ms = sum(t[3] for t in taken) / rounds / group * 1000
            figures["passes"].append(
                {
                    "endpoints": label,
                    "statements_per_group": statements,
                    "wall_ms_per_group": round(wall_ms, 2),
                    "cpu_ms_per_payment": round(cpu_ms, 3),
                    "claim_and_presubmit_cpu_ms_per_payment": round(claim_cpu_ms, 3),
                }
            )
            print(
                f"endpoints {label}: {statements:.1f} statements, {wall_ms:.2f} ms a group "
                f"of {group}, {cpu_ms:.3f} ms of CPU a payment (the claim and the "
                f"pre-submit before it: {claim_cpu_ms:.3f} ms)",
                flush=True,
            )
        if deliveries:
            figures["sender"] = await measure_sender(engine, deliveries)
        return figures
    finally:
        await provider.aclose()
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m intentledger_tools.bench.news_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--group", type=int, default=20, help="answers per group record")
    parser.add_argument("--rounds", type=int, default=20, help="group records per pass")
    parser.add_argument(
        "--deliveries", type=int, default=1000, help="events the sender delivers (0: none)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.group <= 64 or args.rounds < 1:
        parser.error("--group must be 1-64 (a group record's largest) and --rounds at least 1")
    if args.deliveries < 0:
        parser.error("--deliveries must be 0 or more")
    figures = eventloop.run(measure(args.database_url, args.group, args.rounds, args.deliveries))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
