"""`intentledger chaos`: thousands of payments under SIGKILLs, a database restart
and provider faults, then the ledger checked against the provider's own truth.

Everything is a real OS process: the sandbox, API processes, workers. The
checker reads the ledger tables and the provider's executed payments (the
sandbox's charges, or Stripe's PaymentIntents from its list API, which Stripe
documents as consistent) and counts violations; any violation makes the exit
code non-zero. The last line printed is one JSON object with the counts.

With `--provider stripe` the faults are whatever sits between the ledger and
`--stripe-api-base` (the test suite puts a fault-injecting proxy there); the
load uses Stripe's test payment methods.

With `--provider adyen` the fleet sends to `--adyen-api-base` (the suite puts
its fault proxy in front of tests/adyen_fake.py there), and the run drives the
Adyen fake through its control port, `--adyen-truth-base`: the fake takes the
fleet's API key, merchant account and HMAC key, answers payments in a seeded
mix of result codes and refunds in a mix of outcomes, and holds its signed
notifications, which the run sends to the fleet's API processes late, in
shuffled order, some twice, some batched; it settles `Pending` payments later
by notification, as Adyen does. Refunds settle only by notification, so the
drain waits until the fake has nothing left to send. The truth is the fake's
own record of what it executed (`/truth`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import random
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table
from sqlalchemy import func, select, text

from intentledger.domain.durations import format_duration
from intentledger.engine.api_keys import create_api_key
from intentledger.engine.clock import system_clock
from intentledger.ports import free_port
from intentledger.store.database import Pooler, create_ledger_engine, create_sync_engine
from intentledger.store.migrate import upgrade
from intentledger.store.tables import (
    metadata,
    operations,
    outbox,
)
from intentledger.testing.truth import VIOLATIONS, Truth, judge_ledger

if TYPE_CHECKING:
    from intentledger_tools.ha_cluster import HACluster, KillMode

# Every sandbox scenario (docs/design.md#sandbox-scenarios) but pm_webhook_late,
# weighted towards the ordinary case.
SCENARIOS = {
    "pm_ok": 40,
    "pm_declined": 8,
    "pm_slow": 6,
    "pm_timeout_after_execute": 10,
    "pm_timeout_before_execute": 8,
    "pm_lookup_lag": 8,
    "pm_unavailable": 8,
    "pm_rate_limited": 8,
    "pm_blackhole": 4,
}
# Stripe's test payment methods: a card that succeeds and one that is declined.
STRIPE_SCENARIOS = {"pm_card_visa": 85, "pm_card_chargeCustomerFail": 15}
# The secret key a Stripe fleet uses unless INTENTLEDGER_STRIPE_API_KEY is set.
TEST_STRIPE_KEY = "sk_test_intentledger_chaos"
# An Adyen fleet's API key and merchant account, which the run gives the Adyen
# fake too (its HMAC key is new for every run).
TEST_ADYEN_KEY = "AQE_intentledger_chaos"
TEST_ADYEN_MERCHANT_ACCOUNT = "IntentLedgerChaosECOM"
# The stored cards an Adyen load pays with (`shopperReference:storedPaymentMethodId`);
# what each payment's answer says is the fake's seeded mix below, not the card.
ADYEN_CARDS = {f"chaos-shopper-{n}:84150000000000{n:02d}": 1 for n in range(4)}
# What the Adyen fake answers a new payment with: Pending and Received settle
# later by an AUTHORISATION notification the run has the fake send.
ADYEN_RESULT_CODES = {
    "Authorised": 78,
    "Refused": 10,
    "Error": 2,
    "Cancelled": 2,
    "Pending": 6,
    "Received": 2,
}
ADYEN_AWAITING = frozenset({"Pending", "Received"})
# How a refund at the Adyen fake ends: its notification (REFUND:false is a
# REFUND notification with success false).
ADYEN_REFUND_OUTCOMES = {"REFUND": 80, "REFUND_FAILED": 12, "REFUND:false": 8}
# Of the Pending payments the run settles, this share succeed.
ADYEN_PENDING_SUCCESS = 0.7
# The Adyen fake resends an unacknowledged batch this often, this many times:
# for two minutes, longer than the fleet's API processes take to come back
# from SIGKILLs on a loaded machine (both were seen down for 50 s).
ADYEN_ATTEMPTS = 240
ADYEN_RETRY_SECONDS = 0.5
# How often the run sends what the fake holds, and how long a Pending payment
# waits for its settlement at least.
ADYEN_FLUSH_EVERY_SECONDS = 1.0
ADYEN_SETTLE_AFTER_SECONDS = 2.0
ADYEN_SETTLE_EVERY_SECONDS = 5.0
# How long the load's client keeps retrying one request (same key) before it
# gives up, and how long the database's restart command may take.
CLIENT_PATIENCE_SECONDS = 120.0
RESTART_TIMEOUT_SECONDS = 120.0
# Refunds pick from payments older than the newest this many.
RECENT_PAYMENTS = 64
# Refund faults on the sandbox, weighted like the payments' (`sandbox_scenario`).
REFUND_SCENARIOS = {
    "ok": 60,
    "timeout_after_execute": 15,
    "timeout_before_execute": 15,
    "declined": 10,
}


# The broken builds a run can give its workers: the module each is started
# with instead of intentledger.cli (it takes the same arguments).
MUTATIONS = {"blind-retry": "intentledger_tools.blind_retry"}
# What every process of a run with --retention is started with instead (its
# `--run` names the module it would have been started with).
SHORT_RETENTION = "intentledger_tools.short_retention"


@dataclass
class ChaosConfig:
    database_url: str
    operations: int = 2000
    workers: int = 3
    api: int = 2
    kill_every: float = 2.0
    restart_db_cmd: str | None = None
    seed: int = 1
    timeout: float = 600.0
    # Set: the workers run this deliberately broken build (MUTATIONS), which
    # the run must catch; the service itself has no switch to break it.
    mutation: str | None = None
    provider: str = "sandbox"
    # Where the Stripe fleet sends (Stripe, or a fake behind a fault proxy), and
    # where the checker reads Stripe's truth (default: the same base).
    stripe_api_base: str | None = None
    stripe_truth_base: str | None = None
    # The fleet, the harness and its checker all reach PostgreSQL through it.
    database_pooler: Pooler = "none"
    # A steady rate (payments a second) instead of random bursts: a soak.
    rate: float | None = None
    # Set: the fleet reaps what settled longer ago than this (replay window
    # too), every tenth of it, and the run samples the tables' sizes.
    retention: timedelta | None = None
    # Set: the bursts are spread over at least this many seconds. Kills come
    # only while the load runs, so a load sent as fast as the fleet takes it
    # meets fewer of them the faster intake gets.
    load_seconds: float | None = None
    # The sandbox's idempotency-key retention. Short (the default) so that the
    # safety review's "a person decides" is exercised within a run; a
    # production-like one (24 h) shows how much settles without a person.
    sandbox_key_retention: timedelta = timedelta(seconds=30)
    # Where the Adyen fleet sends (the host alone: the adapter adds /v71), and
    # the Adyen fake's control base (its truth; the run drives its notifications).
    adyen_api_base: str | None = None
    adyen_truth_base: str | None = None
    # Set: the run starts its own high-availability cluster (a monitor and
    # three PostgreSQL nodes under pg_auto_failover), runs on its multi-host
    # URL and kills the current primary about this often while the load runs.
    failover_every: float | None = None
    # How a primary dies: its postmaster alone ("postmaster"), every process
    # of its node, as a machine dies ("node"), or the two in turn ("both").
    failover_mode: FailoverMode = "both"
    # The counterexample: the cluster replicates asynchronously
    # (synchronous_commit=local). Each kill, in every run, comes right after
    # commits the standbys have not received; this run is expected to lose
    # what it acknowledged, and its judge must say so.
    asynchronous_replication: bool = False

    @property
    def on_stripe(self) -> bool:
        return self.provider == "stripe"

    @property
    def on_adyen(self) -> bool:
        return self.provider == "adyen"

    @property
    def on_sandbox(self) -> bool:
        return self.provider == "sandbox"


FailoverMode = Literal["postmaster", "node", "both"]
# How long a primary's standbys are kept from its latest commits before it is
# killed: long enough for commits to be made that no standby has (and, with
# asynchronous replication, acknowledged).
FREEZE_SECONDS = 2.0
# How long the cluster may take to promote a new primary after a kill.
FAILOVER_TIMEOUT_SECONDS = 120.0


@dataclass
class Tally:
    sent: int = 0
    accepted: set[str] = field(default_factory=set)
    refused: Counter[int] = field(default_factory=Counter)
    client_retries: int = 0
    key_reuse_checks: int = 0
    reused_key_accepted: int = 0
    key_expired: int = 0
    kills: int = 0
    db_restarts: int = 0
    suspended_mandates: int = 0
    # Per failover: how the primary died, and how long until the cluster
    # promoted another and the clients were answered 2xx again.
    failovers: list[dict[str, Any]] = field(default_factory=list)
    # When each 2xx reached the client (monotonic), and the windows in which
    # the clients were answered nothing but 5xx or no answer at all.
    acked_at: list[float] = field(default_factory=list)
    unavailable_since: float | None = None
    unavailable_windows: list[float] = field(default_factory=list)
    # Answers of 5xx other than 503, by status (retried like a lost answer).
    server_errors: Counter[int] = field(default_factory=Counter)
    refunds_sent: int = 0
    refunds_accepted: int = 0
    refunds_refused: Counter[str] = field(default_factory=Counter)
    phase: str = "starting"

    def answered(self, status: int) -> None:
        now = time.monotonic()
        if status in (200, 202):
            self.acked_at.append(now)
        if self.unavailable_since is not None:
            self.unavailable_windows.append(now - self.unavailable_since)
            self.unavailable_since = None

    def unanswered(self) -> None:
        if self.unavailable_since is None:
            self.unavailable_since = time.monotonic()


class Fleet:
    """The processes under test; any of them may be killed and restarted."""

    def __init__(self, config: ChaosConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.sandbox_port = free_port()
        self.sandbox_url = f"http://127.0.0.1:{self.sandbox_port}/_sandbox"
        self.api_ports = [free_port() for _ in range(config.api)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {
            **os.environ,
            # Short timings so that kills, retries and checks all happen within a run.
            "INTENTLEDGER_DATABASE_URL": config.database_url,
            "INTENTLEDGER_DATABASE_POOLER": config.database_pooler,
            "INTENTLEDGER_PROVIDER_URL": self.sandbox_url,
            "INTENTLEDGER_SUBMIT_TIMEOUT": "1s",
            "INTENTLEDGER_LEASE": "5s",
            "INTENTLEDGER_STALE_SUBMITTING": "5s",
            "INTENTLEDGER_RECHECK_BACKOFF": "1s",
            "INTENTLEDGER_SWEEP_INTERVAL": "1s",
            "INTENTLEDGER_SANDBOX_KEY_RETENTION": format_duration(config.sandbox_key_retention),
            "INTENTLEDGER_SANDBOX_DATABASE": str(workdir / "sandbox.db"),
        }
        if config.retention is not None:
            self.env.update(
                {
                    "INTENTLEDGER_REPLAY_WINDOW": format_duration(config.retention),
                    "INTENTLEDGER_RECORD_RETENTION": format_duration(config.retention),
                    "INTENTLEDGER_REAP_INTERVAL": format_duration(
                        max(config.retention / 10, timedelta(seconds=1))
                    ),
                }
            )
        if not config.on_sandbox:
            del self.env["INTENTLEDGER_PROVIDER_URL"]
            self.env.update(
                {
                    # A fake provider on a loaded machine answers in seconds, not
                    # milliseconds: a 1 s timeout would make most calls ambiguous.
                    "INTENTLEDGER_SUBMIT_TIMEOUT": "3s",
                    "INTENTLEDGER_LEASE": "10s",
                    "INTENTLEDGER_STALE_SUBMITTING": "10s",
                }
            )
        if config.on_stripe:
            assert config.stripe_api_base, "a Stripe fleet needs --stripe-api-base"
            self.env.update(
                {
                    "INTENTLEDGER_PROVIDER": "stripe",
                    "INTENTLEDGER_STRIPE_API_BASE": config.stripe_api_base,
                    "INTENTLEDGER_STRIPE_API_KEY": os.environ.get(
                        "INTENTLEDGER_STRIPE_API_KEY", TEST_STRIPE_KEY
                    ),
                    "INTENTLEDGER_STRIPE_SEARCH_LAG": "2s",
                }
            )
        if config.on_adyen:
            assert config.adyen_api_base, "an Adyen fleet needs --adyen-api-base"
            self.env.update(
                {
                    "INTENTLEDGER_PROVIDER": "adyen",
                    "INTENTLEDGER_ADYEN_API_BASE": config.adyen_api_base,
                    "INTENTLEDGER_ADYEN_API_KEY": os.environ.get(
                        "INTENTLEDGER_ADYEN_API_KEY", TEST_ADYEN_KEY
                    ),
                    "INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT": os.environ.get(
                        "INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT", TEST_ADYEN_MERCHANT_ACCOUNT
                    ),
                    "INTENTLEDGER_ADYEN_HMAC_KEYS": secrets.token_hex(32).upper(),
                }
            )

    @property
    def health_urls(self) -> list[str]:
        own = [self.sandbox_url + "/healthz"] if self.config.on_sandbox else []
        return own + [f"http://127.0.0.1:{p}/healthz" for p in self.api_ports]

    def _command(self, name: str) -> list[str]:
        module = "intentledger.cli"
        if name.startswith("worker") and self.config.mutation is not None:
            module = MUTATIONS[self.config.mutation]
        cli = [sys.executable, "-m", module]
        if self.config.retention is not None:
            # The service refuses a window of minutes: every process that reads
            # the settings starts through the tools' build that allows one.
            cli = [sys.executable, "-m", SHORT_RETENTION, "--run", module]
        if name == "sandbox":
            return [*cli, "sandbox", "--port", str(self.sandbox_port)]
        if name.startswith("api"):
            port = self.api_ports[int(name.removeprefix("api"))]
            return [*cli, "serve", "--no-workers", "--port", str(port)]
        return [*cli, "worker", "--concurrency", "16"]

    def start(self, name: str) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            self._command(name),
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def start_all(self) -> None:
        if self.config.on_sandbox:
            self.start("sandbox")
        for n in range(self.config.api):
            self.start(f"api{n}")
        for n in range(self.config.workers):
            self.start(f"worker{n}")

    def victims(self) -> list[str]:
        return [name for name in self.procs if name != "sandbox"]

    def kill_and_restart(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.start(name)

    def stop_all(self) -> None:
        self._stop(list(self.procs.values()))

    def stop_writers(self) -> None:
        """Stop every process that can write to the ledger or call the provider
        (the API and the workers); the sandbox stays up to be read."""
        self._stop([proc for name, proc in self.procs.items() if name != "sandbox"])

    @staticmethod
    def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


async def _wait_healthy(urls: list[str], within: float = 60) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=2) as client:
        for url in urls:
            while True:
                try:
                    if (await client.get(url)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not become healthy")
                await asyncio.sleep(0.1)


class Load:
    """Drives payments over HTTP with random concurrency, retrying like a client."""

    def __init__(self, config: ChaosConfig, fleet: Fleet, token: str, tally: Tally) -> None:
        self.config = config
        self.fleet = fleet
        self.tally = tally
        self.rng = random.Random(config.seed)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.mandates: list[str] = []
        # Payments accepted so far, to refund: amount by id, and the ids in order.
        self.payments: dict[str, int] = {}
        self.paid_in_order: list[str] = []

    def _url(self) -> str:
        return f"http://127.0.0.1:{self.rng.choice(self.fleet.api_ports)}"

    async def _post(
        self, client: httpx.AsyncClient, path: str, body: Any, key: str
    ) -> httpx.Response:
        """POST until some API process answers with other than a 5xx: the same key
        and body every time, as a careful client retries after a lost answer,
        waiting as long as a 503's Retry-After asks (a database restart), for
        up to CLIENT_PATIENCE_SECONDS."""
        give_up = time.monotonic() + CLIENT_PATIENCE_SECONDS
        attempt = 0
        while time.monotonic() < give_up:
            wait = 0.05 + self.rng.random() * 0.2
            try:
                response = await client.post(
                    self._url() + path, json=body, headers={**self.headers, "Idempotency-Key": key}
                )
                if response.status_code < 500:
                    self.tally.answered(response.status_code)
                    return response
                self.tally.unanswered()
                if response.status_code != 503:
                    # Never expected: a restart or failover is a 503 with
                    # Retry-After, a killed process no answer at all.
                    self.tally.server_errors[response.status_code] += 1
                asked = response.headers.get("retry-after", "")
                if asked.isdigit():
                    wait = max(wait, min(float(asked), 2.0))
            except httpx.HTTPError:
                self.tally.unanswered()
            self.tally.client_retries += attempt == 0
            attempt += 1
            await asyncio.sleep(wait)
        raise RuntimeError(f"no API process answered {path} with key {key}")

    async def create_mandates(self, client: httpx.AsyncClient, count: int) -> None:
        for n in range(count):
            body = {"currency": "EUR", "max_amount": 5000, "total_limit": 1_000_000}
            response = await self._post(client, "/v1/mandates", body, f"chaos-md-{n}")
            self.mandates.append(response.json()["id"])

    async def one_payment(self, client: httpx.AsyncClient, n: int) -> None:
        scenarios = {"stripe": STRIPE_SCENARIOS, "adyen": ADYEN_CARDS}.get(
            self.config.provider, SCENARIOS
        )
        method = self.rng.choices(list(scenarios), weights=list(scenarios.values()))[0]
        body: dict[str, Any] = {
            "amount": 100 + n % 900,
            "currency": "EUR",
            "payment_method": method,
        }
        if self.mandates and self.rng.random() < 0.15:
            body["mandate_id"] = self.rng.choice(self.mandates)
        key = f"chaos-{self.config.seed}-{n}"
        self.tally.sent += 1
        response = await self._post(client, "/v1/payments", body, key)
        if response.status_code in (200, 202):
            self.tally.accepted.add(response.json()["id"])
            if response.json()["id"] not in self.payments:
                self.paid_in_order.append(response.json()["id"])
            self.payments[response.json()["id"]] = body["amount"]
        elif _problem_type(response) == "key-expired":
            # Only with --retention, and only for a retry that outlived the
            # window: the payment may exist, and the client is told so.
            self.tally.key_expired += 1
        else:
            self.tally.refused[response.status_code] += 1
        if self.rng.random() < 0.05:  # the same key again, same body: a replay
            await self._post(client, "/v1/payments", body, key)
        if self.rng.random() < 0.03:  # the same key, another body: must be refused
            altered = {**body, "amount": body["amount"] + 1}
            again = await self._post(client, "/v1/payments", altered, key)
            self.tally.key_reuse_checks += 1
            self.tally.reused_key_accepted += again.status_code in (200, 202)

    async def refunds_of_one_payment(self, client: httpx.AsyncClient, n: int) -> None:
        """One to three refunds of one earlier payment at once, with distinct
        keys: whatever their faults and the payment's state, the ledger must
        never let them take more than the payment captured."""
        # Not the newest: a payment must be known succeeded to be refunded, and
        # the latest bursts are still on their way.
        settled_enough = self.paid_in_order[:-RECENT_PAYMENTS]
        if not settled_enough:
            return
        payment_id = self.rng.choice(settled_enough)
        amount = self.payments[payment_id]
        asks = []
        for k in range(self.rng.randint(1, 3)):
            scenario = self.rng.choices(
                list(REFUND_SCENARIOS), weights=list(REFUND_SCENARIOS.values())
            )[0]
            # Another provider's faults come from whatever sits in front of it
            # (a proxy in tests), its outcomes from the provider (the Adyen fake's mix).
            body: dict[str, Any] = {"sandbox_scenario": scenario} if self.config.on_sandbox else {}
            if self.rng.random() < 0.8:  # otherwise all that remains
                body["amount"] = self.rng.randint(1, amount)
            asks.append((body, f"chaos-refund-{self.config.seed}-{n}-{k}"))
        self.tally.refunds_sent += len(asks)
        answers = await asyncio.gather(
            *(
                self._post(client, f"/v1/payments/{payment_id}/refunds", body, key)
                for body, key in asks
            )
        )
        for answer in answers:
            if answer.status_code in (200, 202):
                self.tally.accepted.add(answer.json()["id"])
                self.tally.refunds_accepted += 1
            else:
                problem = answer.json().get("type", str(answer.status_code))
                self.tally.refunds_refused[problem.rsplit("/", 1)[-1]] += 1

    async def suspend_some(self, client: httpx.AsyncClient) -> None:
        for mandate_id in self.mandates[: max(1, len(self.mandates) // 2)]:
            await self._post(
                client, f"/v1/mandates/{mandate_id}/suspend", None, f"chaos-suspend-{mandate_id}"
            )
            self.tally.suspended_mandates += 1

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=10, limits=limits) as client:
            await self.create_mandates(client, 4)
            if self.config.rate:
                await self.run_steadily(client, self.config.rate)
                return
            pending = list(range(self.config.operations))
            half = len(pending) // 2
            started = time.monotonic()
            while pending:
                if self.config.load_seconds:
                    done = 1 - len(pending) / self.config.operations
                    due = started + done * self.config.load_seconds
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                # Random concurrency: bursts of 1 to 32 requests at once.
                size = self.rng.randint(1, 32)
                burst, pending = pending[:size], pending[size:]
                # Refunds of earlier payments ride along.
                refunds = burst[: self.rng.randint(0, 3)]
                await asyncio.gather(
                    *(self.one_payment(client, n) for n in burst),
                    *(self.refunds_of_one_payment(client, n) for n in refunds),
                )
                if half and self.config.operations - len(pending) >= half:
                    half = 0
                    await self.suspend_some(client)

    async def run_steadily(self, client: httpx.AsyncClient, rate: float) -> None:
        """One payment every 1/rate seconds, whatever the answers take; about
        one in ten brings refunds of an earlier payment along."""
        started = time.monotonic()
        running: set[asyncio.Task[None]] = set()
        for n in range(self.config.operations):
            await asyncio.sleep(max(0.0, started + n / rate - time.monotonic()))
            work = [self.one_payment(client, n)]
            if self.rng.random() < 0.1:
                work.append(self.refunds_of_one_payment(client, n))
            for coroutine in work:
                task = asyncio.create_task(coroutine)
                running.add(task)
                task.add_done_callback(running.discard)
            if n == self.config.operations // 2:
                await self.suspend_some(client)
        await asyncio.gather(*running)


def _problem_type(response: httpx.Response) -> str:
    if response.headers.get("content-type", "").startswith("application/problem+json"):
        return str(response.json().get("type", "")).rsplit("/", 1)[-1]
    return ""


def _table_sizes(database_url: str, pooler: Pooler) -> dict[str, int]:
    """Every ledger table's bytes on disk, indexes and TOAST included, and its
    partitions' if it has any."""
    engine = create_sync_engine(database_url, pooler=pooler)
    try:
        with engine.connect() as conn:
            return {
                table.name: int(
                    conn.execute(
                        # Every partition's size, or the plain table's own.
                        text(
                            "SELECT COALESCE((SELECT SUM(pg_total_relation_size(relid)) "
                            "FROM pg_partition_tree(CAST(:name AS regclass))), "
                            "pg_total_relation_size(CAST(:name AS regclass)))"
                        ),
                        {"name": table.name},
                    ).scalar_one()
                )
                for table in metadata.sorted_tables
            }
    finally:
        engine.dispose()


