"""A provider stand-in for the dispatch and latency-bound phases: the sandbox's
charge API and nothing else, as cheap per call as an answer can be (issue 39).

python -m intentledger_tools.bench.stand_in --port P --delay-seconds 0.2 [--hang-share 0.05]

The sandbox keeps every charge in SQLite and logs every request, which on two
shared cores is CPU the bench then counts against us. This stand-in answers
what the worker's sandbox adapter (`providers/sandbox_client.py`) sends and
reads, under the same `/_sandbox` prefix:

- `POST /v1/charges` with an `Idempotency-Key`: 200 and the charge (its `id`
  is the provider reference the adapter records), after `--delay-seconds`.
  A key seen before gets the same charge again, so a resent submit never
  makes a second one; a key reused with another body is not detected (the
  sandbox's job, not the bench's). No key: 400, as the sandbox answers.
- `GET /v1/charges?reference=R`: the charges made under that reference, for
  a payment that went UNKNOWN and is reconciled.
- `GET /healthz`, and `GET /stand-in/calls`: the charge submits answered so
  far (and those left hanging), for the bench's CPU per call.
- `GET /stand-in/hung`: the references of the submits left hanging.
- `POST /stand-in/merchant-webhooks`: a merchant's webhook endpoint, which
  takes (200) and counts every event delivered to it (`GET /stand-in/calls`
  says how many).

Every charge succeeds: the phases pay with methods that do. With
`--hang-share S` (the record-delay phase's mixed provider), a share S of the
keys is never answered: the request is held, its connection open, until the
client gives up and hangs up, and no charge is made (a lookup by its
reference finds nothing). Which keys hang is a hash of the key (CRC-32), so a
key hangs on every run and on every resend: the same payments hang however
often the phase runs, and a resend cannot turn a hanging payment into a fast
one.

A hand-written HTTP/1.1 responder on an asyncio Protocol rather than aiohttp's
low-level server: the worker's client sends small keep-alive requests with a
Content-Length and never pipelines, so little parsing is needed, and it costs
less than half the CPU per call. Measured on this machine (2 cores, uvloop,
20,000 charges from 256 keep-alive connections of an aiohttp client, the
server's CPU from /proc/PID/schedstat, two runs each, alternated): aiohttp's
low-level server (`aiohttp.web.Server`, the same handling) 0.048 and 0.055 ms
per call, this responder 0.020 and 0.021; the sandbox itself 0.30 (5,000).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import zlib
from collections.abc import Sequence
from typing import cast
from urllib.parse import parse_qs, urlsplit

from intentledger import eventloop
from intentledger.service import SANDBOX_MOUNT

CHARGES = f"{SANDBOX_MOUNT}/v1/charges"
HEALTHZ = f"{SANDBOX_MOUNT}/healthz"
CALLS = f"{SANDBOX_MOUNT}/stand-in/calls"
HUNG = f"{SANDBOX_MOUNT}/stand-in/hung"
# A merchant's webhook endpoint, for the record-delay phase with news: every
# event delivered here is taken (200) and counted.
MERCHANT_WEBHOOKS = f"{SANDBOX_MOUNT}/stand-in/merchant-webhooks"
# A hanging share is chosen to a hundredth of a percent.
HANG_SCALE = 10_000
# A request head bigger than this is not the adapter's: the connection is closed.
MAX_HEAD_BYTES = 16_384


def response(status: int, body: bytes, keep_alive: bool) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    connection = b"keep-alive" if keep_alive else b"close"
    return (
        f"HTTP/1.1 {status} {reason}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: "
        + connection
        + b"\r\n\r\n"
        + body
    )


def error_body(code: str, message: str) -> bytes:
    error = {"type": "invalid_request_error", "code": code, "message": message}
    return json.dumps({"error": error}).encode()


NOT_FOUND = json.dumps({"error": {"type": "invalid_request_error", "code": "not_found"}}).encode()
NO_KEY = error_body("parameter_missing", "The Idempotency-Key header is required.")
BAD_BODY = error_body("parameter_invalid", "The body must be a JSON object.")


def hangs(key: str, share: float) -> bool:
    """Whether a submit under `key` is never answered, for a hanging `share` of keys."""
    return zlib.crc32(key.encode()) % HANG_SCALE < round(share * HANG_SCALE)


class Charges:
    """The charges answered so far, by idempotency key and by reference, and the
    references of the submits left hanging."""

    def __init__(self, delay_seconds: float, hang_share: float = 0.0) -> None:
        self.delay_seconds = delay_seconds
        self.hang_share = hang_share
        self.by_key: dict[str, bytes] = {}
        self.by_reference: dict[str, list[dict[str, object]]] = {}
        self.calls = 0
        self.hung: list[str] = []
        self.merchant_webhooks = 0

    def hang(self, key: str, body: bytes) -> bool:
        """True (and the submit noted) when this key's submit is left hanging."""
        if not self.hang_share or not hangs(key, self.hang_share):
            return False
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        reference = payload.get("reference", "") if isinstance(payload, dict) else ""
        self.hung.append(str(reference))
        return True

    def submit(self, key: str, body: bytes) -> tuple[int, bytes]:
        self.calls += 1
        known = self.by_key.get(key)
        if known is not None:
            return 200, known
        try:
            payload = json.loads(body)
        except ValueError:
            return 400, BAD_BODY
        if not isinstance(payload, dict):
            return 400, BAD_BODY
        reference = str(payload.get("reference", ""))
        charge = {
            "id": f"ch_stand_in_{len(self.by_key) + 1:012d}",
            "reference": reference,
            "status": "succeeded",
            "amount": payload.get("amount"),
            "currency": payload.get("currency"),
        }
        answer = json.dumps(charge).encode()
        self.by_key[key] = answer
        self.by_reference.setdefault(reference, []).append({**charge, "idempotency_key": key})
        return 200, answer

    def lookup(self, target: str) -> bytes:
        reference = parse_qs(urlsplit(target).query).get("reference", [""])[0]
        return json.dumps({"data": self.by_reference.get(reference, [])}).encode()


