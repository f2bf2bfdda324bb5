"""intentledger against Stripe's wire format: `serve --provider stripe` over real
HTTP to localstripe behind the fault proxy (tests/stripe_fake.py), read back
with the official `stripe` SDK. The ledger's word is checked against what the
fake Stripe holds, never against the ledger itself."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from intentledger.ports import free_port
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.providers.stripe import StripeProvider
from intentledger.store.database import sync_url
from intentledger.store.tables import idempotency_records, operations
from tests.conftest import BACKENDS, Databases
from tests.stripe_fake import StripeFake, stripe_fake  # noqa: F401
from tests.support import INTENTLEDGER, Process
from tests.test_intake_http import assert_problem, create_key

STRIPE_KEY = "sk_test_intentledger"
# Short timings so that a lost answer, its check and a replay fit in seconds.
SUBMIT_TIMEOUT = "1500ms"
SEARCH_LAG_SECONDS = 4


@dataclass
class Ledger:
    url: str
    database_url: str
    auth: dict[str, str]
    stripe: StripeFake

    def pay(self, payment_method: str = "pm_card_visa", amount: int = 1000, **extra: Any) -> str:
        body = {"amount": amount, "currency": "EUR", "payment_method": payment_method, **extra}
        key = f"pay-{time.monotonic_ns()}"
        response = httpx.post(
            f"{self.url}/v1/payments", json=body, headers={**self.auth, "Idempotency-Key": key}
        )
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def operation(self, op_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/operations/{op_id}", headers=self.auth)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def events(self, op_id: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/v1/operations/{op_id}/events", headers=self.auth)
        data: list[dict[str, Any]] = response.json()["data"]
        return data

    def observations(self, op_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events(op_id) if e["type"] == "observation"]

    def settle(self, op_id: str, states: set[str], timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (op := self.operation(op_id))["state"] not in states:
            assert time.monotonic() < deadline, f"{op_id} is {op['state']}: {self.events(op_id)}"
            time.sleep(0.2)
        return op

    def intents_of(self, op_id: str) -> list[dict[str, Any]]:
        """What Stripe (localstripe) holds under our reference, read with the SDK."""
        return [
            intent
            for intent in self.stripe.payment_intents()
            if intent["metadata"].get("intentledger_reference") == op_id
        ]

    def refund(self, payment_id: str, **body: Any) -> str:
        key = f"refund-{time.monotonic_ns()}"
        response = httpx.post(
            f"{self.url}/v1/payments/{payment_id}/refunds",
            json=body,
            headers={**self.auth, "Idempotency-Key": key},
        )
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def refunds_at_stripe(self, intent_id: str) -> list[Any]:
        """The PaymentIntent's Refunds at Stripe (localstripe), read with the SDK."""
        listed = self.stripe.client().v1.refunds.list(params={"payment_intent": intent_id})
        return list(listed.data)

    def creates(self, op_id: str) -> list[dict[str, Any]]:
        """The proxy's log of PaymentIntent creates for `op_id`."""
        return [
            entry
            for entry in self.stripe.log()
            if entry["method"] == "POST"
            and entry["path"] == "/v1/payment_intents"
            and entry["params"].get("metadata[intentledger_reference]") == op_id
        ]


