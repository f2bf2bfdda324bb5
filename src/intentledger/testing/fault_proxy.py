"""The fault proxy: an HTTP proxy in front of a provider's fake that injects
the faults a real provider's network and servers produce, one drawn per write
from a queue or a seeded random mix.

    none          forwarded, answered
    rate_limited  429 with Retry-After, nothing forwarded
    error_before  500, nothing forwarded
    error_after   forwarded (executed upstream), then a 500 instead of its answer
    reset_after   forwarded, then the connection reset: no answer at all
    hold_after    forwarded, the answer held `hold_seconds` (past a client's timeout)
    refuse        the public port refuses new connections for `refuse_seconds`

The faults after forwarding are the ones that make an outcome unknown: the
provider did the work and the client cannot tell. Only the requests a
provider's proxy names (`is_faulted`: its writes) meet faults; reads stay
usable to find out what happened.

One proxy for every fake: a provider's proxy subclasses `FaultProxy` for its
error bodies and the writes it faults, and may take over the forwarding where
its fake needs more than a pass-through. The resets and refused ports are real
ones, on loopback sockets. The conformance kit's chaos check
(`intentledger.testing.chaos`) runs one in its own event loop; the project's
suite runs each as its own OS process, configured through a control port that
stays up while the public port refuses (`start(control_port)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import signal
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import aiohttp
from aiohttp import web

FAULTS = (
    "none",
    "rate_limited",
    "error_before",
    "error_after",
    "reset_after",
    "hold_after",
    "refuse",
)
# Executed upstream, and the answer lost, replaced or late: the outcome is unknown.
AFTER_FORWARDING = frozenset({"error_after", "reset_after", "hold_after"})
# How long a stopping proxy waits for the answers to what it forwarded.
FORWARDS_SETTLE_SECONDS = 3.0
ERROR_BEFORE_MESSAGE = "An error occurred before the request was executed (injected)."
ERROR_AFTER_MESSAGE = "An error occurred after the request was executed (injected)."


@dataclass
class FaultConfig:
    queue: list[str] = field(default_factory=list)
    mix: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    retry_after: float = 1.0
    hold_seconds: float = 30.0
    refuse_seconds: float = 0.5


@dataclass
class Answer:
    """An HTTP answer as the proxy passes it on (or keeps it, for a key)."""

    status: int
    body: bytes
    request_id: str
    content_type: str = "application/json"
    # The upstream's headers the proxy passes on (`forwarded_answer_headers`).
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class Aborted(Exception):
    """The client's connection was dropped on purpose; there is nothing to answer."""


def json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, indent=2, sort_keys=True).encode()


# Headers about one connection (RFC 9110 §7.6.1), or that the proxy sets itself
# for the body it sends on (and, on an answer, its Content-Type: `Answer`).
PER_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
    }
)


def _kept(
    headers: Mapping[str, str], names: tuple[str, ...] | None, dropped: frozenset[str] = PER_HOP
) -> dict[str, str]:
    if names is None:
        return {name: value for name, value in headers.items() if name.lower() not in dropped}
    return {name: headers[name] for name in names if name in headers}


def check_faults(names: Any) -> None:
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {list(FAULTS)}")


