"""Intake's HTTP floor: what an API process's server stack costs in CPU to take a
payment request and answer it, with none of intentledger's code on the path
(issue 39).

python -m intentledger_tools.bench.http_floor --port P --delay-ms D --answer-bytes N

Served as `intentledger serve` serves (`intentledger.eventloop.serve`: uvicorn,
httptools, uvloop, and `intentledger.http_server.server_options`: the guarded
protocol with its one write per response). The app reads the whole body,
waits D milliseconds and answers 202 with N bytes of JSON and the two headers
of a new intent's answer (`api/app.py: AcceptedIntent`); `GET /healthz` is
200 at once. Nothing is parsed, validated, hashed, grouped or stored.

The wait is intake's: the bench passes its rounds' median latency, and
measures the floor answering at once beside it. An answer that comes at once
reaches a client still busy with its last one; one that comes milliseconds
later, as ours do after their group's commit, reaches a client that may have
gone to sleep, and the loop wakes for fewer requests at a time. The floor
keeps a timer a request for its wait, which intake's path does not: a few
microseconds against it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import orjson

from intentledger import eventloop
from intentledger.http_server import server_options

HEALTHZ = "/healthz"
# `intentledger serve`'s defaults (settings.py: header_timeout, max_connections).
HEADER_TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 1000


def answer_body(size: int) -> bytes:
    """A JSON object of exactly `size` bytes (13 at least: `{"filler":""}`)."""
    empty = orjson.dumps({"filler": ""})
    if size < len(empty):
        raise ValueError(f"an answer has at least {len(empty)} bytes, not {size}")
    return orjson.dumps({"filler": "x" * (size - len(empty))})


def floor_app(delay_seconds: float, body: bytes) -> Any:
    """The ASGI app: every request but `GET /healthz` is read whole, waits
    `delay_seconds`, and gets 202 and `body`."""
    head = [
        (b"content-length", str(len(body)).encode("latin-1")),
        (b"content-type", b"application/json"),
    ]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; nothing else reaches an HTTP server
        if scope["method"] == "GET" and scope["path"] == HEALTHZ:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        if delay_seconds > 0:
            await asyncio.sleep(delay_seconds)
        await send({"type": "http.response.start", "status": 202, "headers": head})
        await send({"type": "http.response.body", "body": body})

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="how long each answer waits (intake's latency)"
    )
    parser.add_argument(
        "--answer-bytes",
        type=int,
        # A new payment intent's answer on 5 December; the bench passes the one it asks for.
        default=936,
        help="the answer's body, as long as an intent's",
    )
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms cannot be negative")
    try:
        body = answer_body(args.answer_bytes)
    except ValueError as exc:
        parser.error(str(exc))
    # Frozen as `intentledger serve` freezes its start.
    eventloop.freeze_what_starts_with_the_process()
    eventloop.serve(
        floor_app(args.delay_ms / 1000, body),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        log_config=None,
        lifespan="off",
        **server_options(HEADER_TIMEOUT_SECONDS, MAX_CONNECTIONS),
    )


if __name__ == "__main__":
    main()
