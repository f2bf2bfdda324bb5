"""A test-only fake of Adyen's Checkout API v71 and its standard notifications.

What it follows, page by page:

- payments, `POST /v71/payments`, answered synchronously with a `resultCode`
  (https://docs.adyen.com/api-explorer/Checkout/71/post/payments,
  https://docs.adyen.com/online-payments/payment-result-codes); the request and
  answer shapes are Adyen's published OpenAPI description, vendored in
  tests/adyen_openapi/ and checked in tests/test_adyen_fake.py;
- refunds, `POST /v71/payments/{pspReference}/refunds`, answered `received`
  (201) with the outcome only ever a notification
  (https://docs.adyen.com/online-payments/refund);
- idempotency (https://docs.adyen.com/development-resources/api-idempotency):
  `Idempotency-Key` replays the first answer, echoing the key, for the
  retention (7 days by default, the shorter of the two figures Adyen's page has
  given: see domain/retention.py), and executes anew after it; a resend while
  the first is still running answers errorCode 704 ("request already processed
  or in progress", HTTP 422 here, 409 on demand: the page's snapshots differ);
  a resend with another body is refused the same way (the page names no
  separate code for it: unconfirmed);
- authentication by `X-API-Key` (https://docs.adyen.com/development-resources/api-credentials),
  401 with errorType `security` otherwise;
- notifications (https://docs.adyen.com/development-resources/webhooks,
  https://docs.adyen.com/development-resources/webhooks/webhook-types): a JSON
  batch `{"live": "false", "notificationItems": [{"NotificationRequestItem":
  {...}}]}`, each item signed by Adyen's HMAC scheme
  (https://docs.adyen.com/development-resources/webhooks/verify-hmac-signatures,
  domain/adyen_signatures.py), acknowledged by HTTP 200 with the body
  `[accepted]` and resent otherwise
  (https://docs.adyen.com/development-resources/webhooks/#accept-webhooks);
  AUTHORISATION for a payment's outcome, REFUND (success true or false) and
  REFUND_FAILED for a refund's.

Tests drive it through a control port: behaviour (result codes by queue or by
the card's `holderName`, as Adyen's test cards take a wanted result there;
refund outcomes; a slow execution; notifications held, then sent late, twice or
out of order), the clock (moved forward to expire keys), and the truth: every
payment and refund it executed and every notification delivery.

    python -m tests.adyen_fake serve --port P --control-port C
    python -m tests.adyen_fake proxy --port P2 --control-port C2 --upstream http://127.0.0.1:P

The second is the suite's fault proxy (intentledger.testing.fault_proxy) in Adyen's error
shapes, for runs that need the network to fail too (the chaos run).

Tests use `AdyenFake` (a context manager that runs that process) or the
`adyen_fake` and `fresh_adyen` fixtures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from intentledger.domain.adyen_signatures import signed_adyen_item
from intentledger.ports import free_port
from intentledger.testing.fault_proxy import Answer as FaultAnswer
from intentledger.testing.fault_proxy import FaultProxy, json_bytes, serve_proxy

REPO_ROOT = Path(__file__).resolve().parent.parent
FAKE_API_KEY = "AQE_fake_adyen_api_key"
PSP_NUMBERS = itertools.count(1)
FAKE_MERCHANT_ACCOUNT = "IntentLedgerTestECOM"
# A 32-byte key, shown as hex as the Customer Area shows it.
FAKE_HMAC_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
ACCEPTED = "[accepted]"
# The result codes the fake answers with a body of their documented shape; any
# other code queued is answered bare (an "unnamed" code an adapter must not map).
RESULT_CODES = (
    "Authorised",
    "Refused",
    "Error",
    "Cancelled",
    "Pending",
    "Received",
    "PartiallyAuthorised",
    "RedirectShopper",
)
# Final outcomes that Adyen also reports by an AUTHORISATION notification at once.
NOTIFIED_AT_ONCE = {
    "Authorised": True,
    "PartiallyAuthorised": True,
    "Refused": False,
    "Error": False,
    "Cancelled": False,
}
REFUND_OUTCOMES = ("REFUND", "REFUND:false", "REFUND_FAILED", "none")
# The writes the fault proxy faults: their outcome is what a lost answer hides.
FAULTED_WRITE = re.compile(r"/v71/payments(/[^/]+/refunds)?")


@dataclass
class FakeConfig:
    api_key: str = FAKE_API_KEY
    merchant_account: str = FAKE_MERCHANT_ACCOUNT
    hmac_key: str = FAKE_HMAC_KEY
    notify_url: str | None = None
    retention_seconds: float = DEFAULT_RETENTION_SECONDS
    # Consumed one per new payment execution, then `default_result_code`.
    result_codes: list[str] = field(default_factory=list)
    default_result_code: str = "Authorised"
    # Consumed one per new refund execution, then `default_refund_outcome`.
    refund_outcomes: list[str] = field(default_factory=list)
    default_refund_outcome: str = "REFUND"
    # How long an execution takes: a resend meanwhile meets the in-progress answer.
    execution_seconds: float = 0.0
    # At most how long a payment's answer waits, after its execution, for its
    # notification (when one is sent at once) to be accepted: a notification
    # before the answer.
    answer_delay_seconds: float = 0.0
    in_progress_status: int = 422
    # Notifications: held until a flush, or sent after a delay (and twice on demand).
    hold_notifications: bool = False
    notification_delay_seconds: float = 0.0
    duplicate_notifications: bool = False
    notification_attempts: int = 3
    notification_retry_seconds: float = 0.5


@dataclass
class Answer:
    status: int
    body: dict[str, Any]


@dataclass
class KeyRecord:
    fingerprint: str
    first_seen: float
    answer: Answer | None = None


class Fake:
    """The fake's state and both HTTP faces, in one process."""

    def __init__(self) -> None:
        self.config = FakeConfig()
        self.clock_offset = 0.0
        self.keys: dict[str, KeyRecord] = {}
        self.payments: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.held: list[dict[str, Any]] = []
        self.deliveries: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        # Module-wide: Adyen's references are globally unique, so a reset must not
        # hand out one an earlier test's ledger has already seen.
        self._psp_numbers = PSP_NUMBERS
        self._tasks: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None

    # -- time and identities ---------------------------------------------------

    def now(self) -> float:
        return time.time() + self.clock_offset

    def new_psp_reference(self) -> str:
        # Adyen's are 16 characters; a counter keeps them unique and sortable.
        return f"88{int(self.now()) % 10**8:08d}{next(self._psp_numbers) % 10**6:06d}"

    # -- the public API --------------------------------------------------------

    async def payments_endpoint(self, request: web.Request) -> web.Response:
        return await self._keyed(request, self._execute_payment)

    async def refunds_endpoint(self, request: web.Request) -> web.Response:
        return await self._keyed(request, self._execute_refund)

    async def _keyed(self, request: web.Request, execute: Any) -> web.Response:
        raw = await request.read()
        entry: dict[str, Any] = {
            "path": request.path,
            "idempotency_key": request.headers.get("Idempotency-Key"),
            "at": self.now(),
        }
        self.requests.append(entry)
        if request.headers.get("X-API-Key") != self.config.api_key:
            entry["status"] = 401
            return _json(
                Answer(
                    401,
                    {
                        "status": 401,
                        "errorCode": "000",
                        "message": "HTTP Status Response - Unauthorized",
                        "errorType": "security",
                    },
                )
            )
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            entry["status"] = 400
            return _json(_service_error(400, "702", "Unexpected input", "validation"))
        entry["body"] = body
        key = request.headers.get("Idempotency-Key")
        headers = {"Idempotency-Key": key} if key else {}
        if not key:
            answer = await execute(request, body)
            entry["status"] = answer.status
            return _json(answer, headers)
        fingerprint = hashlib.sha256(
            request.path.encode() + b"\n" + json.dumps(body, sort_keys=True).encode()
        ).hexdigest()
        record = self.keys.get(key)
        if record is not None and self.now() - record.first_seen < self.config.retention_seconds:
            if record.answer is None:
                answer = _service_error(
                    self.config.in_progress_status,
                    "704",
                    "request already processed or in progress",
                    "validation",
                )
            elif record.fingerprint != fingerprint:
                answer = _service_error(
                    422,
                    "704",
                    "idempotency key used with a different request",
                    "validation",
                )
            else:
                answer = record.answer
                entry["replayed"] = True
            entry["status"] = answer.status
            return _json(answer, headers)
        # A new key, or one past the retention: executed as if never seen.
        record = KeyRecord(fingerprint, self.now())
        self.keys[key] = record
        try:
            answer = await execute(request, body)
        except BaseException:
            self.keys.pop(key, None)
            raise
        record.answer = answer
        entry["status"] = answer.status
        return _json(answer, headers)

    async def _execute_payment(self, request: web.Request, body: dict[str, Any]) -> Answer:
        if self.config.execution_seconds:
            await asyncio.sleep(self.config.execution_seconds)
        if body.get("merchantAccount") != self.config.merchant_account:
            return _service_error(403, "901", "Invalid Merchant Account", "security")
        amount = body.get("amount") or {}
        method = body.get("paymentMethod") or {}
        code = self._next_result_code(method)
        psp = self.new_psp_reference()
        reference = body.get("reference")
        response: dict[str, Any] = {
            "pspReference": psp,
            "resultCode": code,
            "merchantReference": reference,
        }
        authorised = dict(amount)
        if code == "Authorised":
            response["amount"] = authorised
            response["paymentMethod"] = {"brand": "visa", "type": method.get("type", "scheme")}
        elif code == "PartiallyAuthorised":
            authorised["value"] = int(amount.get("value", 0)) // 2
            response["amount"] = authorised
        elif code in ("Refused", "Error"):
            response["refusalReason"] = "Refused" if code == "Refused" else "Acquirer Error"
            response["refusalReasonCode"] = "2" if code == "Refused" else "4"
        elif code == "RedirectShopper":
            response["action"] = {
                "type": "redirect",
                "method": "GET",
                "paymentMethodType": method.get("type", "scheme"),
                "url": f"https://checkoutshopper-test.adyen.com/redirect/{psp}",
            }
        elif code not in RESULT_CODES:
            # An unnamed code comes bare: nothing in it says success or failure.
            response = {"pspReference": psp, "resultCode": code}
        self.payments[psp] = {
            "pspReference": psp,
            "reference": reference,
            "amount": dict(amount),
            "resultCode": code,
            "idempotencyKey": request.headers.get("Idempotency-Key"),
            "executedAt": self.now(),
            "settled": None,
        }
        if code in NOTIFIED_AT_ONCE:
            self.settle_payment(psp, NOTIFIED_AT_ONCE[code])
        if self.config.answer_delay_seconds:
            await self._until_notified(psp, self.config.answer_delay_seconds)
        return Answer(200, response)

    async def _until_notified(self, psp: str, at_most: float) -> None:
        """Hold an answer until the payment's notification was accepted (or `at_most`)."""
        deadline = time.monotonic() + at_most
        while time.monotonic() < deadline:
            if any(psp in d["pspReferences"] and d.get("accepted") for d in self.deliveries):
                return
            await asyncio.sleep(0.01)

    def _next_result_code(self, method: dict[str, Any]) -> str:
        named = str(method.get("holderName") or "")
        for code in RESULT_CODES:
            if named.lower() == code.lower():
                return code
        if self.config.result_codes:
            return self.config.result_codes.pop(0)
        return self.config.default_result_code

    async def _execute_refund(self, request: web.Request, body: dict[str, Any]) -> Answer:
        if self.config.execution_seconds:
            await asyncio.sleep(self.config.execution_seconds)
        if body.get("merchantAccount") != self.config.merchant_account:
            return _service_error(403, "901", "Invalid Merchant Account", "security")
        payment_psp = request.match_info["psp"]
        if payment_psp not in self.payments:
            return _service_error(
                422, "167", "Original pspReference required for this operation", "validation"
            )
        psp = self.new_psp_reference()
        amount = dict(body.get("amount") or {})
        outcome = (
            self.config.refund_outcomes.pop(0)
            if self.config.refund_outcomes
            else self.config.default_refund_outcome
        )
        self.refunds[psp] = {
            "pspReference": psp,
            "paymentPspReference": payment_psp,
            "reference": body.get("reference"),
            "amount": amount,
            "idempotencyKey": request.headers.get("Idempotency-Key"),
            "executedAt": self.now(),
            "outcome": outcome,
        }
        if outcome != "none":
            self.settle_refund(psp, outcome)
        response = {
            "merchantAccount": self.config.merchant_account,
            "paymentPspReference": payment_psp,
            "pspReference": psp,
            "status": "received",
            "amount": amount,
        }
        if body.get("reference") is not None:
            response["reference"] = body["reference"]
        return Answer(201, response)

    # -- notifications -----------------------------------------------------------

    def settle_payment(self, psp: str, success: bool, event_code: str = "AUTHORISATION") -> None:
        payment = self.payments[psp]
        if event_code == "AUTHORISATION":
            payment["settled"] = success
        self.notify(
            {
                "pspReference": psp,
                "merchantReference": payment["reference"],
                "amount": payment["amount"],
                "eventCode": event_code,
                "success": "true" if success else "false",
                "paymentMethod": "visa",
                "reason": "" if success else "Refused",
            }
        )

    def settle_refund(self, psp: str, outcome: str) -> None:
        refund = self.refunds[psp]
        event_code, _, success = outcome.partition(":")
        refund["settled"] = outcome
        self.notify(
            {
                "pspReference": psp,
                "originalReference": refund["paymentPspReference"],
                "merchantReference": refund["reference"],
                "amount": refund["amount"],
                "eventCode": event_code,
                "success": success or "true",
                "paymentMethod": "visa",
                "reason": "",
            }
        )

    def notify(self, fields: dict[str, Any]) -> None:
        item = {
            **fields,
            "merchantAccountCode": self.config.merchant_account,
            "eventDate": datetime.fromtimestamp(self.now(), UTC).isoformat(timespec="seconds"),
        }
        if item.get("merchantReference") is None:
            item.pop("merchantReference", None)
        signed = signed_adyen_item(item, self.config.hmac_key)
        if self.config.hold_notifications:
            self.held.append(signed)
            return
        copies = 2 if self.config.duplicate_notifications else 1
        for _ in range(copies):
            self._spawn(self._deliver([signed], self.config.notification_delay_seconds))

    def flush(self, order: str, duplicate: bool, seed: int, batch: bool) -> int:
        items = self.held
        self.held = []
        if order == "reverse":
            items.reverse()
        elif order == "shuffle":
            random.Random(seed).shuffle(items)
        elif order != "as_held":
            raise ValueError(f"unknown order {order!r}")
        if duplicate:
            items = [item for item in items for _ in range(2)]
        batches = [items] if batch and items else [[item] for item in items]
        # In order: each batch waits for the one before it, as a sequence the test chose.
        self._spawn(self._deliver_in_sequence(batches))
        return len(items)

    async def _deliver_in_sequence(self, batches: list[list[dict[str, Any]]]) -> None:
        for items in batches:
            await self._deliver(items, 0.0)

    async def _deliver(self, items: list[dict[str, Any]], delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        url = self.config.notify_url
        batch = {
            "live": "false",
            "notificationItems": [{"NotificationRequestItem": copy.deepcopy(i)} for i in items],
        }
        for attempt in range(1, max(1, self.config.notification_attempts) + 1):
            delivery: dict[str, Any] = {
                "url": url,
                "attempt": attempt,
                "pspReferences": [item["pspReference"] for item in items],
                "eventCodes": [item["eventCode"] for item in items],
                "at": self.now(),
                "batch": batch,
            }
            self.deliveries.append(delivery)
            if url is None:
                delivery["outcome"] = "no notify_url configured"
                return
            try:
                async with self._session().post(url, json=batch) as response:
                    text = await response.text()
                    delivery["status"] = response.status
                    delivery["accepted"] = response.status == 200 and text.strip() == ACCEPTED
            except (aiohttp.ClientError, TimeoutError) as exc:
                delivery["outcome"] = f"{type(exc).__name__}: {exc}"
                delivery["accepted"] = False
            if delivery["accepted"]:
                return
            await asyncio.sleep(self.config.notification_retry_seconds)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self.session

    # -- the control port --------------------------------------------------------

    async def control_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def control_config(self, request: web.Request) -> web.Response:
        changes = await request.json()
        unknown = set(changes) - set(FakeConfig.__dataclass_fields__)
        bad_outcomes = set(changes.get("refund_outcomes", [])) - set(REFUND_OUTCOMES)
        if unknown or bad_outcomes:
            message = f"unknown config keys {sorted(unknown)} or refund outcomes {bad_outcomes}"
            return web.json_response({"error": message}, status=400)
        for name, value in changes.items():
            setattr(self.config, name, value)
        return web.json_response(asdict(self.config))

    async def control_clock(self, request: web.Request) -> web.Response:
        self.clock_offset += float((await request.json()).get("advance_seconds", 0))
        return web.json_response({"now": self.now(), "offset": self.clock_offset})

    async def control_settle(self, request: web.Request) -> web.Response:
        body = await request.json()
        psp = request.match_info["psp"]
        if psp in self.payments:
            self.settle_payment(psp, bool(body.get("success", True)))
        elif psp in self.refunds:
            self.settle_refund(psp, str(body.get("outcome", "REFUND")))
        else:
            return web.json_response({"error": f"no payment or refund {psp}"}, status=404)
        return web.json_response({"ok": True})

    async def control_flush(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        try:
            sent = self.flush(
                str(body.get("order", "as_held")),
                bool(body.get("duplicate", False)),
                int(body.get("seed", 0)),
                bool(body.get("batch", False)),
            )
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"sent": sent})

    async def control_truth(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "payments": list(self.payments.values()),
                "refunds": list(self.refunds.values()),
                "held": self.held,
                "deliveries": self.deliveries,
                "requests": self.requests,
                "now": self.now(),
                "sending": len(self._tasks),
            }
        )

    async def control_reset(self, request: web.Request) -> web.Response:
        for task in list(self._tasks):
            task.cancel()
        session, self.session = self.session, None
        if session is not None:
            await session.close()
        self.__init__()  # type: ignore[misc]
        return web.json_response({"ok": True})

    # -- lifecycle ---------------------------------------------------------------

    async def serve(self, port: int, control_port: int) -> None:
        public = web.Application()
        public.router.add_post("/v71/payments", self.payments_endpoint)
        public.router.add_post("/v71/payments/{psp}/refunds", self.refunds_endpoint)
        control = web.Application()
        control.router.add_get("/_fake/health", self.control_health)
        control.router.add_post("/_fake/config", self.control_config)
        control.router.add_post("/_fake/clock", self.control_clock)
        control.router.add_post("/_fake/settle/{psp}", self.control_settle)
        control.router.add_post("/_fake/notifications/flush", self.control_flush)
        control.router.add_get("/_fake/truth", self.control_truth)
        control.router.add_post("/_fake/reset", self.control_reset)
        runners = []
        for app, app_port in ((public, port), (control, control_port)):
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", app_port, reuse_address=True).start()
            runners.append(runner)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        print(f"adyen fake on 127.0.0.1:{port}, control {control_port}", flush=True)
        await stopping.wait()
        for runner in runners:
            await runner.cleanup()
        if self.session is not None:
            await self.session.close()