def _reaped_operations(database_url: str, pooler: Pooler) -> int:
    engine = create_sync_engine(database_url, pooler=pooler)
    try:
        with engine.connect() as conn:
            query = select(func.count()).where(operations.c.reaped_at.is_not(None))
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


async def _sample_table_sizes(
    config: ChaosConfig, samples: list[dict[str, Any]], started: float, every: float
) -> None:
    while True:
        with contextlib.suppress(Exception):  # the database may be restarting
            sizes = await asyncio.to_thread(
                _table_sizes, config.database_url, config.database_pooler
            )
            samples.append({"seconds": round(time.monotonic() - started), "bytes": sizes})
        await asyncio.sleep(every)


async def _chaos_monkey(
    config: ChaosConfig, fleet: Fleet, tally: Tally, stop: asyncio.Event, rng: random.Random
) -> None:
    # Once, somewhere mid-load: measured by the payments sent, not by the clock,
    # so a faster build cannot finish its load before the restart comes.
    restart_at = rng.uniform(0.3, 0.6)
    while not stop.is_set():
        pause = config.kill_every * rng.uniform(0.5, 1.5)
        try:
            await asyncio.wait_for(stop.wait(), pause)
            return
        except TimeoutError:
            pass
        victim = rng.choice(fleet.victims())
        await asyncio.to_thread(fleet.kill_and_restart, victim)
        tally.kills += 1
        progress = tally.sent / config.operations
        if config.restart_db_cmd and not tally.db_restarts and progress >= restart_at:
            await asyncio.to_thread(restart_database, config.restart_db_cmd, fleet.workdir)
            tally.db_restarts += 1


