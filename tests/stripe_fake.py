"""A test-only fake of Stripe's v1 API: localstripe, with a proxy of ours in front.

localstripe (GPL-3, a test tool, never shipped) keeps the state: customers,
payment methods, PaymentIntents, charges, refunds. It lacks what the Stripe
adapter's failure handling depends on, so the proxy adds it:

- Stripe's documented idempotency (https://docs.stripe.com/api/idempotent_requests):
  replays with `Idempotent-Replayed: true`, 400 for a key reused with other
  parameters, 409 while the key's first request is still running, and expiry
  (modelling the 24 h pruning) on demand;
- a `Request-Id` header on every answer;
- `GET /v1/payment_intents/search` for `metadata['KEY']:'VALUE'`, with Stripe's
  indexing lag;
- Stripe's shapes where localstripe differs: `latest_charge` is an id, declines
  are `card_error` and carry the PaymentIntent, `description` is accepted;
- the suite's fault proxy (intentledger.testing.fault_proxy) on creates: 429, 500 before
  or after executing, a dropped or held answer, a refused connection, from a
  queue or a seeded random mix; a 500 after executing is kept for the key, as
  Stripe keeps any answer, and a held answer keeps its key in flight (409).

The proxy and localstripe run as their own OS processes, so a dropped connection
or a refused port is a real one. A control port, which stays up while the public
port refuses, configures the proxy and reads its log.

    python -m tests.stripe_fake serve [--port 12111] [--forward-webhooks-to URL]
    python -m tests.stripe_fake localstripe --port L --pickle PATH
    python -m tests.stripe_fake proxy --port P --control-port C --upstream http://127.0.0.1:L

`serve` is the fake for a person trying the Stripe path without an account
(docs/providers.md, "Trying it locally"): both processes until Ctrl-C or
SIGTERM, then neither. Tests use `StripeFake` (a context manager that runs
both) or the `stripe_fake` and `fresh_stripe` fixtures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

import httpx
from aiohttp import web

from intentledger.ports import free_port
from intentledger.testing.fault_proxy import (
    ERROR_AFTER_MESSAGE,
    Answer,
    FaultConfig,
    FaultProxy,
    json_bytes,
    serve_proxy,
)
from tests.fault_proxy import FaultProxyControl

if TYPE_CHECKING:
    import stripe

# A checkout with the runtime dependencies only (`make run`) lacks the test
# tools this module is built on: say which install brings them.
NEEDS_DEV_EXTRA = (
    "the Stripe fake is a test tool: install the dev extra first "
    "(`pip install -e '.[dev]'`, which `make test` does)"
)
try:
    import pytest
except ModuleNotFoundError as missing:  # pragma: no cover - only outside a dev install
    raise SystemExit(NEEDS_DEV_EXTRA) from missing

REPO_ROOT = Path(__file__).resolve().parent.parent
FAKE_API_KEY = "sk_test_fake"
# stripe-mock's port: where a Stripe fake is usually looked for.
LOCAL_PORT = 12111
# The events localstripe sends for a PaymentIntent (it sends no refund events).
LOCALSTRIPE_EVENTS = ("payment_intent.succeeded", "payment_intent.payment_failed")

# Only creates get faults: they are the calls whose outcome can become unknown,
# while retrieve, list and search must stay usable to find out what happened.
FAULTED_CREATES = frozenset({"/v1/payment_intents", "/v1/refunds"})
PAYMENT_INTENT_CREATE = "/v1/payment_intents"
SEARCH_PATH = "/v1/payment_intents/search"
# localstripe rejects parameters it does not model; real Stripe accepts these.
STRIPPED_FROM_CREATE = frozenset(
    {
        "description",
        "automatic_payment_methods[enabled]",
        "automatic_payment_methods[allow_redirects]",
    }
)
# Stripe's search syntax for one metadata clause; either quote style is valid there.
METADATA_CLAUSE = re.compile(
    r"""^\s*metadata\[(?P<kq>['"])(?P<key>[^'"]+)(?P=kq)\]\s*:\s*(?P<vq>['"])(?P<value>[^'"]*)(?P=vq)\s*$"""
)
# Headers Stripe's API reads; everything else (Host, Content-Length, ...) is
# per-hop, and the Idempotency-Key is ours to honour, not localstripe's.
FORWARDED_HEADERS = ("Authorization", "Content-Type", "Stripe-Version", "Stripe-Account")


@dataclass
class ProxyConfig(FaultConfig):
    search_lag: float = 0.0
    search: bool = True


@dataclass
class KeyRecord:
    """One idempotency key: the request that first used it and, once known, its answer."""

    scope: tuple[str, str]
    fingerprint: tuple[str, str, tuple[tuple[str, str], ...]]
    answer: Answer | None = None
    in_flight: bool = True


def _error(type_: str, message: str, **extra: str) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, **extra}}


def _api_error(message: str) -> dict[str, Any]:
    return _error("api_error", message)


def _form_pairs(body: bytes, content_type: str) -> list[tuple[str, str]]:
    if not body or (content_type and content_type != "application/x-www-form-urlencoded"):
        return []
    return parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)


def _params_dict(pairs: list[tuple[str, str]]) -> dict[str, str | list[str]]:
    """Form pairs as one flat dict (`metadata[k]` stays one key); a repeated key becomes a list."""
    params: dict[str, str | list[str]] = {}
    for key, value in pairs:
        if key not in params:
            params[key] = value
            continue
        previous = params[key]
        params[key] = [*previous, value] if isinstance(previous, list) else [previous, value]
    return params


def _secret_key(authorization: str) -> str:
    scheme, _, credential = authorization.partition(" ")
    return credential.strip() if scheme.lower() == "bearer" else authorization


def _shape_payment_intent(intent: dict[str, Any]) -> None:
    # Real Stripe returns the charge's id unless the caller expands it.
    charge = intent.get("latest_charge")
    if isinstance(charge, dict):
        intent["latest_charge"] = charge.get("id")
    # localstripe records only card declines here, and leaves out their type.
    error = intent.get("last_payment_error")
    if isinstance(error, dict) and "type" not in error:
        error["type"] = "card_error"


def _stripe_shaped(payload: Any) -> Any:
    """Rewrite localstripe's JSON in place where it differs from real Stripe's."""
    if not isinstance(payload, dict):
        return payload
    kind = payload.get("object")
    if kind == "payment_intent":
        _shape_payment_intent(payload)
    elif kind in ("list", "search_result"):
        for item in payload.get("data") or []:
            _stripe_shaped(item)
    error = payload.get("error")
    if isinstance(error, dict) and isinstance(error.get("payment_intent"), dict):
        _shape_payment_intent(error["payment_intent"])
    return payload


def _is_validation_failure(answer: Answer) -> bool:
    """Did the endpoint refuse the request before executing anything?

    Stripe saves no idempotent result then ("If incoming parameters failed
    validation, or the request conflicted with another that was executing
    concurrently, no idempotent result is saved"). localstripe's 400, 404 and
    409 are such refusals: bad parameters, an unknown id, a conflict.
    """
    if answer.status not in (400, 404, 409):
        return False
    body = answer.json()
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("type") == "invalid_request_error"


