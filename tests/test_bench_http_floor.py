"""Intake's HTTP floor (bench/http_floor.py, issue 39): a real process on our server
stack, called over loopback, answering as a new intent is answered and no sooner
than it is told to."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import orjson
import pytest

from intentledger.ports import free_port
from intentledger_tools.bench.http_floor import HEALTHZ, answer_body
from tests.support import serving_module

MODULE = "intentledger_tools.bench.http_floor"


def running_floor(tmp_path: Path, *options: str) -> AbstractContextManager[str]:
    return serving_module(MODULE, tmp_path / "http-floor.log", HEALTHZ, *options)


def test_the_answer_is_json_of_exactly_the_asked_size() -> None:
    for size in (13, 100, 587):
        body = answer_body(size)
        assert len(body) == size
        assert set(orjson.loads(body)) == {"filler"}
    with pytest.raises(ValueError, match="at least 13 bytes"):
        answer_body(12)


def test_a_payment_request_is_answered_202_as_an_intent_after_the_delay(
    tmp_path: Path,
) -> None:
    with (
        running_floor(tmp_path, "--delay-ms", "1500", "--answer-bytes", "321") as url,
        httpx.Client(base_url=url, timeout=10) as client,
    ):
        started = time.monotonic()
        answer = client.post(
            "/v1/payments",
            json={"amount": 1250, "currency": "EUR", "payment_method": "pm_ok"},
            headers={"Authorization": "Bearer x", "Idempotency-Key": "k-1"},
        )
        took = time.monotonic() - started
        assert answer.status_code == 202
        assert len(answer.content) == 321
        assert answer.headers["content-type"] == "application/json"
        # Less the loop's timer granularity (libuv's clock counts whole milliseconds).
        assert took >= 1.5 - 0.005
        # The kept-alive connection is answered again, health without the wait.
        started = time.monotonic()
        assert client.get(HEALTHZ).status_code == 200
        assert time.monotonic() - started < 1.0


def test_bad_options_are_refused_before_serving(tmp_path: Path) -> None:
    for options, says in (
        (["--delay-ms", "-1"], "--delay-ms cannot be negative"),
        (["--answer-bytes", "3"], "at least 13 bytes"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", MODULE, "--port", str(free_port()), *options],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done
        assert says in done.stderr
