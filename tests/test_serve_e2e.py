"""`intentledger serve` as a user runs it: API, workers and the mounted sandbox."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from intentledger.ports import free_port
from tests.support import INTENTLEDGER, Process
from tests.test_intake_http import create_key


@pytest.fixture
def served(database_url: str, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    port = free_port()
    proc = Process(
        [
            "serve",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--sandbox-database",
            str(tmp_path / "sandbox.db"),
            "--submit-timeout",
            "1s",
        ],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_healthy(url + "/healthz")
        yield url, {"Authorization": f"Bearer {create_key(database_url, 'carol')}"}
    finally:
        proc.stop()


def settle(
    url: str, headers: dict[str, str], operation_id: str, states: set[str]
) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        body: dict[str, Any] = httpx.get(
            f"{url}/v1/operations/{operation_id}", headers=headers
        ).json()
        if body["state"] in states:
            return body
        assert time.monotonic() < deadline, f"{operation_id} stuck in {body['state']}"
        time.sleep(0.1)


def test_serve_moves_payments_through_its_own_sandbox(served: tuple[str, dict[str, str]]) -> None:
    url, auth = served
    created = {}
    for method in ("pm_ok", "pm_declined", "pm_timeout_after_execute"):
        response = httpx.post(
            f"{url}/v1/payments",
            json={"amount": 700, "currency": "GBP", "payment_method": method},
            headers={**auth, "Idempotency-Key": f"e2e-{method}"},
        )
        assert response.status_code == 202, response.text
        created[method] = response.json()["id"]

    ok = settle(url, auth, created["pm_ok"], {"OUTCOME_KNOWN"})
    declined = settle(url, auth, created["pm_declined"], {"OUTCOME_KNOWN"})
    lost = settle(url, auth, created["pm_timeout_after_execute"], {"UNKNOWN"})
    assert ok["outcome"] == "succeeded" and ok["attempts"][0]["http_status"] == 200
    assert declined["outcome"] == "failed" and declined["attempts"][0]["http_status"] == 402
    assert lost["outcome"] is None and lost["next_action"] == "reconcile"
    assert lost["attempts"][0]["transport_result"] == "no_response"

    truth = httpx.get(f"{url}/_sandbox/charges").json()["data"]
    assert sorted(c["reference"] for c in truth) == sorted(
        [created["pm_ok"], created["pm_timeout_after_execute"]]
    )
    events = httpx.get(
        f"{url}/v1/operations/{created['pm_timeout_after_execute']}/events", headers=auth
    ).json()["data"]
    assert [e["type"] for e in events] == ["transition", "transition", "observation", "transition"]
    assert [e.get("to_state") for e in events if e["type"] == "transition"] == [
        "ACCEPTED",
        "SUBMITTING",
        "UNKNOWN",
    ]
    assert events[2]["error_class"] == "aiohttp.SocketTimeoutError"
    assert all(events[i]["at"] <= events[i + 1]["at"] for i in range(len(events) - 1))


def test_serve_refuses_an_unmigrated_database(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *INTENTLEDGER,
            "serve",
            "--port",
            str(free_port()),
            "--database-url",
            f"sqlite:///{tmp_path / 'empty.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "intentledger migrate" in done.stderr
