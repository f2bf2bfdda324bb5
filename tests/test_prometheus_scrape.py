"""A real Prometheus scrapes a real `serve` (API, its own sandbox, no workers)
and a separate `worker` (its --metrics-port), on PostgreSQL; PromQL over
Prometheus's HTTP API then sees the UNKNOWN operations the ledger holds and the
worker's provider latency histogram."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from intentledger.ports import free_port
from tests.conftest import BACKENDS, Databases
from tests.served import Served, serve
from tests.support import Process, wait_until
from tests.test_intake_http import create_key

FIRST_SAMPLE_TIMEOUT = 40.0


@pytest.fixture
def postgres_url(databases: Databases) -> str:
    if "postgresql" not in BACKENDS:
        pytest.skip("INTENTLEDGER_TEST_BACKENDS leaves PostgreSQL out on purpose")
    return databases.create("postgresql")


@pytest.fixture
def prometheus_binary() -> str:
    found = shutil.which("prometheus") or "/usr/bin/prometheus"
    # Missing is a failure, not a skip: scripts/ensure-test-tools installs it.
    assert Path(found).exists(), "prometheus is missing: run scripts/ensure-test-tools"
    return found


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]) -> None:
        config = workdir / "prometheus.yml"
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            for job, target in targets.items()
        )
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n" + jobs
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def query(self, promql: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        answer.raise_for_status()
        body = answer.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, expected: float) -> list[dict[str, Any]]:
        """Poll until the query's one value equals `expected` (the first sample
        lands only some seconds after start)."""
        deadline = time.monotonic() + FIRST_SAMPLE_TIMEOUT
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, self.log.read_text()
            try:
                result = self.query(promql)
            except httpx.HTTPError:
                result = []
            if result and float(result[0]["value"][1]) == expected:
                return result
            time.sleep(0.5)
        raise AssertionError(f"{promql} never became {expected}: last {result}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


@pytest.fixture
def scraped_service(
    postgres_url: str, tmp_path: Path, prometheus_binary: str
) -> Iterator[tuple[Served, Prometheus]]:
    # A long recheck backoff: an UNKNOWN operation stays UNKNOWN while we look.
    api, url = serve(postgres_url, tmp_path, "24h", "--no-workers", "--recheck-backoff", "10m")
    metrics_port = free_port()
    worker = Process(
        [
            "worker",
            "--database-url",
            postgres_url,
            "--provider-url",
            f"{url}/_sandbox",
            # Long enough that an answered call on a loaded machine is not taken
            # for a lost one (a pm_ok once took 1.09 s under make test's load and
            # went UNKNOWN for the ten minutes below).
            "--submit-timeout",
            "2s",
            "--recheck-backoff",
            "10m",
            "--poll-interval",
            "50ms",
            "--metrics-port",
            str(metrics_port),
        ],
        {},
        tmp_path / "worker.log",
    )
    prometheus: Prometheus | None = None
    try:
        api.wait_healthy(url + "/healthz")
        worker.wait_healthy(f"http://127.0.0.1:{metrics_port}/metrics")
        prometheus = Prometheus(
            prometheus_binary,
            tmp_path,
            {"api": url.removeprefix("http://"), "worker": f"127.0.0.1:{metrics_port}"},
        )
        served = Served(
            url,
            postgres_url,
            {"Authorization": f"Bearer {create_key(postgres_url, 'pia')}"},
            {"Authorization": f"Bearer {create_key(postgres_url, 'otto', operator=True)}"},
        )
        yield served, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        worker.stop()
        api.stop()


def test_prometheus_sees_unknown_operations_and_provider_latency(
    scraped_service: tuple[Served, Prometheus],
) -> None:
    served, prometheus = scraped_service
    settled = [served.pay("pm_ok", f"ok-{n}") for n in range(3)]
    lost = [served.pay("pm_blackhole", f"lost-{n}") for n in range(2)]
    lost.append(served.pay("pm_timeout_after_execute", "lost-after-execute"))
    for op_id in settled:
        served.settle(op_id, {"OUTCOME_KNOWN"})
    for op_id in lost:
        served.settle(op_id, {"UNKNOWN"})

    # The ledger's gauge, from the API's /metrics: exactly the three lost answers.
    prometheus.wait_for('sum(intentledger_operations{job="api",state="UNKNOWN"})', 3)
    # The worker made every call: its histogram, by verdict, has all six submits.
    prometheus.wait_for(
        'sum(intentledger_provider_call_seconds_count{job="worker",call="submit"})', 6
    )
    succeeded = prometheus.query(
        'intentledger_provider_call_seconds_count{job="worker",call="submit",verdict="succeeded"}'
    )
    assert [float(s["value"][1]) for s in succeeded] == [3]
    buckets = prometheus.query(
        'sum by (le) (intentledger_provider_call_seconds_bucket{job="worker",call="submit"})'
    )
    counts = {float(sample["metric"]["le"]): float(sample["value"][1]) for sample in buckets}
    assert counts[float("inf")] == 6
    # The three lost answers waited out the 2 s timeout, so no bucket under it
    # holds them; every call ended in a bucket not far past it.
    assert counts[1.0] <= 3 and counts[5.0] == 6
    transitions = prometheus.query(
        'sum(intentledger_transitions_total{job="worker",to_state="UNKNOWN"})'
    )
    assert float(transitions[0]["value"][1]) == 3
    wait_until(lambda: prometheus.popen.poll() is None, 1, "prometheus to keep running")
