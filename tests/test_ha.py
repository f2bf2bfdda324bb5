"""The ledger on a real high-availability PostgreSQL cluster (issue 38): a
pg_auto_failover monitor and three data nodes (tools/intentledger_tools/
ha_cluster.py), the service given the multi-host URL with
target_session_attrs=read-write.

- The served process follows the primary through two failovers (its
  postmaster killed, then its whole node): the API answers 503 while no node
  takes writes, never 500; payments are acknowledged again on the new primary;
  every acknowledged payment is there afterwards and settles. Its /metrics
  says its commits wait for a synchronous standby before and after each
  failover, and names another server (start time) after each.
- The harness can see a loss: on an asynchronous cluster, commits made while
  replication is frozen are acknowledged and lost when the primary's machine
  dies; the same procedure on the synchronous cluster loses none.
- A sweep of a dead run's registry record signals no process whose pid was
  reused and removes no directory a cluster did not make.

The clusters are PostgreSQL only, and `alone`: four PostgreSQL servers and a served process.
pg_autoctl missing is an error (installed as root by scripts/ensure-test-tools
or here), never a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from intentledger_tools.ha_cluster import (
    REGISTRY,
    HACluster,
    HAClusterError,
    Node,
    sweep_stale_clusters,
)
from tests.conftest import BACKENDS
from tests.served import serve
from tests.test_cli import run
from tests.test_intake_http import create_key

pytestmark = pytest.mark.alone

# Acknowledged payments each phase needs after the new primary is stable.
ACKS_AFTER_FAILOVER = 30
# What a kill interrupts is taken up again after seconds, not the defaults'
# minutes: a SUBMITTING whose answer was lost with the primary (the sweeper's
# stale_submitting, 2 min), and outbox rows a worker had claimed when its
# connection died (their lease, 5 min).
RECOVER_SOON = ("--stale-submitting", "4s", "--sweep-interval", "1s", "--lease", "5s")


def _cluster(synchronous: bool) -> HACluster:
    if "postgresql" not in BACKENDS:
        pytest.skip("an HA cluster is PostgreSQL (INTENTLEDGER_TEST_BACKENDS)")
    # Not pytest's tmp_path: its parents are closed to the postgres user.
    return HACluster(
        Path(tempfile.mkdtemp(prefix="intentledger-ha-test.")), synchronous=synchronous
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[HACluster]:
    with _cluster(synchronous=True) as started:
        yield started


class Threads:
    """Background threads whose exceptions reach the test."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def start(self, target: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                target()
            except BaseException as error:  # re-raised in the main thread by join()
                self.errors.append(error)

        thread = threading.Thread(target=guarded, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not [t for t in self._threads if t.is_alive()], "a client thread never ended"
        if self.errors:
            raise self.errors[0]


@dataclass
class Payer:
    """Posts payments one after another, each under its own idempotency key; a
    503 or a broken connection is retried with the same key."""

    base: str
    auth: dict[str, str]
    prefix: str
    acks: list[tuple[float, str]] = field(default_factory=list)
    unavailable: int = 0
    connection_errors: int = 0
    failures: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        with httpx.Client(timeout=15) as client:
            for n in itertools.count():
                if stop.is_set():
                    return
                self.pay(client, f"{self.prefix}-{n}", stop)

    def pay(self, client: httpx.Client, key: str, stop: threading.Event) -> None:
        """One payment under `key`, retried until answered or `stop`."""
        while not stop.is_set():
            try:
                answer = client.post(
                    f"{self.base}/v1/payments",
                    json={"amount": 990, "currency": "EUR", "payment_method": "pm_ok"},
                    headers={**self.auth, "Idempotency-Key": key},
                )
            except httpx.TransportError:
                self.connection_errors += 1
                time.sleep(0.1)
                continue
            if answer.status_code == 503:
                assert answer.json()["type"].endswith("database-unavailable"), answer.text
                assert answer.headers.get("Retry-After"), answer.headers
                self.unavailable += 1
                time.sleep(0.1)
                continue
            if 200 <= answer.status_code < 300:
                self.acks.append((time.monotonic(), answer.json()["id"]))
            else:
                self.failures.append(f"{key}: {answer.status_code} {answer.text[:300]}")
            return

    def acked_since(self, moment: float) -> list[str]:
        return [op for at, op in self.acks if at >= moment]


def _present_on(node: Node, op_ids: list[str], dbname: str) -> set[str]:
    """The operations among `op_ids` that `node` itself holds (no multi-host URL)."""
    url = f"postgresql://postgres@127.0.0.1:{node.port}/{dbname}"
    with psycopg.connect(url, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT operation_id FROM operations WHERE operation_id = ANY(%s)", (op_ids,)
        ).fetchall()
    return {row[0] for row in rows}


def _in_recovery(node: Node) -> bool:
    url = f"postgresql://postgres@127.0.0.1:{node.port}/postgres"
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def _database_gauges(base: str) -> dict[str, float]:
    """The served process's intentledger_database_* gauges, as its /metrics
    answers them; retried while it cannot (no scrape reached a node yet)."""
    deadline = time.monotonic() + 20
    seen = ""
    while True:
        with contextlib.suppress(httpx.TransportError):
            answer = httpx.get(f"{base}/metrics", timeout=10)
            seen = f"{answer.status_code} {answer.text[:300]}"
            if answer.status_code == 200:
                gauges = {
                    sample.name: sample.value
                    for family in text_string_to_metric_families(answer.text)
                    for sample in family.samples
                    if sample.name.startswith("intentledger_database_")
                }
                if len(gauges) == 3:
                    return gauges
                seen = f"200, database gauges {gauges}"
        assert time.monotonic() < deadline, f"no database gauges on /metrics: {seen}"
        time.sleep(0.5)


def _assert_commits_wait_for_a_standby(gauges: dict[str, float], when: str) -> None:
    assert gauges["intentledger_database_commits_wait_for_standby"] == 1, (when, gauges)
    assert gauges["intentledger_database_synchronous_standbys"] >= 1, (when, gauges)


def _wait_for_acks(payers: list[Payer], since: float, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(len(p.acked_since(since)) for p in payers) < count:
        assert time.monotonic() < deadline, (
            f"fewer than {count} payments acknowledged in {timeout}s after the failover: "
            f"{[len(p.acked_since(since)) for p in payers]}, "
            f"failures {[p.failures for p in payers]}"
        )
        time.sleep(0.2)


def test_the_service_follows_the_primary_through_failovers(
    cluster: HACluster, tmp_path: Path
) -> None:
    cluster.create_database("ledger_ha")
    url = cluster.database_url("ledger_ha")
    migrated = run("migrate", "--database-url", url)
    assert migrated.returncode == 0, migrated.stderr
    auth = {"Authorization": f"Bearer {create_key(url, 'dora')}"}
    proc, base = serve(url, tmp_path, "24h", *RECOVER_SOON)
    threads = Threads()
    payers = [Payer(base, auth, f"ha-{i}") for i in range(2)]
    try:
        proc.wait_healthy(base + "/healthz", timeout=60)
        for payer in payers:
            threads.start(lambda payer=payer: payer.run(threads.stop))  # type: ignore[misc]
        _wait_for_acks(payers, 0, 20, 30)
        # What the service reports of its database, never seen on a real
        # cluster otherwise: commits wait for a standby, before and after each
        # failover, and the server's start time is another node's after it.
        gauges = _database_gauges(base)
        _assert_commits_wait_for_a_standby(gauges, "before the first kill")

        for mode in ("postmaster", "node"):
            # Commits wait for a standby before the kill, or the test proves nothing.
            assert cluster.sync_standbys(), f"no synchronous standby before the {mode} kill"
            killed_at = time.monotonic()
            old = cluster.kill_primary(mode)  # type: ignore[arg-type]
            new = cluster.wait_stable()
            stable_at = time.monotonic()
            assert new != old
            _wait_for_acks(payers, stable_at, ACKS_AFTER_FAILOVER, 60)
            started_before = gauges["intentledger_database_server_start_time_seconds"]
            gauges = _database_gauges(base)
            _assert_commits_wait_for_a_standby(gauges, f"after the {mode} kill")
            assert gauges["intentledger_database_server_start_time_seconds"] != started_before, (
                f"the service reports the same server start time after the {mode} kill: {gauges}"
            )
            # Still the primary: the acknowledgements counted above were its
            # commits; the old primary is back, and only as a standby.
            assert cluster.primary() == new, cluster.states()
            assert _in_recovery(old), f"{old.name} came back taking writes"
            after = [op for p in payers for op in p.acked_since(stable_at)]
            assert _present_on(new, after, "ledger_ha") == set(after)
            acked_at = sorted(at for p in payers for at, _ in p.acks)
            # The write outage the clients saw: the longest stretch without an
            # acknowledgement between the kill and the new primary's stability
            # (a request in flight at the kill may still be answered just after).
            outage = max(
                later - earlier
                for earlier, later in itertools.pairwise(acked_at)
                if later >= killed_at and earlier <= stable_at
            )
            print(
                f"{mode} kill: {cluster.failovers[-1]}; no acknowledgement for {outage:.1f}s; "
                f"acked before the kill {sum(1 for at in acked_at if at < killed_at)}, "
                f"after the new primary was stable {len(after)}; "
                f"503s so far {sum(p.unavailable for p in payers)}, "
                f"connection errors {sum(p.connection_errors for p in payers)}"
            )
            assert outage < 45, f"writes stopped for {outage:.1f}s in a tuned failover"
        threads.stop.set()
        threads.join()
        assert not [f for p in payers for f in p.failures], [p.failures for p in payers]
        acked = [op for p in payers for _, op in p.acks]
        assert len(acked) == len(set(acked)), "one idempotency key answered with two operations"
        assert _present_on(cluster.primary(), acked, "ledger_ha") == set(acked)
        # Read back through the service on the multi-host URL, and settled by
        # its workers, which resumed after both failovers. A SUBMITTING
        # committed just before a kill, whose answer could not be recorded, is
        # the sweeper's.
        pending = set(acked)
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=15, headers=auth) as client:
            while pending:
                states = {}
                for op in list(pending):
                    answer = client.get(f"{base}/v1/operations/{op}")
                    assert answer.status_code == 200, answer.text
                    states[op] = answer.json()
                    if states[op]["state"] == "OUTCOME_KNOWN":
                        pending.discard(op)
                assert time.monotonic() < deadline or not pending, (
                    f"{len(pending)} never settled: "
                    f"{[(states[op]['idempotency_key'], states[op]['state']) for op in pending]}; "
                    f"acked per client {[len(p.acks) for p in payers]}"
                )
                time.sleep(0.2)
    finally:
        threads.stop.set()
        try:
            threads.join()
        finally:
            proc.stop()

    # A service started now, with the standbys listed first: its connections
    # still reach the primary, and only the primary takes its writes.
    proc, base = serve(cluster.database_url("ledger_ha", primary_last=True), tmp_path, "24h")
    try:
        proc.wait_healthy(base + "/healthz", timeout=60)
        later = Payer(base, auth, "ha-restarted")
        give_up = threading.Timer(30, (gave_up := threading.Event()).set)
        give_up.start()
        with httpx.Client(timeout=15) as client:
            for n in range(20):
                later.pay(client, f"ha-restarted-{n}", gave_up)
        give_up.cancel()
        fresh = [op for _, op in later.acks]
        assert len(fresh) == 20, f"{len(fresh)} acknowledged, {later.unavailable} answered 503"
        assert later.failures == [] and later.unavailable == 0, (later.failures, later.unavailable)
        assert _present_on(cluster.primary(), fresh, "ledger_ha") == set(fresh)
    finally:
        proc.stop()


# -- the harness can see a loss ------------------------------------------------------------


@dataclass
class Writer:
    """Inserts rows one per autocommit transaction through the multi-host URL
    and keeps the ids whose commit was acknowledged; a failed commit is never
    counted, and the next row gets a new id."""

    url: str
    acked: list[int] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        ids = itertools.count(1)
        while not stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    while not stop.is_set():
                        row = next(ids)
                        conn.execute("INSERT INTO acked (id) VALUES (%s)", (row,))
                        self.acked.append(row)
            except psycopg.OperationalError:
                time.sleep(0.1)


def _rows_lost_when_the_machine_dies(cluster: HACluster, dbname: str) -> tuple[int, int]:
    """(acknowledged, lost) for commits made while the primary's walsenders are
    frozen, then the primary's whole node killed."""
    cluster.create_database(dbname)
    url = cluster.database_url(dbname)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE acked (id bigint PRIMARY KEY)")
    writer = Writer(url)
    threads = Threads()
    try:
        threads.start(lambda: writer.run(threads.stop))
        time.sleep(1.0)
        cluster.freeze_replication(2.0)
        time.sleep(0.7)
        cluster.kill_primary("node")
        cluster.wait_stable()
        before = len(writer.acked)
        deadline = time.monotonic() + 30
        while len(writer.acked) < before + 50:
            assert time.monotonic() < deadline, "no commits on the new primary"
            time.sleep(0.1)
    finally:
        threads.join()
    with psycopg.connect(url) as conn:
        present = {
            row[0]
            for row in conn.execute(
                "SELECT id FROM acked WHERE id = ANY(%s)", (writer.acked,)
            ).fetchall()
        }
    lost = len(set(writer.acked) - present)
    print(f"{dbname}: {len(writer.acked)} acknowledged, {lost} lost; {cluster.failovers[-1]}")
    return len(writer.acked), lost


def test_synchronous_replication_loses_no_acknowledged_commit(cluster: HACluster) -> None:
    acknowledged, lost = _rows_lost_when_the_machine_dies(cluster, "rows_sync")
    assert acknowledged > 100
    assert lost == 0


def test_asynchronous_replication_loses_acknowledged_commits_and_the_harness_sees_it() -> None:
    with _cluster(synchronous=False) as asynchronous:
        assert not asynchronous.sync_standbys()
        acknowledged, lost = _rows_lost_when_the_machine_dies(asynchronous, "rows_async")
        assert lost > 0, f"{acknowledged} acknowledged, none lost: the harness cannot see a loss"
    # A wait still running after stop() (a cancelled asyncio.to_thread) ends
    # at once, and starts no keeper.
    with pytest.raises(HAClusterError, match="the cluster was stopped"):
        asynchronous.wait_stable()


# -- what a sweep may kill and remove ------------------------------------------------------


def test_a_stale_record_kills_and_removes_only_what_is_a_clusters() -> None:
    """A registry record of a dead owner whose pids now belong to other
    processes (a keeper's process group, a stale postmaster.pid), or whose
    work directory is not one a cluster makes: the sweep kills and removes
    none of them, and drops the record."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    ours = Path(tempfile.mkdtemp(prefix="intentledger-ha-test."))
    pgdata = ours / "node1" / "pgdata"
    pgdata.mkdir(parents=True)
    foreign = Path(tempfile.mkdtemp(prefix="someone-else."))
    # The pids a reused postmaster.pid and keeper pgid now name: another
    # server's postgres (elsewhere), and a process group not pg_autoctl's.
    bystanders = [
        subprocess.Popen(["postgres", "60"], executable="sleep", cwd="/", start_new_session=True),
        subprocess.Popen(["sleep", "60"], start_new_session=True),
    ]
    try:
        (pgdata / "postmaster.pid").write_text(f"{bystanders[0].pid}\n{pgdata}\n")
        records = {
            "stale": {"workdir": str(ours), "process_groups": [bystanders[1].pid]},
            "foreign": {"workdir": str(foreign), "process_groups": []},
        }
        sweep_stale_clusters()  # creates the registry
        for name, record in records.items():
            path = REGISTRY / f"{ended.pid}-test-{name}.json"
            path.write_text(json.dumps({"owner": ended.pid, **record}))
        swept = sweep_stale_clusters()
        assert swept == [str(ours)], swept
        assert not ours.exists() and foreign.is_dir()
        assert [p.poll() for p in bystanders] == [None, None], "a sweep killed a bystander"
        assert not list(REGISTRY.glob(f"{ended.pid}-test-*.json"))
        assert REGISTRY.stat().st_mode & 0o777 == 0o700
        assert REGISTRY.stat().st_uid == os.geteuid()
    finally:
        for process in bystanders:
            process.kill()
            process.wait()
        shutil.rmtree(ours, ignore_errors=True)
        shutil.rmtree(foreign, ignore_errors=True)
