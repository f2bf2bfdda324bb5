"""`intentledger serve` with its workers and sandbox, as a fixture (registered in conftest)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from intentledger.ports import free_port
from tests.support import Process
from tests.test_intake_http import create_key


@dataclass
class Served:
    url: str
    database_url: str
    auth: dict[str, str]
    operator_auth: dict[str, str]

    def pay(self, method: str, key: str) -> str:
        response = httpx.post(
            f"{self.url}/v1/payments",
            json={"amount": 990, "currency": "EUR", "payment_method": method},
            headers={**self.auth, "Idempotency-Key": key},
        )
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def operation(self, op_id: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(
            f"{self.url}/v1/operations/{op_id}", headers=self.auth
        ).json()
        return body

    def events(self, op_id: str) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = httpx.get(
            f"{self.url}/v1/operations/{op_id}/events", headers=self.auth
        ).json()["data"]
        return data

    def charges(self, op_id: str) -> int:
        return len(
            httpx.get(f"{self.url}/_sandbox/charges", params={"reference": op_id}).json()["data"]
        )

    def settle(self, op_id: str, states: set[str], timeout: float = 40) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (op := self.operation(op_id))["state"] not in states:
            assert time.monotonic() < deadline, (
                f"{op_id} stuck in {op['state']}: {self.events(op_id)}"
            )
            time.sleep(0.2)
        return op


def serve(database_url: str, workdir: Path, retention: str, *extra: str) -> tuple[Process, str]:
    """`intentledger serve` with workers and sandbox; `extra` flags come last
    (a flag given twice takes its last value)."""
    port = free_port()
    proc = Process(
        [
            "serve",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--sandbox-database",
            str(workdir / f"sandbox-{retention}.db"),
            "--submit-timeout",
            "1500ms",
            "--sync-timeout",
            "1500ms",
            "--recheck-backoff",
            "1s",
            "--sandbox-key-retention",
            retention,
            *extra,
        ],
        {},
        workdir / f"serve-{retention}.log",
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def served(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    retention = getattr(request, "param", "24h")
    proc, url = serve(database_url, tmp_path, retention)
    try:
        proc.wait_healthy(url + "/healthz")
        yield Served(
            url,
            database_url,
            {"Authorization": f"Bearer {create_key(database_url, 'dora')}"},
            {"Authorization": f"Bearer {create_key(database_url, 'olive', operator=True)}"},
        )
    finally:
        proc.stop()