def serve_stripe(
    database_url: str,
    workdir: Path,
    api_base: str,
    env: dict[str, str] | None = None,
    recheck_backoff: str = "1s",
) -> tuple[Process, str]:
    port = free_port()
    proc = Process(
        [
            "serve",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--provider",
            "stripe",
            "--stripe-api-base",
            api_base,
            "--stripe-search-lag",
            f"{SEARCH_LAG_SECONDS}s",
            "--submit-timeout",
            SUBMIT_TIMEOUT,
            "--sync-timeout",
            SUBMIT_TIMEOUT,
            "--recheck-backoff",
            recheck_backoff,
            "--poll-interval",
            "50ms",
        ],
        {"INTENTLEDGER_STRIPE_API_KEY": STRIPE_KEY, **(env or {})},
        workdir / "serve.log",
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module", params=BACKENDS)
def ledger(
    request: pytest.FixtureRequest,
    databases: Databases,
    stripe_fake: StripeFake,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Ledger]:
    database_url = databases.create(str(request.param))
    proc, url = serve_stripe(database_url, tmp_path_factory.mktemp("stripe"), stripe_fake.api_base)
    try:
        proc.wait_healthy(url + "/healthz")
        auth = {"Authorization": f"Bearer {create_key(database_url, 'stella')}"}
        yield Ledger(url, database_url, auth, stripe_fake)
    finally:
        proc.stop()


@pytest.fixture
def fresh(ledger: Ledger) -> Ledger:
    ledger.stripe.reset()
    return ledger


def test_a_card_payment_succeeds_with_its_payment_intent(fresh: Ledger) -> None:
    op_id = fresh.pay("pm_card_visa", description="order 17", metadata={"order": "17"})
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    assert op["outcome"] == "succeeded"
    assert op["provider_reference"].startswith("pi_")
    # The official SDK reads back what the adapter created.
    intent = fresh.stripe.client().v1.payment_intents.retrieve(op["provider_reference"])
    assert intent.status == "succeeded"
    assert intent.amount == 1000 and intent.currency == "eur"
    assert intent.metadata["intentledger_reference"] == op_id
    assert intent.metadata["order"] == "17"
    (create,) = fresh.creates(op_id)
    assert create["idempotency_key"] == f"{op_id}:1"
    assert create["params"]["description"] == "order 17"  # sent, as real Stripe accepts it
    assert create["params"]["confirm"] == "true"
    assert create["params"]["automatic_payment_methods[allow_redirects]"] == "never"
    assert "off_session" not in create["params"]
    (answer,) = [o for o in fresh.observations(op_id) if o["kind"] == "submit_result"]
    assert answer["detail"]["request-id"].startswith("req_")
    # The secret key is in no observation.
    assert STRIPE_KEY not in str(fresh.events(op_id))


def test_a_declined_card_fails_with_the_decline_recorded(fresh: Ledger) -> None:
    method = fresh.stripe.client().v1.payment_methods.create(
        params={
            "type": "card",
            "card": {"number": "4000000000000341", "exp_month": 12, "exp_year": 2034, "cvc": "123"},
        }
    )
    op_id = fresh.pay(method.id)
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    assert op["outcome"] == "failed"
    (answer,) = [o for o in fresh.observations(op_id) if o["kind"] == "submit_result"]
    assert answer["http_status"] == 402 and answer["verdict"] == "failed"
    assert "card_declined" in answer["reason"]
    (intent,) = fresh.intents_of(op_id)
    assert intent["status"] == "requires_payment_method"
    assert answer["provider_reference"] == intent["id"]  # the declined PaymentIntent, named


def test_an_answer_lost_after_execution_is_reconciled_to_the_same_intent(fresh: Ledger) -> None:
    fresh.stripe.configure(queue=["reset_after"])
    op_id = fresh.pay()
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    (intent,) = fresh.intents_of(op_id)  # exactly one PaymentIntent
    assert op["outcome"] == "succeeded" and op["provider_reference"] == intent["id"]
    states = [e["to_state"] for e in fresh.events(op_id) if e["type"] == "transition"]
    assert "UNKNOWN" in states and "RECONCILIATION_DUE" in states
    lookups = [o for o in fresh.observations(op_id) if o["kind"] == "lookup_result"]
    assert lookups[-1]["verdict"] == "found_succeeded"
    assert lookups[-1]["detail"]["method"] == "search"
    assert len(fresh.creates(op_id)) == 1  # never sent again


def test_a_full_and_a_partial_refund_become_stripe_refunds(fresh: Ledger) -> None:
    payment = fresh.pay(amount=1000)
    intent_id = fresh.settle(payment, {"OUTCOME_KNOWN"})["provider_reference"]
    partial = fresh.refund(payment, amount=300)
    assert fresh.settle(partial, {"OUTCOME_KNOWN"})["outcome"] == "succeeded"
    rest = fresh.refund(payment)  # all that remains
    settled = fresh.settle(rest, {"OUTCOME_KNOWN"})
    assert settled["outcome"] == "succeeded" and settled["amount"] == 700
    at_stripe = fresh.refunds_at_stripe(intent_id)
    assert sorted(r.amount for r in at_stripe) == [300, 700]
    assert {r.metadata["intentledger_reference"] for r in at_stripe} == {partial, rest}
    assert {r.id for r in at_stripe} == {
        fresh.operation(partial)["provider_reference"],
        fresh.operation(rest)["provider_reference"],
    }
    shown = fresh.operation(payment)
    assert (shown["amount_refunded"], shown["amount_refundable"]) == (1000, 0)
    # localstripe would take a third: the ledger does not ask.
    response = httpx.post(
        f"{fresh.url}/v1/payments/{payment}/refunds",
        json={"amount": 1},
        headers={**fresh.auth, "Idempotency-Key": f"one-more-{time.monotonic_ns()}"},
    )
    assert response.status_code == 422, response.text
    assert len(fresh.refunds_at_stripe(intent_id)) == 2


def test_a_refund_whose_answer_is_lost_is_reconciled_by_lookup(fresh: Ledger) -> None:
    payment = fresh.pay(amount=800)
    intent_id = fresh.settle(payment, {"OUTCOME_KNOWN"})["provider_reference"]
    fresh.stripe.configure(queue=["reset_after"])
    refund = fresh.refund(payment, amount=500)
    settled = fresh.settle(refund, {"OUTCOME_KNOWN"})
    assert settled["outcome"] == "succeeded"
    states = [e["to_state"] for e in fresh.events(refund) if e["type"] == "transition"]
    assert "UNKNOWN" in states
    lookups = [o for o in fresh.observations(refund) if o["kind"] == "lookup_result"]
    assert lookups[-1]["verdict"] == "found_succeeded"
    [at_stripe] = fresh.refunds_at_stripe(intent_id)
    assert at_stripe.amount == 500 and settled["provider_reference"] == at_stripe.id
    creates = [
        e
        for e in fresh.stripe.log()
        if e["method"] == "POST"
        and e["path"] == "/v1/refunds"
        and e["params"].get("metadata[intentledger_reference]") == refund
    ]
    assert len(creates) == 1, "found, never sent again"


def test_a_refused_connection_is_sent_again_with_the_same_key(fresh: Ledger) -> None:
    fresh.stripe.listener(open=False)
    try:
        op_id = fresh.pay()
        deadline = time.monotonic() + 15
        while not any(o.get("transport") == "not_sent" for o in fresh.observations(op_id)):
            assert time.monotonic() < deadline, fresh.events(op_id)
            time.sleep(0.1)
    finally:
        fresh.stripe.listener(open=True)
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    assert op["outcome"] == "succeeded"
    assert len(fresh.intents_of(op_id)) == 1
    keys = {c["idempotency_key"] for c in fresh.creates(op_id)}
    assert keys == {f"{op_id}:1"}  # the same key: no new request was made
    answers = [o for o in fresh.observations(op_id) if o["kind"] == "submit_result"]
    assert answers[0]["transport"] == "not_sent", [
        (a["transport"], a["error_class"], a["detail"]) for a in answers
    ]
    assert answers[0]["verdict"] == "not_executed"
    assert answers[0]["error_class"] == "aiohttp.ClientConnectorError"


def test_a_rate_limit_is_resent_no_earlier_than_retry_after(fresh: Ledger) -> None:
    fresh.stripe.configure(queue=["rate_limited"], retry_after=2)
    op_id = fresh.pay()
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    assert op["outcome"] == "succeeded"
    first, second = fresh.creates(op_id)
    assert first["status"] == 429 and second["status"] == 200
    assert second["idempotency_key"] == first["idempotency_key"]
    assert second["at"] - first["at"] >= 2.0
    assert len(fresh.intents_of(op_id)) == 1
    refused = next(o for o in fresh.observations(op_id) if o.get("http_status") == 429)
    assert refused["verdict"] == "not_executed" and refused["retry_after_raw"] == "2"


def test_a_same_key_replay_inside_retention_gets_stripes_stored_answer(fresh: Ledger) -> None:
    # The answer is lost and Search never shows the intent: past the search lag
    # the lookup is a not-found, so the safety review replays the same key
    # inside Stripe's 24 h retention — and Stripe answers from its store.
    fresh.stripe.configure(queue=["hold_after"], hold_seconds=2, search_lag=600)
    op_id = fresh.pay()
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    (intent,) = fresh.intents_of(op_id)
    assert op["outcome"] == "succeeded" and op["provider_reference"] == intent["id"]
    creates = fresh.creates(op_id)
    assert len(creates) == 2 and {c["idempotency_key"] for c in creates} == {f"{op_id}:1"}
    assert creates[1]["replayed"] is True and creates[1]["forwarded"] is False
    rules = [e["rule"] for e in fresh.events(op_id) if e["type"] == "decision"]
    assert "replay_within_retention" in rules


def test_a_lost_answer_under_search_lag_is_inconclusive_then_found(fresh: Ledger) -> None:
    # Stripe's Search shows the intent 3 s late; the adapter allows 4 s.
    fresh.stripe.configure(queue=["reset_after"], search_lag=3)
    op_id = fresh.pay()
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    (intent,) = fresh.intents_of(op_id)
    assert op["outcome"] == "succeeded" and op["provider_reference"] == intent["id"]
    verdicts = [o["verdict"] for o in fresh.observations(op_id) if o["kind"] == "lookup_result"]
    assert verdicts[0] == "not_yet_visible" and verdicts[-1] == "found_succeeded"
    assert "not_found" not in verdicts
    rules = [e["rule"] for e in fresh.events(op_id) if e["type"] == "decision"]
    assert not any(rule.startswith("replay") for rule in rules)  # nothing was resent
    assert len(fresh.creates(op_id)) == 1


def test_without_search_a_bounded_list_scan_finds_it_and_says_so(fresh: Ledger) -> None:
    fresh.stripe.configure(queue=["reset_after"], search=False)
    op_id = fresh.pay()
    op = fresh.settle(op_id, {"OUTCOME_KNOWN"})
    (intent,) = fresh.intents_of(op_id)
    assert op["outcome"] == "succeeded" and op["provider_reference"] == intent["id"]
    lookups = [o for o in fresh.observations(op_id) if o["kind"] == "lookup_result"]
    assert lookups[-1]["verdict"] == "found_succeeded"
    assert lookups[-1]["detail"]["method"].startswith("list scan, search unavailable")
    assert "lag_seconds" not in lookups[-1]["detail"]  # a list is consistent


def test_a_stripe_ledger_mounts_no_sandbox(fresh: Ledger) -> None:
    assert httpx.get(f"{fresh.url}/_sandbox/charges").status_code == 404


def test_a_stripe_only_ledger_refuses_beneficiaries_and_cards(fresh: Ledger) -> None:
    def stored() -> tuple[int, int]:
        engine = create_engine(sync_url(fresh.database_url))
        try:
            with engine.connect() as conn:
                ops = conn.execute(select(func.count()).select_from(operations)).scalar_one()
                keys = conn.scalar(select(func.count()).select_from(idempotency_records))
                return ops, int(keys or 0)
        finally:
            engine.dispose()

    before = stored()
    requests = [
        ("/v1/beneficiaries", {"name": "Ada", "iban": "DE89370400440532013000"}, "beneficiary"),
        ("/v1/cards", {"label": "travel"}, "card issue"),
        ("/v1/cards/card_1/freeze", {}, "card freeze"),
    ]
    for path, body, kind in requests:
        response = httpx.post(
            fresh.url + path, json=body, headers={**fresh.auth, "Idempotency-Key": f"k-{path}"}
        )
        problem = assert_problem(response, 422)
        assert problem["detail"] == f"{kind} writes are not supported by provider stripe"
    assert stored() == before
    assert fresh.stripe.log() == []


def test_rejected_credentials_go_to_a_person_not_to_a_resend_loop(
    databases: Databases,
    stripe_fake: StripeFake,  # noqa: F811
    tmp_path: Path,
) -> None:
    stripe_fake.reset()
    database_url = databases.create(BACKENDS[0])
    # A restricted key localstripe does not know: Stripe's 401 before processing.
    proc, url = serve_stripe(
        database_url, tmp_path, stripe_fake.api_base, {"INTENTLEDGER_STRIPE_API_KEY": "rk_x"}
    )
    try:
        proc.wait_healthy(url + "/healthz")
        auth = {"Authorization": f"Bearer {create_key(database_url, 'stella')}"}
        ledger = Ledger(url, database_url, auth, stripe_fake)
        op_id = ledger.pay()
        op = ledger.settle(op_id, {"MANUAL_REVIEW", "OUTCOME_KNOWN"})
        time.sleep(2)  # long enough for any resend to have happened
        assert ledger.operation(op_id)["state"] == "MANUAL_REVIEW"
        assert op["next_action"] == "operator"
        (create,) = ledger.creates(op_id)
        assert create["status"] == 401
        rules = [e["rule"] for e in ledger.events(op_id) if e["type"] == "decision"]
        assert rules == ["provider_refused_configuration"]
        assert "rk_x" not in str(ledger.events(op_id))
    finally:
        proc.stop()


async def test_with_two_keys_sent_a_check_looks_beyond_the_intent_it_knows(
    stripe_fake: StripeFake,  # noqa: F811
) -> None:
    """Key 1's PaymentIntent was declined and named; key 2's answer was lost. A
    check that retrieved only the named one would call the payment failed."""
    stripe_fake.reset()
    provider = StripeProvider(STRIPE_KEY, stripe_fake.api_base, timedelta(seconds=5), timedelta(0))
    try:
        first = await provider.submit(
            ProviderRequest(
                "payment",
                "op_two_keys",
                "op_two_keys:1",
                {"amount": 500, "currency": "EUR", "payment_method": "pm_card_chargeCustomerFail"},
            )
        )
        assert first.status == 402 and first.provider_reference is not None
        second = await provider.submit(
            ProviderRequest(
                "payment",
                "op_two_keys",
                "op_two_keys:2",
                {"amount": 500, "currency": "EUR", "payment_method": "pm_card_visa"},
            )
        )
        assert second.status == 200
        named_only = ProviderLookup("payment", "op_two_keys", known=(first.provider_reference,))
        retrieved = await provider.lookup(named_only)
        assert [c.status for c in retrieved.charges] == ["failed"]
        assert retrieved.lag is None  # retrieved by id: consistent
        everything = replace(named_only, exhaustive=True)
        seen = await provider.lookup(everything)
        assert sorted(c.status for c in seen.charges) == ["failed", "succeeded"]
        assert seen.method == "retrieve by id + search"
        # The rest was searched for: the look is as consistent as its search,
        # however many objects it retrieved by id.
        assert seen.lag is not None and seen.lag > timedelta(0)
    finally:
        await provider.aclose()


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_missing_stripe_key_is_refused_at_start_up(command: str, tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'never.db'}"
    env = {"INTENTLEDGER_STRIPE_API_KEY": ""}
    done = _run(command, "--provider", "stripe", "--database-url", database, env=env)
    assert done.returncode == 2, done.stderr
    assert "INTENTLEDGER_STRIPE_API_KEY is required" in done.stderr
    assert not (tmp_path / "never.db").exists()  # nothing stored, not even a file


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_an_unknown_provider_is_refused_at_start_up(command: str, tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'never.db'}"
    done = _run(command, "--provider", "adyenn", "--database-url", database)
    assert done.returncode == 2, done.stderr
    assert "unknown provider 'adyenn'; available: adyen, sandbox, stripe" in done.stderr
    assert not (tmp_path / "never.db").exists()


def test_a_publishable_key_is_refused_without_being_echoed(tmp_path: Path) -> None:
    env = {"INTENTLEDGER_STRIPE_API_KEY": "pk_test_visible"}
    done = _run("worker", "--provider", "stripe", env=env)
    assert done.returncode == 2
    assert "secret (sk_) or restricted (rk_) key" in done.stderr
    assert "pk_test_visible" not in done.stderr


def test_a_key_with_a_trailing_newline_is_refused_at_start_up() -> None:
    env = {"INTENTLEDGER_STRIPE_API_KEY": "sk_test_from_a_file\n"}
    done = _run("worker", "--provider", "stripe", env=env)
    assert done.returncode == 2
    assert "trailing newline" in done.stderr and "sk_test_from_a_file" not in done.stderr


def test_providers_lists_each_adapter_with_what_it_declares() -> None:
    done = _run("providers")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for expected in ("sandbox", "stripe", "payment", "stripe-v1", "24 h", "Search"):
        assert expected in out, out


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [*INTENTLEDGER, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )
