"""The conformance kit (intentledger.testing.conformance) run for the Adyen
adapter, on both databases: its notification batches (signed per item inside
the body, no timestamp, no non-final event), its answers' mapping, its
transport, and its declared absence of a lookup, with the Adyen fake
(tests/adyen_fake.py) on the other side where a provider is needed. Each check
is also shown failing on a deliberately broken copy of the adapter."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.adyen_signatures import signed_adyen_item
from intentledger.domain.signatures import SignatureRefused
from intentledger.domain.transport import (
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
    classify,
)
from intentledger.providers.adyen import (
    ANY,
    ERROR_RULES,
    PLUGIN,
    REFUND_STATUSES,
    RESULT_CODES,
    SOME_CODE,
    AdyenProvider,
    map_payment_answer,
    map_refund_answer,
)
from intentledger.providers.adyen_notifications import (
    EVENT_MEANINGS,
    AdyenNotifications,
    meaning_of,
)
from intentledger.providers.base import ProviderLookup, ProviderRequest, WebhookEvent
from intentledger.providers.registry import ProviderConfig
from intentledger.service import provider_config
from intentledger.settings import Settings
from intentledger.store.database import create_ledger_engine
from intentledger.testing import conformance
from intentledger.testing.chaos import check_chaos
from intentledger.testing.conformance import ConformanceError, EventAbout
from intentledger.testing.truth import Truth
from intentledger_tools import chaos
from tests.adyen_fake import (
    FAKE_API_KEY,
    FAKE_HMAC_KEY,
    FAKE_MERCHANT_ACCOUNT,
    AdyenFake,
    AdyenFaultProxy,
    adyen_fake,  # noqa: F401
)
from tests.conftest import Databases

# The key being retired while FAKE_HMAC_KEY takes over: both verify.
RETIRED_KEY = "0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF"
AMOUNT = {"value": 500, "currency": "EUR"}


def psp_reference(seed: str) -> str:
    """A 16-character pspReference, as Adyen's, made from `seed`."""
    return hashlib.sha256(seed.encode()).hexdigest()[:16].upper()


def batch(*items: dict[str, Any]) -> bytes:
    wrapped = [{"NotificationRequestItem": item} for item in items]
    return json.dumps({"live": "false", "notificationItems": wrapped}).encode()


def event(about: EventAbout) -> bytes:
    """A batch of one notification item about `about`, unsigned, in the fields
    the fake sends (tests/adyen_fake.py, `Fake.notify`)."""
    assert about.final, "Adyen's notifications are outcomes: there is no non-final one"
    item: dict[str, Any] = {
        "pspReference": psp_reference(about.event_id),
        "merchantReference": about.reference,
        "merchantAccountCode": FAKE_MERCHANT_ACCOUNT,
        "amount": dict(AMOUNT),
        "eventCode": "AUTHORISATION",
        "success": "true",
        "eventDate": datetime.fromtimestamp(about.created, UTC).isoformat(timespec="seconds"),
        "paymentMethod": "visa",
        "reason": "",
    }
    if about.object_kind == "refund":
        item["eventCode"] = "REFUND"
        item["originalReference"] = psp_reference("payment of " + about.event_id)
    else:
        assert about.object_kind == "payment", "Adyen's events here are about payments and refunds"
    return batch(item)


def items_of(body: bytes) -> list[dict[str, Any]]:
    return [entry["NotificationRequestItem"] for entry in json.loads(body)["notificationItems"]]


def sign(body: bytes, key: str, at: int) -> tuple[bytes, Mapping[str, str]]:
    """Adyen signs each item inside the body, with no time: `at` is not used."""
    return batch(*(signed_adyen_item(item, key) for item in items_of(body))), {}


def tamper(body: bytes) -> bytes:
    """The amount changed: one of the eight fields Adyen's signature covers
    (an unsigned field, `reason`, could change undetected)."""
    items = items_of(body)
    items[0]["amount"] = {**items[0]["amount"], "value": items[0]["amount"]["value"] + 1}
    return batch(*items)