def restart_database(command: str, workdir: Path) -> None:
    """Run the restart command with its output in a file, never a pipe (a server
    it starts may keep a pipe open for ever), and for a bounded time."""
    log = workdir / "restart-db.log"
    with log.open("ab") as output:
        try:
            done = subprocess.run(
                shlex.split(command),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=RESTART_TIMEOUT_SECONDS,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"database restart took over {RESTART_TIMEOUT_SECONDS} s") from exc
    if done.returncode != 0:
        raise RuntimeError(f"database restart failed: {log.read_text()[-500:]}")


async def _kill_primaries(
    config: ChaosConfig,
    cluster: HACluster,
    tally: Tally,
    stop: asyncio.Event,
    rng: random.Random,
) -> None:
    """Every `failover_every` seconds (randomised) while the load runs: kill the
    current primary, wait for the cluster to promote another, and record how
    long that took and how long until a client was answered 2xx again."""
    assert config.failover_every is not None
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), config.failover_every * rng.uniform(0.75, 1.25))
            return
        except TimeoutError:
            pass
        mode: KillMode = (
            ("postmaster", "node")[len(tally.failovers) % 2]
            if config.failover_mode == "both"
            else config.failover_mode
        )
        # Right after commits, in both modes, so that the two runs differ in
        # replication alone: with a synchronous standby the commits made
        # while the standbys are held back wait and are never acknowledged;
        # without one they are acknowledged and on no other node when the
        # primary dies. The walsenders stay frozen past the kill, which ends them.
        synchronous_standbys = await asyncio.to_thread(cluster.sync_standbys)
        await asyncio.to_thread(cluster.freeze_replication, FREEZE_SECONDS + 10)
        await asyncio.sleep(FREEZE_SECONDS)
        windows_before = len(tally.unavailable_windows)
        killed_at = time.monotonic()
        old = await asyncio.to_thread(cluster.kill_primary, mode)
        # Returns once another node is primary with a synchronous standby and
        # the killed one is back as a standby.
        new = await asyncio.to_thread(cluster.wait_stable, FAILOVER_TIMEOUT_SECONDS)
        seen = cluster.failovers[-1]
        promoted_at = killed_at + seen.to_new_primary
        # The clients are back once a 2xx arrives after the promotion.
        back_at = None
        while back_at is None and time.monotonic() < promoted_at + FAILOVER_TIMEOUT_SECONDS:
            # The first 2xx after the promotion (acked_at grows in time order).
            after = bisect.bisect_right(tally.acked_at, promoted_at)
            back_at = tally.acked_at[after] if after < len(tally.acked_at) else None
            if back_at is None:
                if stop.is_set():
                    break
                await asyncio.sleep(0.1)
        if back_at is None and not stop.is_set():
            raise RuntimeError(
                f"no client was answered 2xx within {FAILOVER_TIMEOUT_SECONDS:.0f} s "
                f"of {new.name} becoming the primary"
            )
        tally.failovers.append(
            {
                "mode": mode,
                "synchronous_standbys_at_kill": synchronous_standbys,
                "old_primary": old.name,
                "new_primary": new.name,
                "promoted_after_s": round(seen.to_new_primary, 1),
                "synchronous_standby_after_s": round(seen.to_sync_standby, 1),
                "old_primary_rejoined_after_s": round(seen.to_rejoined, 1),
                "without_synchronous_standby_s": round(seen.wait_primary_seconds, 1),
                "clients_back_after_s": (
                    round(back_at - killed_at, 1) if back_at is not None else None
                ),
                "longest_unanswered_s": round(
                    max(tally.unavailable_windows[windows_before:], default=0.0), 1
                ),
            }
        )