class Proxy(FaultProxy):
    """The fault proxy in front of localstripe, with what localstripe lacks:
    Stripe's idempotency, search and shapes (the module's docstring)."""

    name = "stripe fake proxy"
    forwarded_request_headers = FORWARDED_HEADERS
    config: ProxyConfig

    def __init__(self, upstream: str, public_port: int) -> None:
        super().__init__(upstream, public_port)
        self.keys: dict[tuple[str, str], KeyRecord] = {}
        # When each PaymentIntent's create answer passed through: search hides it until the lag.
        self.created_at: dict[str, float] = {}
        # The metadata of every PaymentIntent a create's answer showed: Search
        # reads only these, fresh from localstripe, instead of listing all of
        # localstripe (whose list is too slow for a search per check under load).
        self.metadata_of: dict[str, dict[str, Any]] = {}

    # -- Stripe's words for the fault proxy ------------------------------------

    def new_config(self) -> ProxyConfig:
        return ProxyConfig()

    def is_faulted(self, request: web.Request) -> bool:
        return request.method == "POST" and request.path in FAULTED_CREATES

    def rate_limited(self, request_id: str) -> tuple[Answer, dict[str, str]]:
        message = (
            "Too many requests hit the API too quickly. We recommend an exponential "
            "backoff of your requests."
        )
        payload = _error("rate_limit_error", message, code="rate_limit")
        headers = {
            "Retry-After": f"{self.config.retry_after:g}",
            "Stripe-Should-Retry": "true",
        }
        return Answer(429, json_bytes(payload), request_id), headers

    def server_error(self, request_id: str, message: str) -> Answer:
        return Answer(500, json_bytes(_api_error(message)), request_id)

    def response_headers(self, request_id: str, answer: Answer) -> dict[str, str]:
        return {"Request-Id": request_id}

    def log_fields(self, request: web.Request, body: bytes) -> dict[str, Any]:
        pairs = [*request.query.items(), *_form_pairs(body, request.content_type)]
        return {"params": _params_dict(pairs)}

    def control_routes(self, control: web.Application) -> None:
        control.router.add_post("/_proxy/expire-keys", self.control_expire_keys)

    def apply_config(self, changes: Any) -> None:
        super().apply_config(changes)
        if "search_lag" in changes:
            self.config.search_lag = float(changes["search_lag"])
        if "search" in changes:
            self.config.search = bool(changes["search"])

    async def reset_upstream(self) -> str | None:
        self.keys.clear()
        self.created_at.clear()
        self.metadata_of.clear()
        async with self._session().delete(f"{self.upstream}/_config/data") as response:
            if response.status != 200:
                return f"localstripe: {await response.text()}"
        return None

    # -- control port --------------------------------------------------------

    async def control_expire_keys(self, request: web.Request) -> web.Response:
        # Keys still in flight stay: Stripe prunes keys by age, and an
        # in-flight one is younger than any stored answer.
        expired = [scope for scope, record in self.keys.items() if not record.in_flight]
        for scope in expired:
            del self.keys[scope]
        return web.json_response({"expired": len(expired)})

    # -- public port ---------------------------------------------------------

    async def dispatch(
        self, request: web.Request, body: bytes, entry: dict[str, Any], request_id: str
    ) -> tuple[Answer, dict[str, str]]:
        if request.method == "GET" and request.path == SEARCH_PATH:
            return await self._search(request, request_id), {}

        pairs = [*request.query.items(), *_form_pairs(body, request.content_type)]
        fault = self.draw_fault(request, entry)
        # Refusals at Stripe's front door: nothing runs and no key is touched.
        refused = self.refuse_before(fault, request, request_id)
        if refused is not None:
            return refused

        record: KeyRecord | None = None
        idempotency_key = request.headers.get("Idempotency-Key")
        if request.method == "POST" and idempotency_key:
            scope = (_secret_key(request.headers.get("Authorization", "")), idempotency_key)
            fingerprint = (request.method, request.path, tuple(sorted(pairs)))
            known = self.keys.get(scope)
            if known is not None:
                answer, headers = self._known_key_answer(known, fingerprint, idempotency_key)
                entry["replayed"] = headers.get("Idempotent-Replayed") == "true"
                fresh = Answer(answer.status, answer.body, request_id, answer.content_type)
                # It executed nothing: faults after execution touch only its delivery.
                return await self.deliver(request, fresh, headers, fault)
            record = KeyRecord(scope, fingerprint)
            self.keys[scope] = record

        # Shielded: once forwarded, the answer is recorded even if this handler is cancelled.
        answer = await asyncio.shield(
            self._execute(request, body, pairs, record, fault, request_id)
        )
        entry["forwarded"] = True
        return await self.deliver(request, answer, {}, fault)

    def _known_key_answer(
        self,
        known: KeyRecord,
        fingerprint: tuple[str, str, tuple[tuple[str, str], ...]],
        idempotency_key: str,
    ) -> tuple[Answer, dict[str, str]]:
        if known.in_flight or known.answer is None:
            message = (
                "There is currently another in-progress request using this Idempotent Key "
                "(that probably means you submitted twice, and the other request is still "
                f"going through): {idempotency_key}. Please try again later."
            )
            payload = _error("idempotency_error", message, code="idempotency_key_in_use")
            return Answer(409, json_bytes(payload), ""), {}
        if known.fingerprint != fingerprint:
            message = (
                "Keys for idempotent requests can only be used with the same parameters they "
                f"were first used with. Try using a key other than '{idempotency_key}' if you "
                "meant to execute a different request."
            )
            return Answer(400, json_bytes(_error("idempotency_error", message)), ""), {}
        stored = known.answer
        return stored, {"Idempotent-Replayed": "true", "Original-Request": stored.request_id}

    async def _execute(
        self,
        request: web.Request,
        body: bytes,
        pairs: list[tuple[str, str]],
        record: KeyRecord | None,
        fault: str,
        request_id: str,
    ) -> Answer:
        try:
            answer = await self._forward_to_localstripe(request, body, pairs, request_id)
        except BaseException:
            # Whether it ran upstream is unknown to us; leave the key free for a retry.
            if record is not None and self.keys.get(record.scope) is record:
                del self.keys[record.scope]
            raise
        if record is None:
            return answer
        if _is_validation_failure(answer):
            if self.keys.get(record.scope) is record:
                del self.keys[record.scope]
            return answer
        # Stripe keeps a 500 for the key like any answer: a replay gets the 500 again.
        record.answer = (
            self.server_error(request_id, ERROR_AFTER_MESSAGE) if fault == "error_after" else answer
        )
        if fault == "hold_after":
            # Stripe is still "working" while the answer is held: a retry meanwhile gets 409.
            # A timer, not this handler, ends that, so a client that gives up changes nothing.
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.hold_seconds, _finish, record)
        else:
            record.in_flight = False
        return answer

    async def _forward_to_localstripe(
        self, request: web.Request, body: bytes, pairs: list[tuple[str, str]], request_id: str
    ) -> Answer:
        headers = {
            name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers
        }
        is_intent_create = request.method == "POST" and request.path == PAYMENT_INTENT_CREATE
        if is_intent_create and any(key in STRIPPED_FROM_CREATE for key, _ in pairs):
            kept = [
                (k, v)
                for k, v in _form_pairs(body, request.content_type)
                if k not in STRIPPED_FROM_CREATE
            ]
            body = urlencode(kept).encode()
        url = f"{self.upstream}{request.path_qs}"
        async with self._session().request(
            request.method, url, data=body or None, headers=headers
        ) as upstream:
            status = upstream.status
            raw = await upstream.read()
            content_type = upstream.content_type or "application/json"
        if content_type != "application/json":
            return Answer(status, raw, request_id, content_type)
        payload = _stripe_shaped(json.loads(raw))
        if status == 402:
            await self._shape_decline(payload, request)
        if is_intent_create:
            self._note_created(payload)
        return Answer(status, json_bytes(payload), request_id)

    async def _shape_decline(self, payload: Any, request: web.Request) -> None:
        error = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(error, dict):
            return
        # localstripe types every error invalid_request_error; Stripe's 402s are card errors.
        error["type"] = "card_error"
        charge_id = error.get("charge")
        if not request.path.startswith("/v1/payment_intents") or not isinstance(charge_id, str):
            return
        # Stripe puts the declined PaymentIntent into the error; localstripe only names the charge.
        auth = {"Authorization": request.headers.get("Authorization", "")}
        charge = await self._get_json(f"/v1/charges/{charge_id}", auth)
        intent_id = charge.get("payment_intent") if isinstance(charge, dict) else None
        if isinstance(intent_id, str):
            intent = await self._get_json(f"/v1/payment_intents/{intent_id}", auth)
            if isinstance(intent, dict) and intent.get("object") == "payment_intent":
                error["payment_intent"] = _stripe_shaped(intent)

    async def _get_json(self, path: str, headers: dict[str, str]) -> Any:
        async with self._session().get(f"{self.upstream}{path}", headers=headers) as response:
            if response.status != 200:
                return None
            return await response.json()

    def _note_created(self, payload: Any) -> None:
        intent: Any = payload
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            intent = payload["error"].get("payment_intent")
        if isinstance(intent, dict) and isinstance(intent.get("id"), str):
            self.created_at.setdefault(intent["id"], time.time())
            metadata = intent.get("metadata")
            self.metadata_of[intent["id"]] = metadata if isinstance(metadata, dict) else {}

    async def _search(self, request: web.Request, request_id: str) -> Answer:
        if not self.config.search:
            message = f"Unrecognized request URL (GET: {SEARCH_PATH})."
            return Answer(404, json_bytes(_error("invalid_request_error", message)), request_id)
        match = METADATA_CLAUSE.match(request.query.get("query", ""))
        if match is None:
            message = (
                "This fake's search supports only queries of the form metadata['KEY']:'VALUE'."
            )
            return Answer(400, json_bytes(_error("invalid_request_error", message)), request_id)
        key, value = match["key"], match["value"]
        auth = {"Authorization": request.headers.get("Authorization", "")}
        now = time.time()
        found = []
        # Search covers the PaymentIntents created through this proxy (every one
        # in the suite's tests); each is read fresh, so its status is current.
        matching = [i for i, metadata in self.metadata_of.items() if metadata.get(key) == value]
        for intent_id in matching:
            seen = self.created_at.get(intent_id)
            if seen is not None and now - seen < self.config.search_lag:
                continue  # not indexed yet, as with Stripe's search shortly after a create
            intent = await self._get_json(f"/v1/payment_intents/{intent_id}", auth)
            if intent is None:
                return Answer(500, json_bytes(_api_error("search failed")), request_id)
            found.append(_stripe_shaped(intent))
        found.sort(key=lambda intent: intent.get("created") or 0, reverse=True)
        result = {
            "object": "search_result",
            "data": found,
            "has_more": False,
            "next_page": None,
            "url": SEARCH_PATH,
        }
        return Answer(200, json_bytes(result), request_id)


