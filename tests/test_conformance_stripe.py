"""The conformance kit (intentledger.testing.conformance) run for the Stripe
adapter, on both databases, with events built as Stripe sends them and signed
by the official `stripe` SDK, and its lookup against the Stripe fake
(localstripe behind our proxy, tests/stripe_fake.py). Each check of the
adapter's wire is also shown failing on a deliberately broken copy of it."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import pytest
import stripe
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.signatures import STRIPE_TOLERANCE_SECONDS
from intentledger.domain.transport import (
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
)
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.providers.registry import BuildArguments, ProviderConfig
from intentledger.providers.stripe import (
    ERROR_RULES,
    INTENT_STATUSES,
    PLUGIN,
    REFERENCE_KEY,
    REFUND_STATUSES,
    StripeProvider,
    StripeWebhooks,
    lookup_word,
    map_answer,
    map_refund_answer,
    refund_lookup_word,
)
from intentledger.service import provider_config
from intentledger.settings import Settings
from intentledger.testing import conformance
from intentledger.testing.chaos import check_chaos
from intentledger.testing.conformance import ConformanceError, EventAbout
from intentledger.testing.truth import Truth
from intentledger_tools import chaos
from tests.stripe_fake import FAKE_API_KEY, StripeFake, stripe_fake  # noqa: F401

RETIRED, CURRENT = "whsec_conformance_retired", "whsec_conformance_current"


def sign(body: bytes, secret: str, at: int) -> Mapping[str, str]:
    header = stripe.WebhookSignature.generate_signature_header(body.decode(), secret, at)
    return {"Stripe-Signature": header}


def stripe_event(event_id: str, kind: str, item: dict[str, Any], created: int) -> bytes:
    event = {
        "id": event_id,
        "object": "event",
        "type": kind,
        "created": created,
        "data": {"object": item},
    }
    return json.dumps(event).encode()


def event(about: EventAbout) -> bytes:
    metadata = {REFERENCE_KEY: about.reference}
    if about.object_kind == "payment":
        status = "succeeded" if about.final else "processing"
        intent = {
            "id": "pi_" + secrets.token_hex(12),
            "object": "payment_intent",
            "status": status,
            "metadata": metadata,
        }
        return stripe_event(about.event_id, f"payment_intent.{status}", intent, about.created)
    assert about.object_kind == "refund"
    refund = {
        "id": "re_" + secrets.token_hex(12),
        "object": "refund",
        "status": "succeeded" if about.final else "pending",
        "metadata": metadata,
    }
    return stripe_event(about.event_id, "refund.updated", refund, about.created)


WEBHOOKS = conformance.Webhooks(
    provider="stripe",
    reader=StripeWebhooks((RETIRED, CURRENT)),
    secrets=(RETIRED, CURRENT),
    sign=conformance.signed_in_headers(sign),
    event=event,
    object_kinds=frozenset({"payment", "refund"}),
    tolerance=timedelta(seconds=STRIPE_TOLERANCE_SECONDS),
)


async def test_a_payment_event_settles_no_refund_and_a_refund_event_no_payment(
    engine: AsyncEngine,
) -> None:
    await conformance.check_kind(engine, WEBHOOKS)


async def test_stripes_webhooks_verify_rotate_and_deduplicate(engine: AsyncEngine) -> None:
    await conformance.check_webhook_verification(engine, WEBHOOKS)


def read_signed(body: bytes) -> str | None:
    now = datetime.now(UTC)
    header = sign(body, CURRENT, int(now.timestamp()))["Stripe-Signature"]
    return WEBHOOKS.reader.read(body, {"stripe-signature": header}, now).status


# A declined intent carries its error: requires_payment_method then means failed.
DECLINED = {"last_payment_error": {"code": "card_declined"}}
INTENT_WORDS = {status: known.lookup_word for status, known in INTENT_STATUSES.items()}
REFUND_WORDS = {status: known.lookup_word for status, known in REFUND_STATUSES.items()}


def intent_event_in(status: str) -> str | None:
    intent = {"id": "pi_1", "object": "payment_intent", "status": status, **DECLINED}
    return read_signed(stripe_event("evt_1", "payment_intent.succeeded", intent, 0))


def refund_event_in(status: str) -> str | None:
    refund = {"id": "re_1", "object": "refund", "status": status}
    return read_signed(stripe_event("evt_1", "refund.updated", refund, 0))


def test_no_status_stripe_does_not_name_is_an_outcome() -> None:
    conformance.check_status_mapping(
        lambda status: lookup_word({"status": status, **DECLINED}), INTENT_WORDS
    )
    conformance.check_status_mapping(
        lambda status: refund_lookup_word({"status": status}), REFUND_WORDS
    )
    conformance.check_status_mapping(intent_event_in, INTENT_WORDS)
    conformance.check_status_mapping(refund_event_in, REFUND_WORDS)


def stripe_error(code: str) -> dict[str, Any]:
    """A Stripe error body whose type and code are `code`: what ERROR_RULES read."""
    return {"error": {"type": code, "code": code, "message": "made up by the conformance kit"}}


def error_statuses() -> dict[int, frozenset[str] | None]:
    """ERROR_RULES as the kit reads a table: a status any answer of which a rule
    maps (None), or the types and codes it names there."""
    named: dict[int, frozenset[str] | None] = {}
    for rule in ERROR_RULES:
        statuses = rule.status if isinstance(rule.status, range) else (rule.status,)
        for status in statuses:
            if rule.marker is None:
                named[status] = None
            elif named.get(status, frozenset()) is not None:
                named[status] = (named.get(status) or frozenset()) | {rule.marker}
    return named


INTENT_ANSWERS = conformance.SubmitAnswers(
    mapping=map_answer,
    accepted=lambda word: {
        "id": "pi_1",
        "object": "payment_intent",
        "status": word,
        "last_payment_error": {"code": "card_declined"},
    },
    refused=stripe_error,
    named={**{s: frozenset(INTENT_STATUSES) for s in range(200, 300)}, **error_statuses()},
)
REFUND_ANSWERS = conformance.SubmitAnswers(
    mapping=map_refund_answer,
    accepted=lambda word: {"id": "re_1", "object": "refund", "status": word},
    refused=stripe_error,
    named={**{s: frozenset(REFUND_STATUSES) for s in range(200, 300)}, **error_statuses()},
)


def test_no_answer_stripe_does_not_name_is_an_outcome() -> None:
    conformance.check_submit_mapping(INTENT_ANSWERS)
    conformance.check_submit_mapping(REFUND_ANSWERS)


def test_a_mapping_that_takes_an_unknown_status_for_success_fails_the_kit() -> None:
    def any_2xx_succeeded(answer: ProviderAnswer) -> Classification:
        if answer.status is not None and 200 <= answer.status < 300:
            return Classification(Verdict.SUCCEEDED, "a 2xx, whatever its status")
        return map_answer(answer)

    with pytest.raises(ConformanceError, match="is mapped succeeded"):
        conformance.check_submit_mapping(replace(INTENT_ANSWERS, mapping=any_2xx_succeeded))


PAYMENT = ProviderRequest(
    "payment",
    "op_000000000000000000000001",
    "op_000000000000000000000001:1",
    {"amount": 500, "currency": "EUR", "payment_method": "pm_card_visa", "metadata": {}},
)
REFUND = ProviderRequest(
    "refund",
    "op_000000000000000000000002",
    "op_000000000000000000000002:1",
    {"amount": 500, "metadata": {}},
    target="pi_000000000000000000000001",
)


def build(api_base: str, timeout: timedelta) -> StripeProvider:
    return StripeProvider("sk_test_conformance", api_base, timeout, timedelta(0))


async def test_stripe_says_never_sent_only_when_nothing_was_sent() -> None:
    await conformance.check_transport(build, PAYMENT)
    await conformance.check_transport(build, REFUND)


class NeverSentReadAsFailed(StripeProvider):
    """The other mistake: a refused connection taken for a refused payment."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        answer = await super().submit(request)
        if answer.mapped is None:
            failed = Classification(Verdict.FAILED, "no connection: declined")
            return replace(answer, transport=Transport.RESPONSE, status=402, mapped=failed)
        return answer