# The drain ends when no outbox row falls due within this long: a check that
# backoff has put minutes away is work the run cannot wait for, and its
# operation is reported unresolved (with what it waits for), not hidden.
DRAIN_HORIZON = timedelta(seconds=15)
# How often a run with --retention samples the tables' sizes.
TABLE_SIZES_EVERY_SECONDS = 60.0


def _pending_work(database_url: str, pooler: Pooler) -> tuple[int, Counter[str]]:
    """Outbox rows due now or within DRAIN_HORIZON, and the operations by state."""
    engine = create_sync_engine(database_url, pooler=pooler)
    horizon = datetime.now(UTC) + DRAIN_HORIZON
    try:
        with engine.connect() as conn:
            pending = conn.execute(
                select(outbox.c.id).where(outbox.c.done_at.is_(None), outbox.c.due_at <= horizon)
            ).all()
            states = Counter(row.state for row in conn.execute(select(operations.c.state)))
    finally:
        engine.dispose()
    return len(pending), states


def _view(tally: Tally, states: Counter[str], pending: int, started: float) -> Table:
    table = Table(title=f"intentledger chaos — {tally.phase} — {time.monotonic() - started:.0f}s")
    table.add_column("what")
    table.add_column("count", justify="right")
    rows = [
        ("payments sent", tally.sent),
        ("accepted (2xx)", len(tally.accepted)),
        ("client retries after a lost answer", tally.client_retries),
        ("processes SIGKILLed", tally.kills),
        ("database restarts", tally.db_restarts),
        ("primary failovers", len(tally.failovers)),
        ("mandates suspended", tally.suspended_mandates),
        ("outbox rows pending", pending),
    ]
    rows += [(f"state {state}", count) for state, count in sorted(states.items())]
    for what, count in rows:
        table.add_row(what, str(count))
    return table


