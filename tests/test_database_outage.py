"""The database going away (issue 13, defect 8), with real processes and a real
PostgreSQL server: a restart under load is 2xx or 503 (never 500), a client
that retries with its key loses and duplicates nothing, and `serve` and `worker`
started while the database is down wait for it instead of exiting."""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from intentledger.ports import free_port
from intentledger.store.database import create_sync_engine
from intentledger.store.tables import operations
from tests.conftest import BACKENDS, Databases
from tests.support import Forwarder, Process, wait_until
from tests.test_intake_http import PAYMENT, create_key

pytestmark = [
    pytest.mark.skipif(
        "postgresql" not in BACKENDS, reason="INTENTLEDGER_TEST_BACKENDS excludes PostgreSQL"
    ),
    pytest.mark.alone,  # restarts the shared server
]
RESTART = "INTENTLEDGER_TEST_POSTGRES_RESTART"


def test_a_database_restart_under_load_is_2xx_or_503_and_loses_nothing(
    databases: Databases, tmp_path: Path
) -> None:
    database_url = databases.create("postgresql")
    token = create_key(database_url, "rita")
    port = free_port()
    api = Process(
        ["serve", "--no-workers", "--port", str(port), "--database-url", database_url],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    statuses: Counter[int] = Counter()
    finished: dict[str, int] = {}
    restarted = threading.Event()
    stop = threading.Event()

    def client(name: str) -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            number = 0
            while not stop.is_set():
                key = f"{name}-{number}"
                number += 1
                for _ in range(200):  # the same key until an answer that is not 503
                    try:
                        response = http.post(
                            "/v1/payments",
                            json=PAYMENT,
                            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
                        )
                    except httpx.TransportError:
                        time.sleep(0.1)
                        continue
                    statuses[response.status_code] += 1
                    if response.status_code != 503:
                        finished[key] = response.status_code
                        break
                    assert response.headers["retry-after"] == "1"
                    time.sleep(0.1)
                else:
                    raise AssertionError(f"{key} never got past 503")

    try:
        api.wait_healthy(url + "/healthz")
        clients = [threading.Thread(target=client, args=(f"c{i}",)) for i in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(1.0)
        subprocess.run(shlex.split(os.environ[RESTART]), check=True, timeout=120)
        restarted.set()
        wait_until(lambda: httpx.get(url + "/healthz").status_code == 200, 60, "healthz")
        time.sleep(1.0)
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    finally:
        stop.set()
        api.stop()
    assert set(statuses) <= {200, 202, 503}, statuses
    assert set(finished.values()) <= {200, 202}
    engine = create_sync_engine(database_url)
    try:
        with engine.connect() as conn:
            count = conn.execute(
                select(func.count(func.distinct(operations.c.idempotency_key)))
            ).scalar_one()
            rows = conn.execute(select(func.count()).select_from(operations)).scalar_one()
    finally:
        engine.dispose()
    assert count == rows == len(finished), (count, rows, len(finished))
    print(f"answers during the restart: {dict(statuses)}")


def test_serve_and_worker_started_while_the_database_is_down_wait_for_it(
    databases: Databases, tmp_path: Path
) -> None:
    real = make_url(databases.create("postgresql"))
    gateway = free_port()
    through = real.set(host="127.0.0.1", port=gateway).render_as_string(hide_password=False)
    forwarder = Forwarder(gateway, (real.host or "127.0.0.1", real.port or 5432))
    port = free_port()
    api = Process(
        ["serve", "--no-workers", "--port", str(port), "--database-url", through],
        {},
        tmp_path / "serve.log",
    )
    worker = Process(
        ["worker", "--database-url", through, "--provider-url", "http://127.0.0.1:9/_sandbox"],
        {},
        tmp_path / "worker.log",
    )
    try:
        wait_until(lambda: "trying again" in api.output(), 30, "serve to wait for the database")
        wait_until(lambda: "trying again" in worker.output(), 30, "the worker to wait too")
        assert api.popen.poll() is None and worker.popen.poll() is None
        forwarder.start()
        api.wait_healthy(f"http://127.0.0.1:{port}/healthz", timeout=60)
        wait_until(lambda: "started" in worker.output(), 60, "the worker to start")
        assert worker.popen.poll() is None
    finally:
        api.stop()
        worker.stop()
        forwarder.stop()
