"""Delivering merchant events: leased, signed, bounded, retried, recorded.

A worker process runs this beside its payment loops, with its own HTTP client
and its own bound on attempts in flight, so a slow or failing endpoint takes
nothing from payments: at worst its own deliveries wait. Each delivery is
leased like an outbox row while its attempt runs; a worker that dies leaves
the lease to run out and the delivery falls due again (at least once — the
`webhook-id` header lets the merchant drop a repeat). Every attempt is kept,
with its status or error and when the next one is due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.merchant_events import RetrySchedule, next_delivery_at
from intentledger.domain.signatures import standard_signature
from intentledger.domain.webhook_targets import TargetRefused
from intentledger.engine.clock import Clock
from intentledger.engine.webhook_endpoints import Resolver, check_target, resolve
from intentledger.observability.metrics import WEBHOOKS_OUT
from intentledger.store.direct import DirectConnections
from intentledger.store.webhooks import AttemptResult, Claimed, WebhookStore, any_due

log = logging.getLogger(__name__)

USER_AGENT = "intentledger-webhooks/1"
# What a lease adds to the attempt's own bound: the database writes around it.
LEASE_MARGIN = timedelta(seconds=30)
ERROR_TEXT_LIMIT = 200
# The first attempt to end waits at most this for others to share its
# transaction, RECORD_GROUP at most: a transaction for each cost a delivery
# more CPU than its POST (docs/benchmarks.md, "News in a group record, and
# the merchant webhooks' sender").
RECORD_WINDOW = timedelta(milliseconds=2)
RECORD_GROUP = 64

# Told of each attempt once it is recorded.
Recorded = Callable[[Claimed, AttemptResult], None]


@dataclass
class _Ended:
    claimed: Claimed
    result: AttemptResult
    # time.monotonic() when the attempt ended: the window runs from here.
    ended: float
    recorded: asyncio.Future[None]


class AttemptRecorder:
    """Attempts recorded as they end, grouped by when they end: the first to
    end waits at most the window for company (what ends while a group commits
    has waited already), so a busy sender records many attempts a transaction
    and an idle one each within the window. A group whose transaction fails
    is recorded attempt by attempt, so one bad row costs the others nothing.
    `on_recorded` is told of each attempt once it is committed, whatever
    became of the task that made it."""

    def __init__(
        self,
        engine: AsyncEngine,
        owner: str,
        on_recorded: Recorded = lambda claimed, result: None,
        window: timedelta = RECORD_WINDOW,
        group: int = RECORD_GROUP,
    ) -> None:
        self.engine = engine
        self.owner = owner
        self.on_recorded = on_recorded
        self.window = window.total_seconds()
        self.group = group
        self._waiting: list[_Ended] = []
        self._full = asyncio.Event()
        self._committer: asyncio.Task[None] | None = None

    async def record(self, claimed: Claimed, result: AttemptResult) -> None:
        """Return once the attempt is committed; raise if it could not be (the
        delivery's lease then runs out and it falls due again)."""
        ended = _Ended(
            claimed, result, time.monotonic(), asyncio.get_running_loop().create_future()
        )
        self._waiting.append(ended)
        if len(self._waiting) >= self.group:
            self._full.set()
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_while_waiting())
        # Shielded: a cancelled delivery must not take its attempt out of a
        # group that is already writing it.
        await asyncio.shield(ended.recorded)

    async def wait_idle(self) -> None:
        """Until every attempt handed over is recorded or refused."""
        if self._committer is not None:
            await asyncio.gather(self._committer, return_exceptions=True)

    async def _commit_while_waiting(self) -> None:
        group: list[_Ended] = []
        try:
            while self._waiting:
                waited = time.monotonic() - self._waiting[0].ended
                if waited < self.window and len(self._waiting) < self.group:
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.window - waited):
                            await self._full.wait()
                group, self._waiting = self._waiting[: self.group], self._waiting[self.group :]
                try:
                    async with self.engine.begin() as conn:
                        await WebhookStore(conn).record_attempts(
                            [(e.claimed, e.result) for e in group], self.owner
                        )
                except Exception:
                    log.exception("recording %d webhook attempts failed; each alone", len(group))
                    await self._each_alone(group)
                    continue
                for ended in group:
                    self._recorded(ended)
        finally:
            # Cancelled (the process is going down): what was not committed is
            # not recorded, and each delivery's lease runs out as it would.
            for ended in [*group, *self._waiting]:
                if not ended.recorded.done():
                    ended.recorded.set_exception(RuntimeError("the attempt was not recorded"))
            self._waiting.clear()

    async def _each_alone(self, group: list[_Ended]) -> None:
        for ended in group:
            try:
                async with self.engine.begin() as conn:
                    # Once: the group's COMMIT may have landed with its reply lost.
                    await WebhookStore(conn).record_attempt(
                        ended.claimed, self.owner, ended.result, unless_kept=True
                    )
            except Exception as exc:
                if not ended.recorded.done():
                    ended.recorded.set_exception(exc)
            else:
                self._recorded(ended)

    def _recorded(self, ended: _Ended) -> None:
        if not ended.recorded.done():
            ended.recorded.set_result(None)
            try:
                self.on_recorded(ended.claimed, ended.result)
            except Exception:
                # Committed all the same: the others of its group must not be
                # told otherwise, nor the groups after it go unwritten.
                log.exception("reporting webhook delivery %s failed", ended.claimed.delivery_id)