def sandbox_truth(sandbox_url: str) -> Truth:
    """From the sandbox's own store."""
    charges = httpx.get(f"{sandbox_url}/charges", timeout=30).json()["data"]
    refunds = httpx.get(f"{sandbox_url}/refunds", timeout=30).json()["data"]
    executed = Counter(c["reference"] for c in charges) + Counter(r["reference"] for r in refunds)
    refunded: Counter[str] = Counter()
    for r in refunds:
        refunded[r["charge"]] += r["amount"]
    amounts: dict[str, list[int]] = {}
    for write in [*charges, *refunds]:
        amounts.setdefault(write["reference"], []).append(write["amount"])
    return Truth(executed, {c["id"]: c["amount"] for c in charges}, refunded, amounts)


def stripe_truth(api_base: str, api_key: str) -> tuple[Truth, int]:
    """Succeeded PaymentIntents and Refunds per operation id (their metadata
    reference), what each PaymentIntent took and what was refunded of it, paged
    through Stripe's list APIs; and how many PaymentIntents there are."""
    executed: Counter[str] = Counter()
    captured: dict[str, int] = {}
    refunded: Counter[str] = Counter()
    amounts: dict[str, list[int]] = {}
    total = 0
    with httpx.Client(
        base_url=api_base, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    ) as client:
        for intent in _every(client, "/v1/payment_intents"):
            total += 1
            if intent["status"] == "succeeded":
                executed[_reference_of(intent)] += 1
                captured[intent["id"]] = intent["amount"]
                amounts.setdefault(_reference_of(intent), []).append(intent["amount"])
        for refund in _every(client, "/v1/refunds"):
            if refund["status"] == "succeeded":
                executed[_reference_of(refund)] += 1
                amounts.setdefault(_reference_of(refund), []).append(refund["amount"])
                refunded[str(refund.get("payment_intent") or refund.get("charge"))] += refund[
                    "amount"
                ]
    return Truth(executed, captured, refunded, amounts), total