def _service_error(status: int, code: str, message: str, error_type: str) -> Answer:
    return Answer(
        status,
        {"status": status, "errorCode": code, "message": message, "errorType": error_type},
    )


def _json(answer: Answer, headers: dict[str, str] | None = None) -> web.Response:
    extra = dict(headers or {})
    psp = answer.body.get("pspReference")
    if isinstance(psp, str):
        extra["pspReference"] = psp
    return web.json_response(answer.body, status=answer.status, headers=extra)


class AdyenFaultProxy(FaultProxy):
    """The suite's fault proxy (intentledger.testing.fault_proxy) in front of this fake:
    faults on the writes whose outcome can become unknown (payments, refunds),
    answered in Adyen's error body (`status`, `errorCode`, `message`,
    `errorType`: https://docs.adyen.com/development-resources/error-codes).
    The fake keeps its own keys, so a resend after a fault meets the fake's
    replay of what it did."""

    name = "adyen fake proxy"
    forwarded_request_headers = ("X-API-Key", "Content-Type", "Idempotency-Key")
    forwarded_answer_headers = ("Idempotency-Key", "pspReference")

    def is_faulted(self, request: web.Request) -> bool:
        return request.method == "POST" and FAULTED_WRITE.fullmatch(request.path) is not None

    def rate_limited(self, request_id: str) -> tuple[FaultAnswer, dict[str, str]]:
        # Adyen's 429 names no errorCode of its own; the generic internal one
        # says "too many requests" (https://docs.adyen.com/errors/internal).
        payload = _service_error(429, "00_500", "too many requests", "internal").body
        headers = {"Retry-After": f"{self.config.retry_after:g}"}
        return FaultAnswer(429, json_bytes(payload), request_id), headers

    def server_error(self, request_id: str, message: str) -> FaultAnswer:
        payload = _service_error(500, "00_500", message, "internal").body
        return FaultAnswer(500, json_bytes(payload), request_id)


