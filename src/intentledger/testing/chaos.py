"""The conformance kit's chaos check: a short run of payments and refunds
through the real engine and the adapter, behind the fault proxy, with the
provider's notifications late, twice, out of order or refused, judged against
the fake's own truth (intentledger.testing.truth).

    report = await check_chaos(engine, fake, build, reader=..., consistency=..., retention=...)

Everything runs in the caller's event loop on real loopback sockets: the fault
proxy (intentledger.testing.fault_proxy) in front of the fake, a worker (the
dispatcher, the reconciler, the sweeper) sending through the adapter to the
proxy, and the kit's notification line, which takes what the fake posts and
hands it on to the ledger as the webhook route does (the adapter's reader,
then `provider_events.receive`). Only the fake is the caller's: it says what
the provider executed, and it is the only source of truth the judge reads.

What a fake needs to give is `ChaosFake`. What the run cannot know is left to
the judge: a write the proxy forwarded and then lost the answer of may or may
not have executed, and the ledger must have found out which, or still be
watching, or have asked a person — never guessed. Any violation, or a run
that settled nothing (a check that cannot fail is no check), raises
`ConformanceError` with the whole report; otherwise the report is returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.safety import SafetyRules
from intentledger.domain.signatures import SignatureRefused
from intentledger.engine import intake, provider_events
from intentledger.engine.clock import system_clock
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings
from intentledger.engine.reconciler import Reconciler
from intentledger.engine.refunds import REFUND_ROUTE, RefundRefused, accept_refund
from intentledger.engine.sweeper import Sweeper
from intentledger.engine.worker import Worker, run_worker
from intentledger.ports import free_port
from intentledger.providers.base import (
    BatchWebhookReader,
    LookupConsistency,
    Provider,
    UnreadableEvent,
    WebhookReader,
    read_events,
)
from intentledger.providers.http import call_deadline
from intentledger.store.database import Pooler
from intentledger.store.direct import direct_connections_for
from intentledger.store.judging import operation_states
from intentledger.testing.conformance import ConformanceError
from intentledger.testing.fault_proxy import FaultProxy
from intentledger.testing.truth import FINAL, Truth, judge_ledger, violations_in

ACTOR = "conformance-chaos"
WORKER = "conformance-chaos"
# Each phase of a provider call; a held answer is held past all of them.
CALL_TIMEOUT = timedelta(seconds=1)
LEASE = timedelta(seconds=30)
BACKOFF = timedelta(milliseconds=200)
# The fault proxy's mix on every write: half pass, the rest are each fault it
# has. The ones after forwarding (error_after, reset_after, hold_after) are
# those that make an outcome unknown.
FAULTS: Mapping[str, float] = {
    "none": 50,
    "rate_limited": 8,
    "error_before": 8,
    "refuse": 4,
    "error_after": 10,
    "reset_after": 10,
    "hold_after": 10,
}
# The notification line: a post refused (the provider must send it again),
# handed on late, handed on twice.
REFUSED = 0.15
LATE_SECONDS = 1.5
TWICE = 0.3
# A payment known succeeded is refunded with this chance, whole or in part;
# some of those get a second refund asking for more than is left.
REFUNDED = 0.5
OVER_ASKED = 0.2


class ChaosFake(Protocol):
    """A provider's fake, as the chaos check drives it."""

    # Where the fault proxy forwards: the fake's address with no path (the
    # adapter adds its own prefix, as for `check_transport`).
    upstream: str
    # The payment methods the fake takes, weighted: each plays a scenario of
    # the fake's (a decline, a slow answer, a pending payment...).
    payment_methods: Mapping[str, int]
    currency: str

    async def prepare(self, notify_url: str, seed: int) -> None:
        """Forget everything; post any notification to `notify_url` from now
        on; draw whatever the fake draws from `seed`."""

    async def step(self) -> None:
        """What the provider does later on its own, every half second or so:
        settle what it left pending, send the notifications it held back."""

    async def quiet(self) -> bool:
        """Nothing left that the fake will do or say on its own."""

    async def truth(self) -> Truth:
        """What the fake executed, per our reference (the operation id)."""