READER = AdyenNotifications((RETIRED_KEY, FAKE_HMAC_KEY), FAKE_MERCHANT_ACCOUNT)
WEBHOOKS = conformance.Webhooks(
    provider="adyen",
    reader=READER,
    secrets=(RETIRED_KEY, FAKE_HMAC_KEY),
    sign=sign,
    event=event,
    object_kinds=frozenset({"payment", "refund"}),
    tolerance=None,
    tamper=tamper,
    non_final_events=False,
)


async def test_an_authorisation_settles_no_refund_and_a_refund_no_payment(
    engine: AsyncEngine,
) -> None:
    await conformance.check_kind(engine, WEBHOOKS)


async def test_adyens_notifications_verify_rotate_and_deduplicate(engine: AsyncEngine) -> None:
    await conformance.check_webhook_verification(engine, WEBHOOKS)


class TrustingReader:
    """A reader that takes an item whatever its signature: a forgery passes."""

    acknowledgement = "[accepted]"

    def read_batch(
        self, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> list[WebhookEvent]:
        try:
            return READER.read_batch(body, headers, now)
        except SignatureRefused:
            resigned, _ = sign(body, FAKE_HMAC_KEY, 0)
            return READER.read_batch(resigned, headers, now)


async def test_a_reader_that_trusts_any_item_fails_the_kit(engine: AsyncEngine) -> None:
    with pytest.raises(ConformanceError, match="signed with another secret was accepted"):
        await conformance.check_webhook_verification(
            engine, replace(WEBHOOKS, reader=TrustingReader())
        )


def notification_in(success: bool) -> Any:
    def word_of(code: str) -> str | None:
        item = signed_adyen_item(
            {
                "pspReference": "PSP0000000000001",
                "merchantReference": "op_000000000000000000000001",
                "merchantAccountCode": FAKE_MERCHANT_ACCOUNT,
                "amount": dict(AMOUNT),
                "eventCode": code or "-",
                "success": "true" if success else "false",
                # A modification (a cancel) names the payment it is about.
                "originalReference": "PSP0000000000000",
            },
            FAKE_HMAC_KEY,
        )
        (read,) = READER.read_batch(batch(item), {}, datetime.now(UTC))
        return read.status

    return word_of


def test_no_event_code_adyen_does_not_name_is_an_outcome() -> None:
    codes = {code for code, _ in EVENT_MEANINGS}
    for success in (True, False):
        named = {
            code: word for code in codes if (word := meaning_of(code, success).status) is not None
        }
        conformance.check_status_mapping(notification_in(success), named)


def adyen_error(code: str) -> dict[str, Any]:
    return {"status": 422, "errorCode": code, "message": "made up by the kit", "errorType": "x"}


def error_statuses() -> dict[int, frozenset[str] | None]:
    """ERROR_RULES as the kit reads a table: a status any answer (or any
    errorCode) of which a rule maps (None), or the codes it names there."""
    named: dict[int, frozenset[str] | None] = {}
    for rule in ERROR_RULES:
        statuses = rule.status if isinstance(rule.status, range) else (rule.status,)
        for status in statuses:
            if rule.error_code in (ANY, SOME_CODE):
                named[status] = None
            elif named.get(status, frozenset()) is not None:
                named[status] = (named.get(status) or frozenset()) | {rule.error_code}
    return named


PAYMENT_ANSWERS = conformance.SubmitAnswers(
    mapping=map_payment_answer,
    accepted=lambda code: {
        "pspReference": "PSP0000000000001",
        "resultCode": code,
        "merchantReference": "op_000000000000000000000001",
    },
    refused=adyen_error,
    named={**{s: frozenset(RESULT_CODES) for s in range(200, 300)}, **error_statuses()},
)
REFUND_ANSWERS = conformance.SubmitAnswers(
    mapping=map_refund_answer,
    accepted=lambda status: {
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "paymentPspReference": "PSP0000000000001",
        "pspReference": "PSP0000000000002",
        "status": status,
        "amount": dict(AMOUNT),
    },
    refused=adyen_error,
    named={**{s: frozenset(REFUND_STATUSES) for s in range(200, 300)}, **error_statuses()},
)


def test_no_answer_adyen_does_not_name_is_an_outcome() -> None:
    conformance.check_submit_mapping(PAYMENT_ANSWERS)
    conformance.check_submit_mapping(REFUND_ANSWERS)


def test_a_mapping_that_reads_result_codes_in_any_case_fails_the_kit() -> None:
    lowered = {code.lower(): code for code in RESULT_CODES}

    def any_case(answer: ProviderAnswer) -> Classification:
        body = answer.detail.get("body")
        if isinstance(body, dict) and isinstance(body.get("resultCode"), str):
            code = lowered.get(body["resultCode"].strip().lower())
            if code is not None:
                body = {**body, "resultCode": code}
        return map_payment_answer(replace(answer, detail={**answer.detail, "body": body}))

    with pytest.raises(ConformanceError, match=r"is mapped (succeeded|failed)"):
        conformance.check_submit_mapping(replace(PAYMENT_ANSWERS, mapping=any_case))


PAYMENT = ProviderRequest(
    "payment",
    "op_000000000000000000000001",
    "op_000000000000000000000001:1",
    {"amount": 500, "currency": "EUR", "payment_method": "shopper_1:stored_1", "metadata": {}},
)
REFUND = ProviderRequest(
    "refund",
    "op_000000000000000000000002",
    "op_000000000000000000000002:1",
    {"amount": 500, "currency": "EUR", "metadata": {}},
    target="PSP0000000000001",
)


def build(api_base: str, timeout: timedelta) -> AdyenProvider:
    return AdyenProvider(FAKE_API_KEY, FAKE_MERCHANT_ACCOUNT, api_base, timeout)


async def test_adyen_says_never_sent_only_when_nothing_was_sent() -> None:
    await conformance.check_transport(build, PAYMENT)
    await conformance.check_transport(build, REFUND)


class SilenceReadAsRefusal(AdyenProvider):
    """An adapter that takes a server's silence for Adyen's `Refused`."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        answer = await super().submit(request)
        if answer.transport is Transport.NO_RESPONSE:
            refused = Classification(Verdict.FAILED, "no answer: refused")
            return replace(answer, transport=Transport.RESPONSE, status=200, mapped=refused)
        return answer


async def test_an_adapter_taking_silence_for_a_refusal_fails_the_kit() -> None:
    def broken(api_base: str, timeout: timedelta) -> AdyenProvider:
        return SilenceReadAsRefusal(FAKE_API_KEY, FAKE_MERCHANT_ACCOUNT, api_base, timeout)

    with pytest.raises(ConformanceError, match=r"did not answer within .*: the answer is failed"):
        await conformance.check_transport(broken, PAYMENT)


@pytest.fixture
def adyen(adyen_fake: AdyenFake) -> AdyenFake:  # noqa: F811
    adyen_fake.reset()
    return adyen_fake


def host(fake: AdyenFake) -> str:
    """The fake's address without the version: the adapter adds /v71."""
    return f"http://127.0.0.1:{fake.public_port}"


def config(fake: AdyenFake) -> ProviderConfig:
    return provider_config(
        Settings(
            provider="adyen",
            adyen_api_key=FAKE_API_KEY,
            adyen_merchant_account=FAKE_MERCHANT_ACCOUNT,
            adyen_api_base=host(fake),
        )
    )


async def test_adyen_has_no_lookup_and_is_never_asked(
    engine: AsyncEngine, adyen: AdyenFake
) -> None:
    settings = config(adyen)
    provider = build(host(adyen), timedelta(seconds=5))
    try:
        await conformance.check_lookup(
            engine, provider, PLUGIN.consistency(settings), PLUGIN.retention(settings)
        )
    finally:
        await provider.aclose()
    assert adyen.truth()["requests"] == [], "nothing was sent to Adyen"


async def test_a_plugin_claiming_a_lookup_adyen_lacks_fails_the_kit(
    engine: AsyncEngine, adyen: AdyenFake
) -> None:
    settings = config(adyen)
    claimed = replace(PLUGIN.consistency(settings), available=True)
    provider = build(host(adyen), timedelta(seconds=5))
    try:
        with pytest.raises(ConformanceError, match="raised NoLookup"):
            await conformance.check_lookup(engine, provider, claimed, PLUGIN.retention(settings))
    finally:
        await provider.aclose()


class AbsenceWithoutLookup(AdyenProvider):
    """Declares no lookup, yet answers one with "nothing found"."""

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        return LookupAnswer(ProviderAnswer(Transport.RESPONSE, status=200), method="made up")


async def test_a_lookup_that_answers_although_declared_absent_fails_the_kit(
    engine: AsyncEngine, adyen: AdyenFake
) -> None:
    settings = config(adyen)
    provider = AbsenceWithoutLookup(
        FAKE_API_KEY, FAKE_MERCHANT_ACCOUNT, host(adyen), timedelta(seconds=5)
    )
    try:
        with pytest.raises(ConformanceError, match="yet its lookup answered"):
            await conformance.check_lookup(
                engine, provider, PLUGIN.consistency(settings), PLUGIN.retention(settings)
            )
    finally:
        await provider.aclose()


@pytest.mark.parametrize("code", ["Authorized", "AUTHORISED", "Settled", "Success", "Unheard"])
async def test_an_unnamed_result_code_from_the_fake_proves_nothing(
    adyen: AdyenFake, code: str
) -> None:
    """The mapping property on the wire: the fake answers a code it does not
    document bare, and the adapter's answer is no outcome."""
    adyen.configure(result_codes=[code])
    provider = build(host(adyen), timedelta(seconds=5))
    try:
        answer = await provider.submit(PAYMENT)
    finally:
        await provider.aclose()
    assert answer.status == 200
    assert classify(answer).verdict not in (Verdict.SUCCEEDED, Verdict.FAILED)


# -- the chaos check -----------------------------------------------------------------------------


class AdyenChaos:
    """The Adyen fake as the kit's chaos check drives it, through its control
    port: payments answered in a seeded mix of result codes, refunds settled
    in a mix of outcomes, every notification held and sent later in shuffled
    order (some twice, some batched), Pending and Received payments settled by
    a late AUTHORISATION, as Adyen does. Its truth is its own record."""

    payment_methods: ClassVar[dict[str, int]] = chaos.ADYEN_CARDS
    currency = "EUR"

    def __init__(self, fake: AdyenFake) -> None:
        self.upstream = host(fake)
        self.control = httpx.AsyncClient(base_url=fake.control_base, timeout=30)
        self.rng = random.Random(0)
        self.settling: set[str] = set()

    async def _call(self, method: str, path: str, payload: Any = None) -> Any:
        response = await self.control.request(method, path, json=payload)
        response.raise_for_status()
        return response.json()

    async def prepare(self, notify_url: str, seed: int) -> None:
        self.rng = random.Random(seed)
        await self._call("POST", "/reset")
        codes, weights = list(chaos.ADYEN_RESULT_CODES), list(chaos.ADYEN_RESULT_CODES.values())
        outcomes = list(chaos.ADYEN_REFUND_OUTCOMES)
        outcome_weights = list(chaos.ADYEN_REFUND_OUTCOMES.values())
        await self._call(
            "POST",
            "/config",
            {
                "notify_url": notify_url,
                "result_codes": self.rng.choices(codes, weights, k=400),
                "refund_outcomes": self.rng.choices(outcomes, outcome_weights, k=400),
                "hold_notifications": True,
                "notification_attempts": 40,
                "notification_retry_seconds": 0.3,
            },
        )

    async def step(self) -> None:
        record = await self._call("GET", "/truth")
        for payment in record["payments"]:
            psp = payment["pspReference"]
            waiting = (
                payment["resultCode"] in chaos.ADYEN_AWAITING and payment.get("settled") is None
            )
            if waiting and psp not in self.settling and record["now"] - payment["executedAt"] > 1:
                self.settling.add(psp)  # once: a second settlement could contradict the first
                success = self.rng.random() < chaos.ADYEN_PENDING_SUCCESS
                await self._call("POST", f"/settle/{psp}", {"success": success})
        flush = {
            "order": "shuffle",
            "duplicate": self.rng.random() < 0.3,
            "seed": self.rng.randrange(2**31),
            "batch": self.rng.random() < 0.5,
        }
        await self._call("POST", "/notifications/flush", flush)

    async def quiet(self) -> bool:
        record = await self._call("GET", "/truth")
        waiting = any(
            p["resultCode"] in chaos.ADYEN_AWAITING and p.get("settled") is None
            for p in record["payments"]
        )
        return not record["held"] and not record["sending"] and not waiting

    async def truth(self) -> Truth:
        return chaos.adyen_truth(await self._call("GET", "/truth"))

    async def aclose(self) -> None:
        await self.control.aclose()


async def test_adyen_survives_a_short_chaos_run(
    engine_on_one_backend: AsyncEngine, adyen: AdyenFake
) -> None:
    settings = config(adyen)
    fake = AdyenChaos(adyen)
    try:
        report = await check_chaos(
            engine_on_one_backend,
            fake,
            build,
            reader=AdyenNotifications((FAKE_HMAC_KEY,), FAKE_MERCHANT_ACCOUNT),
            consistency=PLUGIN.consistency(settings),
            retention=PLUGIN.retention(settings),
            fault_proxy=AdyenFaultProxy,
        )
    finally:
        await fake.aclose()
    assert report["faults"].keys() >= {"error_after", "reset_after", "hold_after"}, report
    assert report["settled"].get("refund succeeded") and report["notifications"], report


class EveryOutcomeReadAsSuccess(AdyenNotifications):
    """A reader that takes every notification's outcome for a success (it
    ignores `success` and REFUND_FAILED)."""

    def read_batch(
        self, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> list[WebhookEvent]:
        events = super().read_batch(body, headers, now)
        return [replace(e, status="succeeded") if e.status else e for e in events]


class CrashesOnEveryBatch(AdyenNotifications):
    """A reader that fails on what it was not written for: every batch."""

    def read_batch(
        self, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> list[WebhookEvent]:
        raise KeyError("a field this reader did not expect")


@pytest.mark.parametrize(
    ("broken", "found"),
    [
        (EveryOutcomeReadAsSuccess, "contradictions"),
        (CrashesOnEveryBatch, "could not be taken: KeyError"),
    ],
)
async def test_a_broken_reader_fails_the_chaos_check(
    databases: Databases, adyen: AdyenFake, broken: type[AdyenNotifications], found: str
) -> None:
    """What the reader gets wrong does not depend on the database: one is enough."""
    settings = config(adyen)
    fake = AdyenChaos(adyen)
    engine = create_ledger_engine(databases.create("sqlite"))
    try:
        with pytest.raises(ConformanceError, match=found):
            await check_chaos(
                engine,
                fake,
                build,
                reader=broken((FAKE_HMAC_KEY,), FAKE_MERCHANT_ACCOUNT),
                consistency=PLUGIN.consistency(settings),
                retention=PLUGIN.retention(settings),
                fault_proxy=AdyenFaultProxy,
                payments=20,
            )
    finally:
        await fake.aclose()
        await engine.dispose()