# -- the Python side, for tests ------------------------------------------------


class AdyenFake:
    """The fake as a subprocess on free ports, with its control port wrapped."""

    def __init__(self, startup_timeout: float = 20.0) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="adyen-fake-"))
        self.startup_timeout = startup_timeout
        self.public_port = free_port()
        self.control_port = free_port()
        self.api_base = f"http://127.0.0.1:{self.public_port}/v71"
        self.control_base = f"http://127.0.0.1:{self.control_port}/_fake"
        self._process: subprocess.Popen[bytes] | None = None
        self._log = self.workdir / "adyen-fake.log"

    def __enter__(self) -> AdyenFake:
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
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.adyen_fake", "serve"),
                    *("--port", str(self.public_port), "--control-port", str(self.control_port)),
                ],
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"the Adyen fake exited early:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.control_base}/health", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Adyen fake is not up:\n{self.output()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._process = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def output(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def _control(self, method: str, path: str, payload: Any = None) -> Any:
        response = httpx.request(method, f"{self.control_base}{path}", json=payload, timeout=10)
        if response.status_code != 200:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()

    def reset(self) -> None:
        self._control("POST", "/reset")

    def configure(self, **config: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._control("POST", "/config", config)
        return result

    def advance_clock(self, seconds: float) -> None:
        self._control("POST", "/clock", {"advance_seconds": seconds})

    def settle(self, psp_reference: str, success: bool = True, outcome: str = "REFUND") -> None:
        """A held-back outcome: AUTHORISATION for a payment, `outcome` for a refund."""
        self._control("POST", f"/settle/{psp_reference}", {"success": success, "outcome": outcome})

    def flush_notifications(
        self, order: str = "as_held", duplicate: bool = False, seed: int = 0, batch: bool = False
    ) -> int:
        payload = {"order": order, "duplicate": duplicate, "seed": seed, "batch": batch}
        sent: int = self._control("POST", "/notifications/flush", payload)["sent"]
        return sent

    def truth(self) -> dict[str, Any]:
        truth: dict[str, Any] = self._control("GET", "/truth")
        return truth

    def headers(self, idempotency_key: str | None = None) -> dict[str, str]:
        """What an Adyen client sends: the API key, and the idempotency key if any."""
        headers = {"X-API-Key": FAKE_API_KEY, "Content-Type": "application/json"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        return headers


@pytest.fixture(scope="session")
def adyen_fake() -> Iterator[AdyenFake]:
    with AdyenFake() as fake:
        yield fake


@pytest.fixture
def fresh_adyen(adyen_fake: AdyenFake) -> Iterator[AdyenFake]:
    adyen_fake.reset()
    yield adyen_fake


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.adyen_fake")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="the fake's API and control ports, until SIGTERM")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--control-port", type=int, required=True)
    proxy = commands.add_parser("proxy", help="the fault proxy in front of the fake")
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--control-port", type=int, required=True)
    proxy.add_argument("--upstream", required=True, help="the fake's API, e.g. http://127.0.0.1:P")
    args = parser.parse_args(argv)
    if args.command == "proxy":
        asyncio.run(serve_proxy(AdyenFaultProxy(args.upstream, args.port), args.control_port))
    else:
        asyncio.run(Fake().serve(args.port, args.control_port))


if __name__ == "__main__":
    main()