def _reference_of(stripe_object: dict[str, Any]) -> str:
    return str((stripe_object.get("metadata") or {}).get("intentledger_reference", ""))


def _every(client: httpx.Client, path: str) -> Iterator[dict[str, Any]]:
    params = {"limit": "100"}
    while True:
        page = client.get(path, params=params)
        page.raise_for_status()
        body = page.json()
        yield from body["data"]
        if not body.get("has_more") or not body["data"]:
            return
        params = {"limit": "100", "starting_after": body["data"][-1]["id"]}


def adyen_truth(truth: dict[str, Any]) -> Truth:
    """From the Adyen fake's own record (its `/truth`): a payment executed if
    it was authorised (at once, or by the AUTHORISATION its Pending or Received
    answer was settled with), a refund if its REFUND notification said success;
    per payment's pspReference what it took and what was refunded of it."""
    executed: Counter[str] = Counter()
    captured: dict[str, int] = {}
    refunded: Counter[str] = Counter()
    amounts: dict[str, list[int]] = {}
    for payment in truth["payments"]:
        if payment["resultCode"] == "Authorised" or payment.get("settled") is True:
            executed[str(payment["reference"])] += 1
            captured[payment["pspReference"]] = int(payment["amount"]["value"])
            amounts.setdefault(str(payment["reference"]), []).append(
                int(payment["amount"]["value"])
            )
    for refund in truth["refunds"]:
        if refund.get("settled") == "REFUND":
            executed[str(refund["reference"])] += 1
            amounts.setdefault(str(refund["reference"]), []).append(int(refund["amount"]["value"]))
            refunded[refund["paymentPspReference"]] += int(refund["amount"]["value"])
    return Truth(executed, captured, refunded, amounts)


def adyen_report(truth: dict[str, Any]) -> dict[str, Any]:
    """What the Adyen fake did besides executing: how many payments and
    refunds it holds, and how its notifications went."""
    deliveries = truth["deliveries"]
    return {
        "provider_payments": len(truth["payments"]),
        "provider_refunds": len(truth["refunds"]),
        "provider_result_codes": dict(Counter(p["resultCode"] for p in truth["payments"])),
        "provider_refund_outcomes": dict(Counter(str(r.get("settled")) for r in truth["refunds"])),
        "notification_posts": len(deliveries),
        "notification_items_accepted": sum(
            len(d["pspReferences"]) for d in deliveries if d.get("accepted")
        ),
        # Batches the fake stopped resending unacknowledged: what they said
        # never reached the ledger.
        "notifications_given_up": sum(
            1 for d in deliveries if not d.get("accepted") and d["attempt"] >= ADYEN_ATTEMPTS
        ),
        "notifications_held": len(truth["held"]),
    }


