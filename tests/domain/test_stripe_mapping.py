"""docs/providers.md's Stripe tables are the adapter's mapping: every row maps as
the table says, every rule of the adapter has its row, and a status or error
the table does not name is never success or failure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.transport import (
    ChargeSeen,
    LookupAnswer,
    LookupVerdict,
    ProviderAnswer,
    Transport,
    Verdict,
    classify,
    judge_lookup,
)
from intentledger.providers.stripe import (
    ERROR_RULES,
    INTENT_STATUSES,
    PLUGIN,
    REFUND_STATUSES,
    STRIPE_VERSION,
    lookup_word,
    map_answer,
    map_refund_answer,
    recordable,
    refund_lookup_word,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"


def table_after(heading: str) -> list[list[str]]:
    """The rows of the first table under `heading`, cells stripped of backquotes."""
    text = DOC.read_text()
    section = text[text.index(heading) :]
    rows: list[list[str]] = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
        elif rows and not line.startswith("|"):
            break
    return rows[1:]  # without the header


STATUS_ROWS = table_after("### PaymentIntent statuses")
ERROR_ROWS = table_after("### Error answers")
REFUND_ROWS = table_after("### Refund statuses")


def intent_answer(status: str, **fields: Any) -> ProviderAnswer:
    body = {"object": "payment_intent", "id": "pi_1", "status": status, **fields}
    answer = ProviderAnswer(Transport.RESPONSE, status=200, detail={"body": body})
    return replace(answer, mapped=map_answer(answer))


def error_answer(http: int, marker: str | None) -> ProviderAnswer:
    error: dict[str, str] = {"message": "m"}
    if marker is not None:
        # Codes and types share one namespace in the table; the adapter matches either.
        error["type" if marker.endswith("_error") else "code"] = marker
    answer = ProviderAnswer(Transport.RESPONSE, status=http, detail={"body": {"error": error}})
    return replace(answer, mapped=map_answer(answer))


DECLINE = {"last_payment_error": {"type": "card_error", "code": "card_declined"}}


def test_the_status_table_lists_exactly_the_adapters_statuses() -> None:
    assert {row[0] for row in STATUS_ROWS} == set(INTENT_STATUSES)


@pytest.mark.parametrize(("status", "create", "lookup", "_why"), STATUS_ROWS)
def test_each_status_maps_as_the_table_says(
    status: str, create: str, lookup: str, _why: str
) -> None:
    fields = DECLINE if status == "requires_payment_method" else {}
    got = classify(intent_answer(status, **fields))
    assert got.verdict is Verdict(create), got.reason
    assert lookup_word({"status": status, **fields}) == lookup


def test_requires_payment_method_without_an_error_is_not_an_outcome() -> None:
    assert classify(intent_answer("requires_payment_method")).verdict is Verdict.UNKNOWN
    assert lookup_word({"status": "requires_payment_method"}) == "unmapped:requires_payment_method"


def test_the_error_table_has_a_row_for_each_rule_in_order() -> None:
    assert len(ERROR_ROWS) == len(ERROR_RULES)
    for row, rule in zip(ERROR_ROWS, ERROR_RULES, strict=True):
        http = "5xx" if isinstance(rule.status, range) else str(rule.status)
        assert (row[0], row[1], row[2]) == (http, rule.marker or "any", rule.verdict.value)


@pytest.mark.parametrize(("http", "marker", "verdict", "_why"), ERROR_ROWS)
def test_each_error_maps_as_the_table_says(http: str, marker: str, verdict: str, _why: str) -> None:
    statuses = [500, 502, 503, 504] if http == "5xx" else [int(http)]
    for status in statuses:
        got = classify(error_answer(status, None if marker == "any" else marker))
        assert got.verdict is Verdict(verdict), got.reason
        assert str(status) in got.reason  # the raw status is recorded beside the verdict


def test_a_decline_records_its_codes() -> None:
    answer = error_answer(402, "card_error")
    body: Any = answer.detail["body"]
    body["error"].update(code="card_declined", decline_code="insufficient_funds")
    reason = map_answer(answer).reason
    assert "card_declined" in reason and "insufficient_funds" in reason


UNNAMED_STATUSES = st.one_of(
    # Words a future Stripe status could share with the lookup's final words.
    st.sampled_from(["failed", "declined", "cancelled", "requires_capture"]),
    st.text(min_size=1, max_size=30),
).filter(lambda s: s not in INTENT_STATUSES)


@given(status=UNNAMED_STATUSES)
def test_a_status_the_table_does_not_name_is_never_an_outcome(status: str) -> None:
    got = classify(intent_answer(status, **DECLINE)).verdict
    assert got not in (Verdict.SUCCEEDED, Verdict.FAILED)
    # ...and in a lookup it is not final: the checks go on.
    word = lookup_word({"status": status})
    seen = LookupAnswer(
        ProviderAnswer(Transport.RESPONSE, status=200), (ChargeSeen("pi_1", word, status),)
    )
    assert judge_lookup(seen).verdict is LookupVerdict.PROCESSING


DOCUMENTED_HTTP = {400, 401, 402, 403, 404, 409, 429}


@given(
    http=st.integers(100, 599).filter(
        lambda s: s not in DOCUMENTED_HTTP and not 500 <= s < 600 and not 200 <= s < 300
    ),
    marker=st.one_of(st.none(), st.sampled_from(["card_error", "api_error", "idempotency_error"])),
)
def test_an_error_the_table_does_not_name_proves_nothing(http: int, marker: str | None) -> None:
    assert classify(error_answer(http, marker)).verdict is Verdict.UNKNOWN


@given(marker=st.one_of(st.none(), st.text(max_size=20)))
def test_no_400_is_success_and_only_named_ones_are_final(marker: str | None) -> None:
    got = classify(error_answer(400, marker)).verdict
    assert got is not Verdict.SUCCEEDED
    if marker == "idempotency_error":
        assert got is Verdict.KEY_CONFLICT  # never final: the key did something before
    elif marker != "invalid_request_error":
        assert got is Verdict.UNKNOWN


def test_a_2xx_that_is_not_a_payment_intent_proves_nothing() -> None:
    for body in ({}, {"object": "charge", "status": "succeeded"}, [], "ok"):
        answer = ProviderAnswer(Transport.RESPONSE, status=200, detail={"body": body})
        assert map_answer(answer).verdict is Verdict.UNKNOWN


def test_the_documented_stripe_version_is_the_pinned_one() -> None:
    assert f"Stripe-Version: {STRIPE_VERSION}" in DOC.read_text()


def test_what_is_stored_of_an_answer_holds_no_secret() -> None:
    key = "sk_test_SECRET"
    intent = {"object": "payment_intent", "id": "pi_1", "client_secret": "pi_1_secret_x"}
    answer = ProviderAnswer(
        Transport.NO_RESPONSE,
        error_class="aiohttp.ClientOSError",
        detail={
            "error": f"Illegal header value b'Bearer {key}\\n'",
            "body": {"data": [intent], "error": {"payment_intent": intent}},
        },
    )
    kept = recordable(answer, key)
    assert key not in str(kept.detail) and "client_secret" not in str(kept.detail)
    assert "[redacted]" in str(kept.detail["error"])
    assert "client_secret" in str(answer.detail)  # the original is not changed


@pytest.mark.parametrize(
    "key", ["sk_test_ok", "rk_live_A1", "sk_test_x\n", " sk_test_x", "pk_test_x", "sk_", "x"]
)
def test_only_a_clean_secret_or_restricted_key_is_accepted(key: str) -> None:
    from pydantic import SecretStr

    from intentledger.service import provider_config
    from intentledger.settings import Settings

    config = provider_config(Settings(provider="stripe", stripe_api_key=SecretStr(key)))
    problems = PLUGIN.problems(config)
    assert (problems == []) == (key in ("sk_test_ok", "rk_live_A1"))
    if len(key.strip()) > 3:  # "sk_" and "x" occur in the message's own words
        assert all(key.strip() not in problem for problem in problems)


@pytest.mark.parametrize(("status", "answer", "lookup", "_why"), REFUND_ROWS)
def test_each_documented_refund_status_maps_as_the_table_says(
    status: str, answer: str, lookup: str, _why: str
) -> None:
    body = {"object": "refund", "id": "re_1", "status": status}
    response = ProviderAnswer(Transport.RESPONSE, status=200, detail={"body": body})
    assert map_refund_answer(response).verdict == Verdict(answer)
    assert refund_lookup_word(body) == lookup


def test_every_refund_status_the_adapter_knows_is_documented() -> None:
    assert {row[0] for row in REFUND_ROWS} == set(REFUND_STATUSES)
    body = {"object": "refund", "id": "re_1", "status": "succeeded_later_maybe"}
    response = ProviderAnswer(Transport.RESPONSE, status=200, detail={"body": body})
    assert map_refund_answer(response).verdict == Verdict.UNKNOWN
    assert refund_lookup_word(body) == "unmapped:succeeded_later_maybe"