@dataclass
class _Line:
    """The kit's end of the provider's notifications: a post is refused (the
    provider sends it again, or it is lost), or acknowledged and handed on to
    the ledger late, maybe twice, so out of order too."""

    engine: AsyncEngine
    provider: str
    reader: WebhookReader | BatchWebhookReader
    rng: random.Random
    posts: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    in_flight: set[asyncio.Task[None]] = field(default_factory=set)

    async def take(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {name.lower(): value for name, value in request.headers.items()}
        if self.rng.random() < REFUSED:
            self.posts["refused"] += 1
            return web.Response(status=503, text="refused by the conformance kit")
        self.posts["acknowledged"] += 1
        times = 2 if self.rng.random() < TWICE else 1
        self.posts["handed_on_twice"] += times - 1
        for _ in range(times):
            task = asyncio.create_task(
                self._hand_on(self.rng.uniform(0, LATE_SECONDS), body, headers)
            )
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)
        if isinstance(self.reader, BatchWebhookReader):
            return web.Response(text=self.reader.acknowledgement)
        return web.json_response({"received": True})

    async def _hand_on(self, delay: float, body: bytes, headers: dict[str, str]) -> None:
        await asyncio.sleep(delay)
        try:
            events = read_events(self.reader, body, headers, system_clock())
            for event in events:
                receipt = await provider_events.receive(
                    self.engine, system_clock, self.provider, event, BACKOFF
                )
                self.posts[f"event_{receipt.disposition}"] += not receipt.duplicate
                self.posts["event_duplicate"] += receipt.duplicate
        except (SignatureRefused, UnreadableEvent) as exc:
            self.problems.append(f"the adapter refused a notification its fake signed: {exc}")
        except Exception as exc:
            # Acknowledged already: the fake will not send it again, so the
            # run would only wait for what it said. Said now, and the run stops.
            self.problems.append(
                f"a notification the fake signed could not be taken: {type(exc).__name__}: {exc}"
            )

    def events_taken(self) -> int:
        return sum(n for name, n in self.posts.items() if name.startswith("event_"))

    async def settle(self, within: float) -> None:
        """Let what is on its way reach the ledger."""
        if self.in_flight:
            await asyncio.wait(list(self.in_flight), timeout=within)