class Responder(asyncio.Protocol):
    """One keep-alive connection: requests parsed as they arrive, each answered
    (a charge after the delay) in the order they came."""

    def __init__(self, charges: Charges) -> None:
        self.charges = charges
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self.transport.close()
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, target, *_ = [*head[0].split(" "), "", ""]
            keep_alive = headers.get("connection", "").lower() != "close"
            self.answer(method, target, headers.get("idempotency-key"), body, keep_alive)

    def answer(
        self, method: str, target: str, key: str | None, body: bytes, keep_alive: bool
    ) -> None:
        path = target.split("?", 1)[0]
        delay = 0.0
        if method == "POST" and path == CHARGES:
            if key and self.charges.hang(key, body):
                # No answer, ever: the client's timeout ends the call by hanging up.
                return
            if key:
                status, payload = self.charges.submit(key, body)
                delay = self.charges.delay_seconds
            else:
                status, payload = 400, NO_KEY
        elif method == "GET" and path == CHARGES:
            status, payload = 200, self.charges.lookup(target)
        elif method == "GET" and path == HEALTHZ:
            status, payload = 200, b'{"status":"ok"}'
        elif method == "POST" and path == MERCHANT_WEBHOOKS:
            self.charges.merchant_webhooks += 1
            status, payload = 200, b"{}"
        elif method == "GET" and path == CALLS:
            counts = {
                "calls": self.charges.calls,
                "hung": len(self.charges.hung),
                "merchant_webhooks": self.charges.merchant_webhooks,
            }
            status, payload = 200, json.dumps(counts).encode()
        elif method == "GET" and path == HUNG:
            status, payload = 200, json.dumps({"references": self.charges.hung}).encode()
        else:
            status, payload = 404, NOT_FOUND
        reply = response(status, payload, keep_alive)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.send, reply, keep_alive)
        else:
            self.send(reply, keep_alive)

    def send(self, reply: bytes, keep_alive: bool) -> None:
        # A client that hung up during the delay gets nothing, as from a provider.
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(reply)
        if not keep_alive:
            self.transport.close()


async def serve(port: int, delay_seconds: float, hang_share: float = 0.0) -> None:
    charges = Charges(delay_seconds, hang_share)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Responder(charges), "127.0.0.1", port, backlog=1024, reuse_address=True
    )
    stopped = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    print(
        f"stand-in answering on 127.0.0.1:{port} after {delay_seconds}s, "
        f"leaving a share of {hang_share} unanswered",
        flush=True,
    )
    async with server:
        await stopped.wait()


async def until_answering(port: int) -> None:
    """Wait for a stand-in started on `port` to take connections (ten seconds at most)."""
    for _ in range(1000):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        writer.close()
        return
    raise RuntimeError(f"the stand-in on port {port} does not answer")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-seconds", type=float, default=0.0)
    parser.add_argument(
        "--hang-share",
        type=float,
        default=0.0,
        help="the share of charge submits (0 to 1, chosen by their key) never answered",
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.hang_share <= 1.0:
        parser.error("--hang-share must be from 0 to 1")
    eventloop.run(serve(args.port, args.delay_seconds, args.hang_share))


if __name__ == "__main__":
    main()
