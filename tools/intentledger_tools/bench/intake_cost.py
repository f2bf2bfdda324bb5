"""Intake's own Python: the CPU an API process spends on a payment intent with no
server and no database around it (issue 39).

python -m intentledger_tools.bench.intake_cost [--intents N] [--concurrency C]

Intake's HTTP floor (bench/http_floor.py) is what serving a request costs with
none of our code on the path. This is the other part, alone: the intake route
(`api/app.py: LedgerApp`) called as uvicorn calls it, with a request's scope,
`receive` and `send`. It runs the edge's checks, takes the principal from its
cache, parses strictly, validates and hashes, then the group committer takes
the intent and the answer is written. The group's statement answers at once,
as if PostgreSQL had committed. C intents are sent at a time, so the committer
forms groups of up to C.

Left out: the statement's round trip through psycopg (its parameters are
made, as the real statement makes them), and everything the floor counts.
The same calls made to an app that answers 202 at once give the driver's
own cost, which is subtracted. Unlike the bench's phases, nothing
of the bench runs beside it (whatever else the machine does still may), so
its figure is lower than the API's share of a loaded machine; it is for
comparing the code with itself, in seconds rather than a bench run.

Every intent must be answered 202 with a new operation, or the run fails. The
result is one line, `intake_cost {json}`: intents, concurrency, and the CPU
of each run (`time.process_time()`): the route's and the driver's in
microseconds an intent, and the route's less the driver's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

import uvloop
from sqlalchemy.ext.asyncio import create_async_engine

from intentledger.api.app import PAYMENTS_PATH, create_api
from intentledger.engine.api_keys import Principal, hash_token
from intentledger.engine.clock import system_clock
from intentledger.engine.group_intake import IntakeGroups
from intentledger.store.intake import Accepted, accept_group_parameters
from intentledger.web.auth import PrincipalCache
from intentledger_tools.bench.capture import BENCH_ACTOR, payment_body

RESULT_PREFIX = "intake_cost "
TOKEN = "il_" + "t" * 43  # the shape of a real token (engine/api_keys.py)
# The body the intake phase's wrk script sends (bench/runner.py).
PAYMENT = json.dumps({k: v for k, v in payment_body("pm_ok").items() if k != "metadata"}).encode()
WARM_UP = 2_000

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class CommittedAtOnce:
    """The group statement (store/group_statement.py) as if every key were new
    and PostgreSQL answered without delay: the statement's parameters made as
    it makes them (our code, in the API process), one turn of the loop, then
    every operation claimed."""

    async def accept_group(
        self, accepted: Sequence[Accepted], reason: str, now: datetime
    ) -> set[str]:
        accept_group_parameters(accepted, reason, now)
        await asyncio.sleep(0)
        return {str(values["operation_id"]) for values, _source in accepted}

    async def close(self) -> None:
        return None


def intake_app() -> App:
    """The API as `intentledger serve` builds it, its principal cache holding
    `TOKEN` and its committer's statement `CommittedAtOnce`. The engine is never
    asked: nothing on the path reads the database."""
    engine = create_async_engine("sqlite+aiosqlite:///:memory:")
    groups = IntakeGroups(engine, system_clock, group_statement=CommittedAtOnce())  # type: ignore[arg-type]
    app = create_api(engine, system_clock, "sandbox", intake_groups=groups)
    cache = PrincipalCache()
    cache.put(hash_token(TOKEN), Principal(actor=BENCH_ACTOR, is_operator=False))
    app.state.principal_cache = cache
    return app


async def answered_at_once(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The driver's own cost: the body read, 202 and a body sent."""
    await receive()
    await send({"type": "http.response.start", "status": 202, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def drive(
    app: App, intents: int, concurrency: int, body: bytes, first_key: int
) -> Counter[int]:
    """`intents` requests to `app`, `concurrency` at a time; their statuses."""
    statuses: Counter[int] = Counter()

    async def one(key: int) -> None:
        head = [
            (b"host", b"127.0.0.1:8000"),
            (b"authorization", b"Bearer " + TOKEN.encode()),
            (b"content-type", b"application/json"),
            (b"idempotency-key", f"intake-cost-{key}".encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 50000),
            "scheme": "http",
            "method": "POST",
            "root_path": "",
            "path": PAYMENTS_PATH,
            "raw_path": PAYMENTS_PATH.encode(),
            "query_string": b"",
            "headers": head,
        }
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:  # nothing reads twice; a disconnect is what would come
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses[message["status"]] += 1

        await app(scope, receive, send)

    for start in range(first_key, first_key + intents, concurrency):
        end = min(start + concurrency, first_key + intents)
        await asyncio.gather(*(one(key) for key in range(start, end)))
    return statuses


async def timed(
    app: App, intents: int, concurrency: int, body: bytes
) -> tuple[float, Counter[int]]:
    await drive(app, WARM_UP, concurrency, body, first_key=10**9)
    started = time.process_time()
    statuses = await drive(app, intents, concurrency, body, first_key=0)
    return time.process_time() - started, statuses


def measure(intents: int, concurrency: int, body: bytes | None = None) -> dict[str, Any]:
    """Both runs on uvloop, as `intentledger serve` runs the API; raises unless
    every intent was accepted."""
    payload = PAYMENT if body is None else body

    async def both() -> dict[str, Any]:
        route_seconds, statuses = await timed(intake_app(), intents, concurrency, payload)
        if statuses != Counter({202: intents}):
            raise RuntimeError(
                f"intake did not accept every intent ({dict(statuses)}): "
                "the timing would not be of its path"
            )
        driver_seconds, _ = await timed(answered_at_once, intents, concurrency, payload)
        route_us = route_seconds / intents * 1e6
        driver_us = driver_seconds / intents * 1e6
        return {
            "intents": intents,
            "concurrency": concurrency,
            "route_cpu_seconds": round(route_seconds, 4),
            "driver_cpu_seconds": round(driver_seconds, 4),
            "route_us_per_intent": round(route_us, 2),
            "driver_us_per_intent": round(driver_us, 2),
            "own_us_per_intent": round(route_us - driver_us, 2),
        }

    return uvloop.run(both())


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--intents", type=_positive, default=20_000)
    parser.add_argument("--concurrency", type=_positive, default=8)
    options = parser.parse_args(argv)
    print(RESULT_PREFIX + json.dumps(measure(options.intents, options.concurrency)), flush=True)


if __name__ == "__main__":
    main()