async def test_an_adapter_taking_no_connection_for_a_decline_fails_the_kit() -> None:
    def broken(api_base: str, timeout: timedelta) -> StripeProvider:
        return NeverSentReadAsFailed("sk_test_conformance", api_base, timeout, timedelta(0))

    with pytest.raises(ConformanceError, match="a connection refused: the answer is failed"):
        await conformance.check_transport(broken, PAYMENT)


@pytest.fixture
def fake(stripe_fake: StripeFake) -> StripeFake:  # noqa: F811
    stripe_fake.reset()
    return stripe_fake


def config(fake: StripeFake) -> ProviderConfig:
    return provider_config(
        Settings(provider="stripe", stripe_api_key=FAKE_API_KEY, stripe_api_base=fake.api_base)
    )


async def test_stripes_search_is_inconclusive_inside_its_lag(
    engine: AsyncEngine, fake: StripeFake
) -> None:
    settings = config(fake)
    provider = PLUGIN.build(BuildArguments(settings, None, timedelta(seconds=5), 10))
    try:
        await conformance.check_lookup(
            engine, provider, PLUGIN.consistency(settings), PLUGIN.retention(settings)
        )
    finally:
        await provider.aclose()


class SearchWithoutLag(StripeProvider):
    """A search whose answers forget their lag: an absence would count at once."""

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        return replace(await super().lookup(query), lag=None)


