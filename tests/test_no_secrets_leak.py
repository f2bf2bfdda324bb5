"""No secret in any log line, observation or metric of a full scenario run.

Two real `serve` processes with JSON logs, on each database: one against the
built-in sandbox (payments through every answer path, beneficiaries with an
IBAN — one of them lost and reconciled, so a lookup lists it —, a card issued
and frozen, an operator action, refused requests, a forged provider webhook),
one against the Stripe fake (payments, a refund, a forged Stripe webhook) with
a known secret key. Then every log line, every column of every observation row
and both /metrics answers are searched for the API tokens, the Stripe key, the
webhook secrets and the IBAN in each of its written forms.

It can fail: the IBAN is asserted present where it belongs (the operation's
request, kept to send it again; the sandbox's truth), so the search looks for
the form that flows. To check the test itself, log a token (e.g. in
web/auth.py) and watch it fail.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select

from intentledger.store.database import sync_url
from intentledger.store.tables import observations_with_detail, operations
from tests.conftest import Databases
from tests.served import Served, serve
from tests.stripe_fake import StripeFake, stripe_fake  # noqa: F401
from tests.support import Process
from tests.test_intake_http import create_key
from tests.test_stripe import serve_stripe

STRIPE_KEY = "sk_test_intentledger"  # what test_stripe.serve_stripe gives the adapter
STRIPE_WEBHOOK_SECRET = "whsec_stripe_never_shown_7f3a"
SANDBOX_WEBHOOK_SECRET = "whsec_sandbox_never_shown_91bc"
IBAN_SPACED = "GB82 WEST 1234 5698 7654 32"
IBAN = IBAN_SPACED.replace(" ", "")
CARD_NUMBER = "4242424242424242"


def _post(url: str, path: str, auth: dict[str, str], body: dict[str, Any], key: str) -> Any:
    answer = httpx.post(
        f"{url}{path}", json=body, headers={**auth, "Idempotency-Key": key}, timeout=30
    )
    assert answer.status_code in (200, 201, 202), answer.text
    return answer.json()


def _wait_resolved(url: str, auth: dict[str, str], op_id: str, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        operation = httpx.get(f"{url}/v1/operations/{op_id}", headers=auth).json()
        if operation["state"] in ("OUTCOME_KNOWN", "CANCELLED", "MANUAL_REVIEW"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{op_id} unresolved: {operation}")


def _forged_webhook(url: str, provider: str) -> None:
    answer = httpx.post(
        f"{url}/v1/provider-webhooks/{provider}",
        content=b'{"id": "evt_1", "type": "payment_intent.succeeded"}',
        headers={"content-type": "application/json", "stripe-signature": "t=1,v1=00"},
    )
    assert answer.status_code == 400, answer.text


def _sandbox_run(served: Served) -> None:
    url, auth = served.url, served.auth
    paid = [served.pay(method, f"p-{method}") for method in ("pm_ok", "pm_declined")]
    paid += [served.pay(m, f"p-{m}") for m in ("pm_timeout_after_execute", "pm_rate_limited")]
    beneficiary = {"name": "Ada Lovelace", "iban": IBAN_SPACED}
    _post(url, "/v1/beneficiaries", auth, beneficiary, "b-ok")
    lost = _post(
        url,
        "/v1/beneficiaries",
        auth,
        {**beneficiary, "iban": IBAN, "sandbox_scenario": "timeout_after_execute"},
        "b-lost",
    )
    card = _post(url, "/v1/cards", auth, {"label": "travel"}, "c-issue")
    _post(url, f"/v1/cards/{card['id']}/freeze", auth, {}, "c-freeze")
    blackhole = served.pay("pm_blackhole", "p-blackhole")
    # Refused at the edge: a stranger's token, and a known token with a bad body.
    assert (
        httpx.get(
            f"{url}/v1/operations/{blackhole}", headers={"Authorization": "Bearer il_x"}
        ).status_code
        == 401
    )
    bad = httpx.post(
        f"{url}/v1/payments",
        content=b"{",
        headers={**auth, "Idempotency-Key": "k", "content-type": "application/json"},
    )
    assert bad.status_code == 400
    _forged_webhook(url, "sandbox")
    for op_id in [*paid, lost["id"]]:
        _wait_resolved(url, auth, op_id)
    # pm_blackhole cycles through SUBMITTING: escalate once it rests between calls.
    for attempt in range(50):
        served.settle(blackhole, {"UNKNOWN", "RECONCILIATION_DUE", "SAFETY_REVIEW"})
        escalated = httpx.post(
            f"{url}/v1/ops/operations/{blackhole}/escalate",
            json={"reason": "on-call looked"},
            headers={**served.operator_auth, "Idempotency-Key": f"esc-{attempt}"},
        )
        if escalated.status_code != 409:
            break
    assert escalated.status_code == 200, escalated.text


def _stripe_run(url: str, auth: dict[str, str]) -> None:
    ok = _post(
        url,
        "/v1/payments",
        auth,
        {"amount": 1000, "currency": "EUR", "payment_method": "pm_card_visa"},
        "s-ok",
    )
    declined = _post(
        url,
        "/v1/payments",
        auth,
        {"amount": 1000, "currency": "EUR", "payment_method": "pm_card_chargeDeclined"},
        "s-declined",
    )
    for op_id in (ok["id"], declined["id"]):
        _wait_resolved(url, auth, op_id)
    refund = _post(url, f"/v1/payments/{ok['id']}/refunds", auth, {}, "s-refund")
    _wait_resolved(url, auth, refund["id"])
    _forged_webhook(url, "stripe")


def _rows(database_url: str) -> tuple[list[str], list[str]]:
    """Every observation row, all columns and its provider answer, as text; and
    every operation's request."""
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            seen = [
                json.dumps(list(row), default=str)
                for row in conn.execute(select(observations_with_detail))
            ]
            requests = [json.dumps(row.request_context) for row in conn.execute(select(operations))]
    finally:
        engine.dispose()
    return seen, requests