class AdyenNotifications:
    """Drives the Adyen fake's notifications through its control port: held,
    then sent to a random API process of the fleet every second or so, in
    shuffled order, some twice, some in one batch; Pending payments settled
    a few seconds after they were answered."""

    def __init__(self, config: ChaosConfig, fleet: Fleet, rng: random.Random) -> None:
        assert config.adyen_truth_base, "an Adyen run needs --adyen-truth-base"
        self.base = config.adyen_truth_base.rstrip("/")
        self.config = config
        self.fleet = fleet
        self.rng = rng
        self.client = httpx.AsyncClient(timeout=60)
        self.flushes = 0
        # The Pending and Received payments settled (or being settled) by the run.
        self._settling: set[str] = set()
        # The load is done: nothing is held, and what waits is settled at once.
        self.draining = False

    def _notify_url(self) -> str:
        port = self.rng.choice(self.fleet.api_ports)
        return f"http://127.0.0.1:{port}/v1/provider-webhooks/adyen"

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        response = await self.client.post(self.base + path, json=payload)
        response.raise_for_status()
        return response.json()

    async def truth(self) -> dict[str, Any]:
        response = await self.client.get(self.base + "/truth")
        response.raise_for_status()
        truth: dict[str, Any] = response.json()
        return truth

    async def prepare(self) -> None:
        """The fake takes the fleet's credentials and the run's seeded mixes."""
        rng = random.Random(self.config.seed + 2)
        count = 2 * self.config.operations
        codes = rng.choices(list(ADYEN_RESULT_CODES), list(ADYEN_RESULT_CODES.values()), k=count)
        outcomes = rng.choices(
            list(ADYEN_REFUND_OUTCOMES), list(ADYEN_REFUND_OUTCOMES.values()), k=count
        )
        env = self.fleet.env
        await self._post(
            "/config",
            {
                "api_key": env["INTENTLEDGER_ADYEN_API_KEY"],
                "merchant_account": env["INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT"],
                "hmac_key": env["INTENTLEDGER_ADYEN_HMAC_KEYS"],
                "notify_url": self._notify_url(),
                "result_codes": codes,
                "default_result_code": "Authorised",
                "refund_outcomes": outcomes,
                "default_refund_outcome": "REFUND",
                "hold_notifications": True,
                "duplicate_notifications": False,
                "notification_attempts": ADYEN_ATTEMPTS,
                "notification_retry_seconds": ADYEN_RETRY_SECONDS,
            },
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: send what the fake holds, and settle what waits."""
        settle_due = time.monotonic() + ADYEN_SETTLE_EVERY_SECONDS
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                pause = ADYEN_FLUSH_EVERY_SECONDS * self.rng.uniform(0.5, 1.5)
                await asyncio.wait_for(stop.wait(), pause)
                return
            if not self.draining:
                await self._flush(duplicate=self.rng.random() < 0.3)
            if time.monotonic() >= settle_due:
                # Draining, what the fleet still sends is settled at once.
                await self._settle_waiting(0.0 if self.draining else ADYEN_SETTLE_AFTER_SECONDS)
                every = ADYEN_FLUSH_EVERY_SECONDS if self.draining else ADYEN_SETTLE_EVERY_SECONDS
                settle_due = time.monotonic() + every

    async def _flush(self, duplicate: bool) -> None:
        # Each flush to one API process, as Adyen's retries may reach any of them.
        await self._post("/config", {"notify_url": self._notify_url()})
        order = {
            "order": "shuffle",
            "duplicate": duplicate,
            "seed": self.rng.randrange(2**31),
            "batch": self.rng.random() < 0.5,
        }
        await self._post("/notifications/flush", order)
        self.flushes += 1

    async def _settle_waiting(self, older_than: float) -> None:
        truth = await self.truth()
        for payment in truth["payments"]:
            psp = payment["pspReference"]
            waiting = payment["resultCode"] in ADYEN_AWAITING and payment.get("settled") is None
            if (
                waiting
                and psp not in self._settling
                and truth["now"] - payment["executedAt"] >= older_than
            ):
                # Once: a second settlement could contradict the first.
                self._settling.add(psp)
                success = self.rng.random() < ADYEN_PENDING_SUCCESS
                await self._post(f"/settle/{psp}", {"success": success})

    async def finish(self) -> None:
        """The load is done: every notification goes out at once from now on,
        twice, what is held is sent, and every payment waiting is settled."""
        self.draining = True
        await self._post("/config", {"hold_notifications": False, "duplicate_notifications": True})
        await self._flush(duplicate=True)
        await self._settle_waiting(0.0)

    async def quiet(self) -> bool:
        """Nothing held, nothing being sent, nothing waiting to be settled."""
        truth = await self.truth()
        waiting = any(
            p["resultCode"] in ADYEN_AWAITING and p.get("settled") is None
            for p in truth["payments"]
        )
        return not truth["held"] and not truth["sending"] and not waiting

    def report(self) -> dict[str, Any]:
        return {"notification_flushes": self.flushes, "pending_settled": len(self._settling)}

    async def aclose(self) -> None:
        await self.client.aclose()


def check(database_url: str, truth: Truth, tally: Tally, pooler: Pooler = "none") -> dict[str, Any]:
    """Compare the ledger with the provider's truth (intentledger.testing.truth)."""
    engine = create_sync_engine(database_url, pooler=pooler)
    try:
        with engine.connect() as conn:
            return judge_ledger(conn, truth, tally.accepted, tally.reused_key_accepted)
    finally:
        engine.dispose()


def judge(config: ChaosConfig, fleet: Fleet, tally: Tally) -> dict[str, Any]:
    """Stop every process that can still write (a run out of time leaves work in
    flight), then read the provider's truth, then the ledger: a payment executed
    and recorded between the two reads would otherwise count as a contradiction."""
    fleet.stop_writers()
    provider_report: dict[str, Any] = {}
    if config.on_stripe:
        assert config.stripe_api_base is not None
        truth, provider_payments = stripe_truth(
            config.stripe_truth_base or config.stripe_api_base,
            fleet.env["INTENTLEDGER_STRIPE_API_KEY"],
        )
        provider_report["provider_payment_intents"] = provider_payments
    elif config.on_adyen:
        assert config.adyen_truth_base is not None
        answer = httpx.get(config.adyen_truth_base.rstrip("/") + "/truth", timeout=60)
        answer.raise_for_status()
        record = answer.json()
        truth = adyen_truth(record)
        provider_report = adyen_report(record)
    else:
        truth = sandbox_truth(fleet.sandbox_url)
    report = check(config.database_url, truth, tally, config.database_pooler)
    report["provider"] = config.provider
    report["sandbox_key_retention"] = format_duration(config.sandbox_key_retention)
    report["provider_executed"] = sum(truth.executed.values())
    report.update(provider_report)
    return report


async def _token(database_url: str, pooler: Pooler) -> str:
    engine = create_ledger_engine(database_url, pooler=pooler)
    try:
        return await create_api_key(engine, system_clock, "chaos", is_operator=False)
    finally:
        await engine.dispose()


async def run_chaos(config: ChaosConfig, console: Console) -> dict[str, Any]:
    """The run, on `config.database_url` or, with failovers, on a
    high-availability cluster of its own that lives as long as the run."""
    workdir = Path(tempfile.mkdtemp(prefix="intentledger-chaos-"))
    if config.failover_every is None:
        return await _run_chaos(config, console, workdir, None)
    from intentledger_tools.ha_cluster import HACluster

    console.print("chaos: starting a high-availability cluster (a monitor and three nodes)")
    # A directory of its own: the run's is closed to the postgres user.
    cluster = HACluster(
        Path(tempfile.mkdtemp(prefix="intentledger-ha-")),
        synchronous=not config.asynchronous_replication,
    )
    try:
        await asyncio.to_thread(cluster.start)
        await asyncio.to_thread(cluster.create_database, "chaos")
        on_cluster = replace(config, database_url=cluster.database_url("chaos"))
        report = await _run_chaos(on_cluster, console, workdir, cluster)
    finally:
        await asyncio.to_thread(cluster.stop)
    report["replication"] = "asynchronous" if config.asynchronous_replication else "synchronous"
    return report


async def _run_chaos(
    config: ChaosConfig, console: Console, workdir: Path, cluster: HACluster | None
) -> dict[str, Any]:
    started = time.monotonic()
    # A soak's partitions are made for its short retention from the start.
    upgrade(config.database_url, retention=config.retention, pooler=config.database_pooler)
    token = await _token(config.database_url, config.database_pooler)
    fleet = Fleet(config, workdir)
    tally = Tally()
    rng = random.Random(config.seed + 1)
    notifications = (
        AdyenNotifications(config, fleet, random.Random(config.seed + 3))
        if config.on_adyen
        else None
    )
    notifying: asyncio.Task[None] | None = None
    failing_over: asyncio.Task[None] | None = None
    # Stopped only once the drain is over: late notifications are part of it.
    stop_notifying = asyncio.Event()
    fleet.start_all()
    try:
        if notifications is not None:
            await notifications.prepare()
        await _wait_healthy(fleet.health_urls)
        stop = asyncio.Event()
        monkey = asyncio.create_task(_chaos_monkey(config, fleet, tally, stop, rng))
        if cluster is not None:
            failing_over = asyncio.create_task(
                _kill_primaries(config, cluster, tally, stop, random.Random(config.seed + 5))
            )
        if notifications is not None:
            notifying = asyncio.create_task(notifications.run(stop_notifying))
        samples: list[dict[str, Any]] = []
        sampler = (
            asyncio.create_task(
                _sample_table_sizes(config, samples, started, TABLE_SIZES_EVERY_SECONDS)
            )
            if config.retention is not None
            else None
        )
        load = asyncio.create_task(Load(config, fleet, token, tally).run())
        tally.phase = "load"
        states: Counter[str] = Counter()
        pending = 0
        # --timeout bounds the whole run, load and drain: it never runs past it.
        deadline = time.monotonic() + config.timeout
        draining = False
        with Live(
            _view(tally, states, pending, started), console=console, refresh_per_second=2
        ) as live:
            while True:
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):  # the database may be restarting
                    pending, states = await asyncio.to_thread(
                        _pending_work, config.database_url, config.database_pooler
                    )
                live.update(_view(tally, states, pending, started))
                for task in (monkey, failing_over):
                    if task is not None and task.done() and task.exception():
                        raise task.exception()  # type: ignore[misc]
                if notifying is not None and notifying.done() and notifying.exception():
                    raise notifying.exception()  # type: ignore[misc]
                out_of_time = time.monotonic() > deadline
                if out_of_time and not load.done():
                    load.cancel()
                    tally.phase = "out of time"
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
                if not load.done():
                    continue
                if not load.cancelled():
                    load.result()
                if not draining:
                    # Load done: stop killing and let the system drain.
                    draining = True
                    stop.set()
                    await monkey
                    if failing_over is not None:
                        # A failover under way ends (the cluster stable again)
                        # before the drain is judged.
                        await failing_over
                    if notifications is not None:
                        await notifications.finish()
                    tally.phase = "draining"
                if out_of_time:
                    break
                if pending == 0 and await _provider_quiet(notifications):
                    # Quiet first, then the outbox again: what the last
                    # notifications brought is in it now.
                    pending, _ = await asyncio.to_thread(
                        _pending_work, config.database_url, config.database_pooler
                    )
                    if pending == 0:
                        break
        tally.phase = "checking"
        stop_notifying.set()
        if notifying is not None:
            await notifying
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            samples.append(
                {
                    "seconds": round(time.monotonic() - started),
                    "bytes": await asyncio.to_thread(
                        _table_sizes, config.database_url, config.database_pooler
                    ),
                }
            )
        report = await asyncio.to_thread(judge, config, fleet, tally)
        if notifications is not None:
            report.update(notifications.report())
        report["out_of_time"] = out_of_time
        if config.retention is not None:
            report["retention"] = format_duration(config.retention)
            report["reaped_operations"] = await asyncio.to_thread(
                _reaped_operations, config.database_url, config.database_pooler
            )
            report["table_sizes"] = samples
    finally:
        fleet.stop_all()
        if failing_over is not None and not failing_over.done():
            failing_over.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await failing_over
        if notifying is not None and not notifying.done():
            notifying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await notifying
        if notifications is not None:
            await notifications.aclose()
    report.update(
        {
            "operations": tally.sent,
            "accepted": len(tally.accepted),
            "kills": tally.kills,
            "db_restarts": tally.db_restarts,
            "failovers": tally.failovers,
            "longest_unanswered_s": round(max(tally.unavailable_windows, default=0.0), 1),
            "client_retries": tally.client_retries,
            "refused_by_status": dict(tally.refused),
            "server_errors": dict(tally.server_errors),
            "key_reuse_checks": tally.key_reuse_checks,
            "key_expired": tally.key_expired,
            "refunds_sent": tally.refunds_sent,
            "refunds_accepted": tally.refunds_accepted,
            "refunds_refused": dict(tally.refunds_refused),
            "seconds": round(time.monotonic() - started, 1),
            "logs": str(workdir),
        }
    )
    report["violations"] = sum(report[name] for name in VIOLATIONS)
    return report


def print_report(report: dict[str, Any], console: Console) -> None:
    console.print(
        "violations: "
        + ", ".join(f"{name} {report[name]}" for name in VIOLATIONS)
        + f"; unresolved {report['unresolved']} {report['unresolved_by_state']}"
    )
    print(json.dumps(report, sort_keys=True))


async def _provider_quiet(notifications: AdyenNotifications | None) -> bool:
    """Has the provider nothing left to tell the ledger? Only the Adyen fake
    can still have something (a notification held, being sent, or a payment
    waiting to be settled); a failed read of it says no."""
    if notifications is None:
        return True
    try:
        return await notifications.quiet()
    except httpx.HTTPError:
        return False