async def test_a_lookup_that_forgets_its_lag_fails_the_kit(
    engine: AsyncEngine, fake: StripeFake
) -> None:
    settings = config(fake)
    provider = SearchWithoutLag(
        FAKE_API_KEY, fake.api_base, timedelta(seconds=5), settings.stripe_search_lag
    )
    try:
        with pytest.raises(ConformanceError, match="carries lag None"):
            await conformance.check_lookup(
                engine, provider, PLUGIN.consistency(settings), PLUGIN.retention(settings)
            )
    finally:
        await provider.aclose()


# -- the chaos check -----------------------------------------------------------------------------

# Short, so that a lost answer whose request never arrived is found absent
# within the run; the search's answers carry it, as Stripe's documented lag.
CHAOS_SEARCH_LAG = timedelta(seconds=2)


class StripeChaos:
    """The Stripe fake (Stripe's idempotency, search and shapes in front of
    localstripe) as the kit's chaos check drives it: Stripe's test payment
    methods, a card that succeeds and one that is declined; it answers every
    write at once, sends no events here, and its truth is its list API's
    succeeded PaymentIntents and Refunds, which Stripe documents as consistent."""

    payment_methods: ClassVar[dict[str, int]] = chaos.STRIPE_SCENARIOS
    currency = "EUR"

    def __init__(self, fake: StripeFake) -> None:
        self.fake = fake
        self.upstream = fake.api_base

    async def prepare(self, notify_url: str, seed: int) -> None:
        """The fixture's fake is fresh (reset)."""

    async def step(self) -> None:
        """It does nothing later on its own."""

    async def quiet(self) -> bool:
        return True

    async def truth(self) -> Truth:
        truth, _intents = await asyncio.to_thread(
            chaos.stripe_truth, self.fake.api_base, FAKE_API_KEY
        )
        return truth


async def test_stripe_survives_a_short_chaos_run(
    engine_on_one_backend: AsyncEngine, fake: StripeFake
) -> None:
    settings = provider_config(
        Settings(
            provider="stripe",
            stripe_api_key=FAKE_API_KEY,
            stripe_api_base=fake.api_base,
            stripe_search_lag=CHAOS_SEARCH_LAG,
        )
    )

    def build_lagging(api_base: str, timeout: timedelta) -> StripeProvider:
        return StripeProvider(FAKE_API_KEY, api_base, timeout, CHAOS_SEARCH_LAG)

    report = await check_chaos(
        engine_on_one_backend,
        StripeChaos(fake),
        build_lagging,
        reader=None,
        consistency=PLUGIN.consistency(settings),
        retention=PLUGIN.retention(settings),
    )
    assert report["faults"].keys() >= {"error_after", "reset_after", "hold_after"}, report