def _finish(record: KeyRecord) -> None:
    record.in_flight = False


def run_localstripe(port: int, pickle_path: Path) -> None:
    """localstripe's own entry point, with its store file moved off the shared
    /tmp/localstripe.pickle so that concurrent test sessions do not share it."""
    import pickle

    from localstripe import resources, server  # type: ignore[import-untyped]

    def load(store: Any) -> None:
        with contextlib.suppress(FileNotFoundError), pickle_path.open("rb") as file:
            saved = pickle.load(file)
            store.clear()
            store.update(saved)

    def dump(store: Any) -> None:
        with pickle_path.open("wb") as file:
            pickle.dump(store, file, protocol=pickle.HIGHEST_PROTOCOL)

    resources.Store.try_load_from_disk = load
    resources.Store.dump_to_disk = dump
    # localstripe's own start() listens on every interface; a fake with no
    # authentication stays on loopback, like the proxy in front of it.
    listener = socket.create_server(("127.0.0.1", port))
    access_log = logging.getLogger("aiohttp.access")  # localstripe logs its webhooks here too
    access_log.setLevel(logging.DEBUG)
    access_log.addHandler(logging.StreamHandler())
    web.run_app(server.app, sock=listener, access_log=access_log)


# -- the Python side, for tests ------------------------------------------------