def abort_connection(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Zero linger turns the close into a TCP reset: the client sees the
        # connection dropped mid-request, with no HTTP answer at all.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class PublicListener:
    """The public port, which faults and tests can close (connections are then
    refused by the kernel) and reopen on the same port."""

    def __init__(self, port: int, protocol_factory: web.Server) -> None:
        self.port = port
        self._protocol_factory = protocol_factory
        self._server: asyncio.Server | None = None
        self._reopen: asyncio.TimerHandle | None = None

    @property
    def is_open(self) -> bool:
        return self._server is not None

    async def open(self) -> None:
        self._cancel_reopen()
        if self._server is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # The port was ours a moment ago; its old connections may sit in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol_factory, sock=sock)

    def close(self, *, busy_too: bool = True) -> None:
        self._cancel_reopen()
        if self._server is not None:
            self._server.close()
            self._server = None
        # The provider being unreachable also ends its open connections, or a
        # pooled client would keep talking to the "down" server: aborted,
        # because a graceful close leaves an idle keep-alive connection open
        # long enough for a client to send on it and wait for ever. With
        # `busy_too`, a request in progress (maybe forwarded) loses its answer as well.
        for connection in list(self._protocol_factory.connections):
            # aiohttp's handler marks a request being answered (a private slot).
            busy = getattr(connection, "_request_in_progress", False)
            if connection.transport is not None and (busy_too or not busy):
                connection.transport.abort()

    def close_for(self, seconds: float) -> None:
        """A short refusal window (the `refuse` fault): new connections are
        refused and idle ones dropped; requests other clients have in progress
        are answered."""
        self.close(busy_too=False)
        loop = asyncio.get_running_loop()
        self._reopen = loop.call_later(seconds, lambda: loop.create_task(self.open()))

    def _cancel_reopen(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None


class FaultProxy:
    """Forwards every request to `upstream` as it came; a write (`is_faulted`)
    meets a fault drawn from the queue, else from the seeded mix."""

    name = "fault proxy"
    # Request headers the upstream reads, and answer headers passed back to the
    # client; None: every one but the per-hop ones (`PER_HOP`).
    forwarded_request_headers: tuple[str, ...] | None = None
    forwarded_answer_headers: tuple[str, ...] | None = None

    def __init__(self, upstream: str, public_port: int) -> None:
        self.upstream = upstream.rstrip("/")
        self.public_port = public_port
        self.config = self.new_config()
        self.rng = random.Random(self.config.seed)
        self.log: list[dict[str, Any]] = []
        self.session: aiohttp.ClientSession | None = None
        self.listener: PublicListener | None = None
        self._runners: list[web.AppRunner] = []
        self._forwards: set[asyncio.Future[Answer]] = set()

    # -- what a provider's proxy says its own way ----------------------------

    def new_config(self) -> FaultConfig:
        return FaultConfig()

    def is_faulted(self, request: web.Request) -> bool:
        return request.method == "POST"

    def rate_limited(self, request_id: str) -> tuple[Answer, dict[str, str]]:
        payload = {"error": "Too many requests (injected)."}
        headers = {"Retry-After": f"{self.config.retry_after:g}"}
        return Answer(429, json_bytes(payload), request_id), headers

    def server_error(self, request_id: str, message: str) -> Answer:
        return Answer(500, json_bytes({"error": message}), request_id)

    def response_headers(self, request_id: str, answer: Answer) -> dict[str, str]:
        return dict(answer.headers)

    def log_fields(self, request: web.Request, body: bytes) -> dict[str, Any]:
        """What the log keeps of a request beyond its method, path and key."""
        return {}

    def control_routes(self, control: web.Application) -> None:
        """The control port's routes beyond the proxy's own."""

    async def reset_upstream(self) -> str | None:
        """Called by the control port's reset, after the proxy's own; a problem, or None."""
        return None

    # -- lifecycle ---------------------------------------------------------

    async def start(self, control_port: int | None = None) -> None:
        """Open the public port, and the control port if one is given (in the
        same event loop, a caller configures `self.config` directly)."""
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        public = web.Application(client_max_size=2**20)
        public.router.add_route("*", "/{tail:.*}", self.handle_public)
        # A short shutdown: held answers must not keep a stopping proxy alive.
        public_runner = web.AppRunner(public, access_log=None, shutdown_timeout=0.2)
        await public_runner.setup()
        assert public_runner.server is not None
        self.listener = PublicListener(self.public_port, public_runner.server)
        await self.listener.open()

        self._runners = [public_runner]
        if control_port is None:
            return
        control = web.Application()
        control.router.add_get("/_proxy/health", self.control_health)
        control.router.add_post("/_proxy/config", self.control_config)
        control.router.add_post("/_proxy/listener", self.control_listener)
        control.router.add_get("/_proxy/log", self.control_log)
        control.router.add_post("/_proxy/reset", self.control_reset)
        self.control_routes(control)
        control_runner = web.AppRunner(control, access_log=None, shutdown_timeout=0.2)
        await control_runner.setup()
        await web.TCPSite(control_runner, "127.0.0.1", control_port, reuse_address=True).start()
        self._runners.append(control_runner)

    async def stop(self) -> None:
        # A request forwarded is answered by the upstream before the proxy
        # goes, or, if the upstream holds it past `FORWARDS_SETTLE_SECONDS`,
        # hung up on, as its client did long before: an upstream that executes
        # only what it answers (the sandbox's held scenarios) then never will,
        # and a caller reading its truth next sees all it will ever execute.
        if self._forwards:
            await asyncio.wait(list(self._forwards), timeout=FORWARDS_SETTLE_SECONDS)
            for forwarding in list(self._forwards):
                forwarding.cancel()
            await asyncio.gather(*self._forwards, return_exceptions=True)
        if self.listener is not None:
            self.listener.close()
        for runner in self._runners:
            await runner.cleanup()
        if self.session is not None:
            await self.session.close()

    # -- control port --------------------------------------------------------

    async def control_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "listening": self._listener().is_open})

    async def control_config(self, request: web.Request) -> web.Response:
        try:
            changes = await request.json()
            self.apply_config(changes)
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(self._config_json())

    def apply_config(self, changes: Any) -> None:
        """The fault settings; a subclass applies its own after these."""
        if not isinstance(changes, dict):
            raise ValueError("config must be a JSON object")
        unknown = set(changes) - {f.name for f in fields(self.config)}
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        config = self.config
        if "queue" in changes:
            queue = [str(name) for name in changes["queue"]]
            check_faults(queue)
            config.queue = queue
        if "mix" in changes:
            mix = {str(name): float(weight) for name, weight in dict(changes["mix"]).items()}
            check_faults(mix)
            if any(weight < 0 for weight in mix.values()):
                raise ValueError("mix weights must not be negative")
            config.mix = mix
        if "seed" in changes:
            config.seed = int(changes["seed"])
            self.rng = random.Random(config.seed)
        for name in ("retry_after", "hold_seconds", "refuse_seconds"):
            if name in changes:
                setattr(config, name, float(changes[name]))

    def _config_json(self) -> dict[str, Any]:
        return {f.name: getattr(self.config, f.name) for f in fields(self.config)}

    async def control_listener(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("open"), bool):
            return web.json_response({"error": 'expected {"open": true|false}'}, status=400)
        if body["open"]:
            await self._listener().open()
        else:
            self._listener().close()
        return web.json_response({"open": self._listener().is_open})

    async def control_log(self, request: web.Request) -> web.Response:
        return web.json_response({"data": self.log})

    async def control_reset(self, request: web.Request) -> web.Response:
        self.config = self.new_config()
        self.rng = random.Random(self.config.seed)
        self.log.clear()
        await self._listener().open()
        problem = await self.reset_upstream()
        if problem is not None:
            return web.json_response({"error": problem}, status=502)
        return web.json_response({"ok": True})

    # -- public port ---------------------------------------------------------

    async def handle_public(self, request: web.Request) -> web.StreamResponse:
        request_id = "req_" + secrets.token_hex(7)
        body = await request.read()
        entry: dict[str, Any] = {
            "at": time.time(),
            "request_id": request_id,
            "method": request.method,
            "path": request.path,
            "idempotency_key": request.headers.get("Idempotency-Key"),
            "fault": "none",
            "status": None,
            "replayed": False,
            "forwarded": False,
            **self.log_fields(request, body),
            "done": False,
        }
        self.log.append(entry)
        try:
            answer, headers = await self.dispatch(request, body, entry, request_id)
        except Aborted:
            entry["done"] = True
            # The connection is gone; aiohttp has nothing left to write to.
            return web.Response(status=499)
        except Exception as exc:  # the fake itself failed: say so, as the provider would
            answer = self.server_error(request_id, f"{self.name}: {exc!r}")
            headers = {}
        entry["status"] = answer.status
        entry["done"] = True
        return web.Response(
            status=answer.status,
            body=answer.body,
            content_type=answer.content_type,
            headers={**self.response_headers(request_id, answer), **headers},
        )

    async def dispatch(
        self, request: web.Request, body: bytes, entry: dict[str, Any], request_id: str
    ) -> tuple[Answer, dict[str, str]]:
        fault = self.draw_fault(request, entry)
        refused = self.refuse_before(fault, request, request_id)
        if refused is not None:
            return refused
        # Shielded: once forwarded, the upstream's work is done even if this
        # handler is cancelled; kept, so that stopping waits for it.
        forwarding = asyncio.ensure_future(self.forward(request, body, request_id))
        self._forwards.add(forwarding)
        forwarding.add_done_callback(self._forwards.discard)
        answer = await asyncio.shield(forwarding)
        entry["forwarded"] = True
        return await self.deliver(request, answer, {}, fault)

    def draw_fault(self, request: web.Request, entry: dict[str, Any]) -> str:
        fault = "none"
        if self.is_faulted(request):
            if self.config.queue:
                fault = self.config.queue.pop(0)
            else:
                weights = {name: weight for name, weight in self.config.mix.items() if weight > 0}
                if weights:
                    fault = self.rng.choices(list(weights), weights=list(weights.values()))[0]
        entry["fault"] = fault
        return fault

    def refuse_before(
        self, fault: str, request: web.Request, request_id: str
    ) -> tuple[Answer, dict[str, str]] | None:
        """The faults at the provider's front door: nothing is forwarded."""
        if fault == "rate_limited":
            return self.rate_limited(request_id)
        if fault == "error_before":
            return self.server_error(request_id, ERROR_BEFORE_MESSAGE), {}
        if fault == "refuse":
            self._listener().close_for(self.config.refuse_seconds)
            abort_connection(request)
            raise Aborted
        return None

    async def deliver(
        self, request: web.Request, answer: Answer, headers: dict[str, str], fault: str
    ) -> tuple[Answer, dict[str, str]]:
        """An answer the upstream gave (or one standing for it), through the
        faults after forwarding."""
        if fault == "error_after":
            return self.server_error(answer.request_id, ERROR_AFTER_MESSAGE), {}
        if fault == "reset_after":
            abort_connection(request)
            raise Aborted
        if fault == "hold_after":
            await asyncio.sleep(self.config.hold_seconds)
        return answer, headers

    async def forward(self, request: web.Request, body: bytes, request_id: str) -> Answer:
        headers = _kept(request.headers, self.forwarded_request_headers)
        url = f"{self.upstream}{request.path_qs}"
        async with self._session().request(
            request.method, url, data=body or None, headers=headers
        ) as upstream:
            raw = await upstream.read()
            kept = _kept(
                upstream.headers, self.forwarded_answer_headers, PER_HOP | {"content-type"}
            )
            return Answer(
                upstream.status,
                raw,
                request_id,
                upstream.content_type or "application/json",
                kept,
            )

    def _listener(self) -> PublicListener:
        assert self.listener is not None, "proxy not started"
        return self.listener

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "proxy not started"
        return self.session


async def serve_proxy(proxy: FaultProxy, control_port: int) -> None:
    """The proxy until SIGTERM or SIGINT."""
    await proxy.start(control_port)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    print(f"{proxy.name} on 127.0.0.1:{proxy.public_port}, control {control_port}", flush=True)
    await stopping.wait()
    await proxy.stop()