class WebhookSender:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        owner: str,
        *,
        timeout: timedelta,
        in_flight_per_endpoint: int,
        concurrency: int,
        schedule: RetrySchedule,
        allow_private: bool,
        resolver: Resolver = resolve,
        jitter: Callable[[], float] = random.random,
        direct: DirectConnections | None = None,
    ) -> None:
        self.engine = engine
        # Where the idle look runs (None: on the engine). It is the sender's
        # one statement that every worker sends a poll's interval apart, work
        # or none: on the worker's own connections (store/direct.py) it costs
        # about a third of the engine's CPU, which has a pre-ping to send too.
        self.direct = direct
        self.clock = clock
        self.owner = owner
        self.timeout = timeout
        self.lease = timeout + LEASE_MARGIN
        self.in_flight_per_endpoint = in_flight_per_endpoint
        self.concurrency = concurrency
        self.schedule = schedule
        self.allow_private = allow_private
        self.resolver = resolver
        self.jitter = jitter
        # No redirects (a 3xx is a failed attempt: a redirect could lead anywhere,
        # around the target check) and no proxy from the environment.
        # No kept-alive connections: a connection is made to a checked address
        # under one name's TLS identity, and must not carry another name's request.
        self.client = httpx.AsyncClient(
            timeout=timeout.total_seconds(),
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._running: set[asyncio.Task[None]] = set()
        self.recorder = AttemptRecorder(engine, owner, self._report)

    async def run(self, stop: asyncio.Event, poll_interval: timedelta) -> None:
        """Claim due deliveries into free slots and attempt them, until `stop`."""
        # Whether the next claim looks for due work first: only after an idle
        # poll. After a claim that found work, or once an attempt has ended
        # (freeing a slot while its endpoint's backlog waits), work is likely
        # due, and the look would be one more round trip a delivery.
        look_first = True
        try:
            while not stop.is_set():
                claimed = 0
                free = self.concurrency - len(self._running)
                if free > 0:
                    try:
                        claimed = await self.start_due(free, look_first=look_first)
                    except Exception:
                        log.exception("claiming webhook deliveries failed; trying again")
                look_first = False
                if claimed == 0 or free <= claimed:
                    look_first = not await self._pause(stop, poll_interval)
        finally:
            await self.wait_idle()

    async def _pause(self, stop: asyncio.Event, interval: timedelta) -> bool:
        """Until `stop`, a slot frees, or `interval` passes: whether a slot freed."""
        stopping = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait(
                {stopping, *self._running},
                timeout=interval.total_seconds(),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
        return bool(done - {stopping})

    async def start_due(self, limit: int, *, look_first: bool = True) -> int:
        """Claim up to `limit` due deliveries and start their attempts. With
        `look_first`, a read first: on PostgreSQL an idle poll (most of them)
        then takes no row locks and writes nothing."""
        if look_first and not await self._any_due():
            return 0
        async with self.engine.begin() as conn:
            batch = await WebhookStore(conn).claim_due(
                self.clock(), self.lease, self.owner, limit, self.in_flight_per_endpoint
            )
        for claimed in batch:
            task = asyncio.create_task(self.deliver(claimed))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return len(batch)

    async def _any_due(self) -> bool:
        now = self.clock()
        if self.direct is not None:
            return await self.direct.run(lambda conn: any_due(conn, now))
        async with self.engine.connect() as conn:
            return await WebhookStore(conn).any_due(now)

    async def wait_idle(self) -> None:
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        await self.recorder.wait_idle()

    async def deliver(self, claimed: Claimed) -> None:
        try:
            # Counted and logged by the recorder once committed (`_report`).
            await self.recorder.record(claimed, await self.attempt(claimed))
        except Exception:
            log.exception(
                "webhook delivery %s: attempt not recorded; its lease will run out",
                claimed.delivery_id,
            )

    async def attempt(self, claimed: Claimed) -> AttemptResult:
        """One signed POST of the event, bounded as a whole by the timeout."""
        body = claimed.payload.encode()
        started = time.monotonic()
        status: int | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(self.timeout.total_seconds()):
                # Checked again at each attempt: a name may resolve elsewhere now.
                target = await check_target(claimed.url, self.allow_private, self.resolver)
                stamp = int(self.clock().timestamp())
                headers = {
                    "content-type": "application/json",
                    "user-agent": USER_AGENT,
                    "webhook-id": claimed.event_id,
                    "webhook-timestamp": str(stamp),
                    "webhook-signature": standard_signature(
                        claimed.event_id, stamp, body, claimed.secret
                    ),
                }
                url = httpx.URL(claimed.url)
                extensions = {}
                if target.address is not None:
                    # To the address just checked, under the name's identity (the
                    # Host header, and TLS's server name and certificate check).
                    headers["host"] = url.netloc.decode("ascii")
                    extensions["sni_hostname"] = url.host
                    url = url.copy_with(host=target.address)
                # The answer's body is never read: only its status counts, and an
                # endpoint could send anything at any length.
                async with self.client.stream(
                    "POST", url, content=body, headers=headers, extensions=extensions
                ) as response:
                    status = response.status_code
        except TargetRefused as exc:
            error = f"refused: {exc}"
        except TimeoutError:
            error = f"no answer within {self.timeout.total_seconds():g} s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
        now = self.clock()
        duration_ms = round((time.monotonic() - started) * 1000)
        delivered = status is not None and 200 <= status < 300
        next_at = None
        if not delivered:
            next_at = next_delivery_at(
                self.schedule, claimed.attempts + 1, claimed.event_created_at, now, self.jitter()
            )
        return AttemptResult(now, duration_ms, status, error, delivered, next_at)

    @staticmethod
    def _report(claimed: Claimed, result: AttemptResult) -> None:
        """Count and log an attempt once it is recorded (never its URL or secret)."""
        if result.delivered:
            WEBHOOKS_OUT.labels("delivered").inc()
            return
        gave_up = result.next_attempt_at is None
        WEBHOOKS_OUT.labels("gave_up" if gave_up else "failed").inc()
        log.log(
            logging.ERROR if gave_up else logging.WARNING,
            "webhook delivery %s (event %s) attempt %s failed: %s; %s",
            claimed.delivery_id,
            claimed.event_id,
            claimed.attempts + 1,
            result.error or f"status {result.http_status}",
            "given up" if gave_up else f"next at {result.next_attempt_at}",
            extra={
                "event": "webhook_out.gave_up" if gave_up else "webhook_out.failed",
                "delivery_id": claimed.delivery_id,
                "endpoint_id": claimed.endpoint_id,
            },
        )

    async def aclose(self) -> None:
        await self.client.aclose()