class StripeFake(FaultProxyControl):
    """localstripe plus the proxy, as two subprocesses on free ports."""

    def __init__(
        self,
        workdir: Path | None = None,
        startup_timeout: float = 20.0,
        public_port: int | None = None,
        control_port: int | None = None,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="stripe-fake-"))
        self.startup_timeout = startup_timeout
        self.localstripe_port = free_port()
        self.public_port = public_port or free_port()
        self.control_port = control_port or free_port()
        self.api_base = f"http://127.0.0.1:{self.public_port}"
        self.truth_base = f"http://127.0.0.1:{self.localstripe_port}"
        super().__init__(f"http://127.0.0.1:{self.control_port}")
        self._processes: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._log_files: list[Any] = []

    def __enter__(self) -> StripeFake:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        try:
            pickle_path = self.workdir / "localstripe.pickle"
            self._spawn(
                "localstripe", ["--port", str(self.localstripe_port), "--pickle", str(pickle_path)]
            )
            self._spawn(
                "proxy",
                [
                    *("--port", str(self.public_port)),
                    *("--control-port", str(self.control_port)),
                    *("--upstream", self.truth_base),
                ],
            )
            self._wait_until_up()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, command: str, args: list[str]) -> None:
        log = self.workdir / f"{command}.log"
        log_file = log.open("ab")
        self._log_files.append(log_file)
        popen = subprocess.Popen(
            [sys.executable, "-m", "tests.stripe_fake", command, *args],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        self._processes.append((popen, log))

    def _wait_until_up(self) -> None:
        # The proxy opens its public port before its control port, so a healthy
        # control port means both are up; probing the public port would put the
        # probe into the proxy's request log.
        probes = [
            (f"{self.truth_base}/v1/payment_intents?limit=1", f"Bearer {FAKE_API_KEY}"),
            (f"{self.control_base}/_proxy/health", ""),
        ]
        deadline = time.monotonic() + self.startup_timeout
        for url, authorization in probes:
            headers = {"Authorization": authorization} if authorization else {}
            while True:
                for popen, log in self._processes:
                    if popen.poll() is not None:
                        output = log.read_text(errors="replace")
                        raise RuntimeError(f"{popen.args!r} exited early:\n{output}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url, headers=headers, timeout=1.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"stripe fake not up after {self.startup_timeout}s ({url}):\n"
                        + self.output()
                    )
                time.sleep(0.05)

    def stop(self) -> None:
        for popen, _ in self._processes:
            if popen.poll() is None:
                popen.terminate()
        for popen, _ in self._processes:
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout=5)
        self._processes.clear()
        for log_file in self._log_files:
            log_file.close()
        self._log_files.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def ended(self) -> str | None:
        """The first of the two processes that is no longer running, with its exit code."""
        for popen, log in self._processes:
            if popen.poll() is not None:
                return f"{log.stem} (exit code {popen.returncode})"
        return None

    def output(self) -> str:
        """Both processes' logs, for a failing test's message."""
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')}"
            for log in sorted(self.workdir.glob("*.log"))
        )

    # -- control (the proxy's own, FaultProxyControl, and these) ---------------

    def expire_keys(self) -> None:
        self._control("POST", "/_proxy/expire-keys")

    def forward_webhooks(self, url: str, secret: str, hook: str = "forward") -> None:
        """Have localstripe sign its PaymentIntent events with `secret` and POST them to `url`."""
        body = {"url": url, "secret": secret, "events": list(LOCALSTRIPE_EVENTS)}
        response = httpx.post(f"{self.truth_base}/_config/webhooks/{hook}", json=body, timeout=10)
        if response.status_code != 200:
            raise RuntimeError(f"localstripe refused the webhook: {response.text}")

    # -- the truth, read with the official SDK ----------------------------------

    def client(self) -> stripe.StripeClient:
        import stripe

        # No retries: a read of the truth that fails should fail the test now.
        return stripe.StripeClient(
            FAKE_API_KEY, base_addresses={"api": self.truth_base}, max_network_retries=0
        )

    def payment_intents(self) -> list[dict[str, Any]]:
        """Every PaymentIntent localstripe holds, oldest first (localstripe's order)."""
        pages = self.client().v1.payment_intents.list(params={"limit": 100})
        return [intent.to_dict() for intent in pages.auto_paging_iter()]