@dataclass
class _Load:
    engine: AsyncEngine
    fake: ChaosFake
    provider: str
    rng: random.Random
    accepted: list[str] = field(default_factory=list)
    tally: Counter[str] = field(default_factory=Counter)

    def _intent(self, route: str, kind: str, body: dict[str, Any]) -> intake.Intent:
        key = f"chaos-{secrets.token_hex(8)}"
        return intake.Intent(
            ACTOR, route, key, request_hash(ACTOR, route, body), body, self.provider, kind=kind
        )

    async def payments(self, count: int, spread: float) -> None:
        methods = list(self.fake.payment_methods)
        weights = list(self.fake.payment_methods.values())
        for _ in range(count):
            body = {
                "amount": self.rng.randrange(500, 5000, 100),
                "currency": self.fake.currency,
                "payment_method": self.rng.choices(methods, weights)[0],
                "metadata": {},
            }
            intent = self._intent("POST /v1/payments", "payment", body)
            result = await intake.accept(self.engine, system_clock, intent)
            self.accepted.append(result.operation_id)
            self.tally["payments"] += 1
            await asyncio.sleep(self.rng.uniform(0, 2 * spread / count))

    async def refunds(self, settled: dict[str, tuple[str, int]]) -> None:
        """Refunds of the payments known succeeded since the last call."""
        for payment_id, (outcome, amount) in settled.items():
            if outcome != "succeeded" or self.rng.random() >= REFUNDED:
                continue
            await self._refund(payment_id, self.rng.choice((amount, amount // 2)))
            if self.rng.random() < OVER_ASKED:
                await self._refund(payment_id, amount)

    async def _refund(self, payment_id: str, amount: int) -> None:
        intent = self._intent(REFUND_ROUTE, "refund", {"amount": amount, "metadata": {}})
        try:
            result = await accept_refund(self.engine, system_clock, intent, payment_id)
        except RefundRefused as exc:
            self.tally[f"refunds_refused_{exc.slug}"] += 1
            return
        self.accepted.append(result.operation_id)
        self.tally["refunds"] += 1


async def check_chaos(
    engine: AsyncEngine,
    fake: ChaosFake,
    build: Callable[[str, timedelta], Provider],
    *,
    reader: WebhookReader | BatchWebhookReader | None,
    consistency: LookupConsistency,
    retention: RetentionPolicy,
    payments: int = 40,
    seed: int = 1,
    faults: Mapping[str, float] = FAULTS,
    fault_proxy: Callable[[str, int], FaultProxy] = FaultProxy,
    budget: timedelta = timedelta(seconds=180),
    pooler: Pooler = "none",
) -> dict[str, Any]:
    """`payments` payments, and refunds of some as they succeed, sent by a
    worker through `build(proxy_base, CALL_TIMEOUT)` (the adapter against the
    fault proxy in front of `fake.upstream`, faulting every write with the
    seeded `faults` mix; `fault_proxy` makes the proxy, a subclass that answers
    in the provider's error shapes if it has one), with its plug-in's
    `consistency` and `retention`. `reader` reads the notifications the fake
    posts (None: the provider sends none). `engine` is a migrated, empty
    ledger; on PostgreSQL the worker's batched first attempts run on
    connections of their own made from its URL, as `intentledger worker`'s
    do, and `pooler` says what that URL reaches ("pgbouncer": a pooler in
    transaction mode, where nothing is prepared). The run lasts until every
    operation is settled or waits for a person and the fake is quiet, or
    `budget` has passed; then it is judged.
    Returns the report; raises `ConformanceError` with it otherwise."""
    rng = random.Random(seed)
    started = time.monotonic()
    proxy = fault_proxy(fake.upstream, free_port())
    await proxy.start()
    proxy.config.mix = dict(faults)
    proxy.config.retry_after = 0.5
    proxy.config.refuse_seconds = 0.3
    proxy.config.hold_seconds = call_deadline(CALL_TIMEOUT).total_seconds() + 1
    proxy.rng = random.Random(seed)
    provider = build(f"http://127.0.0.1:{proxy.public_port}", CALL_TIMEOUT)
    line = _Line(engine, provider.name, reader, random.Random(seed + 1)) if reader else None
    runner, notify_url = await _listen(line)
    stop = asyncio.Event()
    worker = Worker(
        engine,
        system_clock,
        LEASE,
        WORKER,
        Dispatcher(
            engine,
            provider,
            system_clock,
            DispatchSettings(LEASE, BACKOFF),
            WORKER,
            # As `intentledger worker` runs: on PostgreSQL the batched first
            # attempts on connections of their own (closed by `worker.close`).
            direct=direct_connections_for(
                engine.url.render_as_string(hide_password=False), engine.dialect, pooler
            ),
        ),
        Reconciler(
            engine,
            provider,
            system_clock,
            BACKOFF,
            lambda _provider: retention,
            lambda _provider: SafetyRules(),
            WORKER,
            has_lookup=consistency.available,
        ),
        Sweeper(engine, system_clock, LEASE, BACKOFF, WORKER),
    )
    load = _Load(engine, fake, provider.name, rng)
    deadline = started + budget.total_seconds()
    timed_out = False
    sending: asyncio.Task[None] | None = None
    working: asyncio.Task[None] | None = None
    try:
        await fake.prepare(notify_url, seed)
        working = asyncio.create_task(
            run_worker(worker, stop, 4, timedelta(milliseconds=50), timedelta(seconds=1))
        )
        sending = asyncio.create_task(load.payments(payments, spread=3.0))
        refunded: set[str] = set()
        while True:
            await asyncio.sleep(0.5)
            await fake.step()
            if working.done():
                working.result()  # the worker's failure is the kit's
                raise ConformanceError("the worker stopped on its own")
            settled = await _settled(engine, load.accepted, refunded)
            refunded |= settled.keys()
            await load.refunds(settled)
            if line is not None and line.problems:
                break  # the judge will say so; waiting would only wait for the budget
            if sending.done() and await _done(engine, load.accepted, line, fake):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
        await sending
    finally:
        if sending is not None and not sending.done():
            sending.cancel()
        try:
            # No new notification; what is on its way reaches the ledger before
            # the workers stop (one may make work for them).
            await runner.cleanup()
            if line is not None:
                await line.settle(within=2 * LATE_SECONDS + 5)
                for task in list(line.in_flight):
                    task.cancel()
        finally:
            stop.set()
            if working is not None:
                with contextlib.suppress(Exception):
                    await working
            # Its own connections too (on PostgreSQL), whatever failed above.
            await worker.close()
            # After every forward the proxy made has reached the fake.
            await proxy.stop()
    # Every writer has stopped: the truth, then the ledger (the other way
    # round, a write landing between the two reads would count against it).
    truth = await fake.truth()
    async with engine.connect() as conn:
        report = await conn.run_sync(lambda sync: judge_ledger(sync, truth, load.accepted))
    report.update(
        seconds=round(time.monotonic() - started, 1),
        timed_out=timed_out,
        provider_executed=sum(truth.executed.values()),
        faults=dict(Counter(entry["fault"] for entry in proxy.log)),
        notifications=dict(line.posts) if line else {},
        **load.tally,
        settled=await _outcomes(engine),
    )
    problems = [f"{name} {count}" for name, count in violations_in(report).items()]
    problems += line.problems if line else []
    if timed_out:
        problems.append(
            f"the run did not settle within {budget}: {report['unresolved']} operation(s) "
            f"unresolved, by next action {report['unresolved_next_action']}"
        )
    # A check that cannot fail is no check: the run must have met what it is for.
    if not report["settled"].get("payment succeeded"):
        problems.append("no payment was settled succeeded: the run proved nothing")
    if not report["went_unknown"]:
        problems.append(
            "no operation's outcome was ever unknown: the proxy's faults never reached the "
            "ledger (does the adapter keep the timeout `build` gives it?)"
        )
    if line is not None and not line.events_taken():
        problems.append(
            "a reader was given, yet no notification reached the ledger: the fake posted "
            "nothing to the URL `prepare` gave it, or never sent a refused post again"
        )
    if problems:
        raise ConformanceError(f"{'; '.join(problems)}; the run: {report}")
    return report


async def _listen(line: _Line | None) -> tuple[web.AppRunner, str]:
    app = web.Application(client_max_size=2**22)
    if line is not None:
        app.router.add_post("/{tail:.*}", line.take)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/notifications"


async def _settled(
    engine: AsyncEngine, accepted: list[str], seen: set[str]
) -> dict[str, tuple[str, int]]:
    """The payments settled since `seen`: their outcome and amount."""
    async with engine.connect() as conn:
        rows = await operation_states(conn)
    ours = set(accepted) - seen
    return {
        row.operation_id: (row.outcome, row.amount)
        for row in rows
        if row.operation_id in ours and row.kind == "payment" and row.state == "OUTCOME_KNOWN"
    }


async def _done(
    engine: AsyncEngine, accepted: list[str], line: _Line | None, fake: ChaosFake
) -> bool:
    """Every operation settled or waiting for a person, nothing on its way."""
    async with engine.connect() as conn:
        rows = await operation_states(conn)
    open_ = [row for row in rows if row.state not in FINAL and row.next_action != "operator"]
    return not open_ and not (line and line.in_flight) and await fake.quiet()


async def _outcomes(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = await operation_states(conn)
    return dict(Counter(f"{row.kind} {row.outcome or row.state}" for row in rows))