@pytest.fixture
def runs(
    database_url: str,
    databases: Databases,
    backend: str,
    stripe_fake: StripeFake,  # noqa: F811
    tmp_path: Path,
) -> Iterator[dict[str, Any]]:
    stripe_fake.reset()
    sandbox_proc, sandbox_url = serve(
        database_url,
        tmp_path,
        "24h",
        "--log-format",
        "json",
        "--sandbox-webhook-secret",
        SANDBOX_WEBHOOK_SECRET,
    )
    stripe_db = databases.create(backend)
    stripe_proc, stripe_url = serve_stripe(
        stripe_db,
        tmp_path,
        stripe_fake.api_base,
        {
            "INTENTLEDGER_LOG_FORMAT": "json",
            "INTENTLEDGER_STRIPE_WEBHOOK_SECRET": STRIPE_WEBHOOK_SECRET,
        },
    )
    processes: list[Process] = [sandbox_proc, stripe_proc]
    try:
        sandbox_proc.wait_healthy(sandbox_url + "/healthz")
        stripe_proc.wait_healthy(stripe_url + "/healthz")
        served = Served(
            sandbox_url,
            database_url,
            {"Authorization": f"Bearer {create_key(database_url, 'dora')}"},
            {"Authorization": f"Bearer {create_key(database_url, 'olive', operator=True)}"},
        )
        stripe_auth = {"Authorization": f"Bearer {create_key(stripe_db, 'stella')}"}
        _sandbox_run(served)
        _stripe_run(stripe_url, stripe_auth)
        metrics = [httpx.get(f"{u}/metrics").text for u in (sandbox_url, stripe_url)]
        beneficiaries = httpx.get(f"{sandbox_url}/_sandbox/beneficiaries").text
    finally:
        for proc in processes:
            proc.stop()
    yield {
        "logs": [line for proc in processes for line in proc.output().splitlines() if line],
        "rows": _rows(database_url)[0] + _rows(stripe_db)[0],
        "requests": _rows(database_url)[1],
        "metrics": metrics,
        "sandbox_truth": beneficiaries,
        "secrets": {
            "api token": served.auth["Authorization"].removeprefix("Bearer "),
            "operator token": served.operator_auth["Authorization"].removeprefix("Bearer "),
            "stripe api token": stripe_auth["Authorization"].removeprefix("Bearer "),
            "stripe key": STRIPE_KEY,
            "stripe webhook secret": STRIPE_WEBHOOK_SECRET,
            "sandbox webhook secret": SANDBOX_WEBHOOK_SECRET,
            "iban": IBAN,
            "iban, spaced": IBAN_SPACED,
            "iban, lower case": IBAN.lower(),
            "card number": CARD_NUMBER,
        },
    }


def test_no_secret_in_logs_observations_or_metrics(runs: dict[str, Any]) -> None:
    # The IBAN flows where it belongs, in the form searched for below.
    assert any(IBAN in request for request in runs["requests"])
    assert IBAN in runs["sandbox_truth"]
    # A full run: every path above left its trace.
    assert len(runs["rows"]) >= 10
    logs: list[str] = runs["logs"]
    events = set()
    for line in logs:
        document = json.loads(line)  # --log-format json: every line one object
        assert {"time", "level", "logger", "message"} <= set(document), line
        events.add(document.get("event"))
    assert {"operation.unknown", "operator.action", "webhook_in.rejected"} <= events, events
    places = {"log line": logs, "observation": runs["rows"], "metrics": runs["metrics"]}
    for what, secret in runs["secrets"].items():
        for place, texts in places.items():
            found = [text for text in texts if secret in text]
            assert not found, f"the {what} is in a {place}: {found[0][:300]}"