@pytest.fixture(scope="session")
def stripe_fake() -> Iterator[StripeFake]:
    with StripeFake() as fake:
        yield fake


@pytest.fixture
def fresh_stripe(stripe_fake: StripeFake) -> Iterator[StripeFake]:
    stripe_fake.reset()
    yield stripe_fake


# -- the fake for a person -------------------------------------------------


def serve_locally(
    port: int, control_port: int | None, forward_to: str | None, webhook_secret: str
) -> int:
    """Both processes until SIGINT (Ctrl-C) or SIGTERM, then neither; the exit code."""
    if importlib.util.find_spec("localstripe") is None:
        print(NEEDS_DEV_EXTRA, file=sys.stderr)
        return 1
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda _signum, _frame: stopping.set())
    fake = StripeFake(public_port=port, control_port=control_port)
    try:
        try:
            fake.start()
            if forward_to:
                fake.forward_webhooks(forward_to, webhook_secret)
        except (RuntimeError, httpx.HTTPError) as exc:
            if stopping.is_set():
                return 0  # Ctrl-C while starting: the children were told too
            print(f"the Stripe fake did not start: {exc}", file=sys.stderr)
            return 1
        print(_banner(fake, forward_to, webhook_secret), flush=True)
        while not stopping.wait(0.2):
            if (ended := fake.ended()) is not None:
                print(f"{ended} stopped on its own:\n{fake.output()}", file=sys.stderr)
                return 1
        print("Stripe fake stopped", flush=True)
        return 0
    finally:
        fake.stop()


def _banner(fake: StripeFake, forward_to: str | None, webhook_secret: str) -> str:
    lines = [
        f"Stripe fake at {fake.api_base} (localstripe behind intentledger's proxy).",
        "Run intentledger against it:",
        f"  INTENTLEDGER_PROVIDER=stripe INTENTLEDGER_STRIPE_API_KEY={FAKE_API_KEY} \\",
        f"    INTENTLEDGER_STRIPE_API_BASE={fake.api_base} intentledger serve",
    ]
    if forward_to:
        lines += [
            f"with INTENTLEDGER_STRIPE_WEBHOOK_SECRET={webhook_secret} added: localstripe",
            f"  signs {' and '.join(LOCALSTRIPE_EVENTS)}",
            f"  and sends them to {forward_to}.",
        ]
    lines += [
        f"localstripe itself (the truth, no faults): {fake.truth_base}",
        f"the proxy's faults, search lag and log:   {fake.control_base}/_proxy/",
        "Ctrl-C stops both.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.stripe_fake")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="localstripe and the proxy until Ctrl-C (docs/providers.md)"
    )
    serve.add_argument("--port", type=int, default=LOCAL_PORT, help="the Stripe API's port")
    serve.add_argument("--control-port", type=int, help="the proxy's control port (default: free)")
    serve.add_argument(
        "--forward-webhooks-to",
        metavar="URL",
        help="where localstripe sends its signed PaymentIntent events, e.g. "
        "http://127.0.0.1:8000/v1/provider-webhooks/stripe",
    )
    serve.add_argument(
        "--webhook-secret",
        default=f"whsec_{secrets.token_hex(16)}",
        help="the secret those events are signed with (default: a new one, printed)",
    )
    ls = commands.add_parser("localstripe", help="run localstripe with its own store file")
    ls.add_argument("--port", type=int, required=True)
    ls.add_argument("--pickle", type=Path, required=True)
    proxy = commands.add_parser("proxy", help="run the proxy in front of localstripe")
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--control-port", type=int, required=True)
    proxy.add_argument("--upstream", required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        sys.exit(
            serve_locally(
                args.port, args.control_port, args.forward_webhooks_to, args.webhook_secret
            )
        )
    if args.command == "localstripe":
        run_localstripe(args.port, args.pickle)
    else:
        asyncio.run(serve_proxy(Proxy(args.upstream, args.port), args.control_port))


if __name__ == "__main__":
    main()
