"""docs/providers.md's Adyen tables are the adapter's mapping: every row maps as
the table says, and every result code, refund status and error rule of the
adapter has its row, in order."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from intentledger.domain.transport import ProviderAnswer, Transport, Verdict, classify
from intentledger.providers.adyen import (
    ERROR_RULES,
    REFUND_STATUSES,
    RESULT_CODES,
    SOME_CODE,
    map_payment_answer,
    map_refund_answer,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"


def table_after(heading: str) -> list[list[str]]:
    """The rows of the first table under `heading`, cells stripped of backquotes."""
    text = DOC.read_text()
    section = text[text.index(f"\n{heading}\n") :]
    rows: list[list[str]] = []
    for line in section.splitlines()[2:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
        elif rows and not line.startswith("|"):
            break
    return rows[1:]  # without the header


RESULT_ROWS = table_after("### Adyen result codes")
ERROR_ROWS = table_after("### Adyen error answers")
REFUND_ROWS = table_after("### Adyen refund answers")


def answer(status: int, body: object) -> ProviderAnswer:
    return ProviderAnswer(Transport.RESPONSE, status=status, detail={"body": body})


def test_the_result_code_table_lists_exactly_the_adapters_codes_in_order() -> None:
    assert [row[0] for row in RESULT_ROWS] == list(RESULT_CODES)


@pytest.mark.parametrize(("code", "verdict", "_why"), RESULT_ROWS)
def test_each_result_code_maps_as_the_table_says(code: str, verdict: str, _why: str) -> None:
    got = map_payment_answer(answer(200, {"pspReference": "8800000000000001", "resultCode": code}))
    assert got.verdict is Verdict(verdict), got.reason
    assert code in got.reason and "8800000000000001" in got.reason


def test_the_error_table_has_a_row_for_each_rule_in_order() -> None:
    assert len(ERROR_ROWS) == len(ERROR_RULES)
    for row, rule in zip(ERROR_ROWS, ERROR_RULES, strict=True):
        http = "5xx" if isinstance(rule.status, range) else str(rule.status)
        assert (row[0], row[1], row[2]) == (http, rule.error_code, rule.verdict.value)


@pytest.mark.parametrize(("http", "code", "verdict", "_why"), ERROR_ROWS)
def test_each_error_maps_as_the_table_says(http: str, code: str, verdict: str, _why: str) -> None:
    statuses = [500, 502, 503, 504] if http == "5xx" else [int(http)]
    error_code = {"any": None, SOME_CODE: "130"}.get(code, code)
    for status in statuses:
        body: dict[str, object] = {"status": status, "message": "m", "errorType": "validation"}
        if error_code is not None:
            body["errorCode"] = error_code
        for mapping in (map_payment_answer, map_refund_answer):
            mapped = replace(answer(status, body), mapped=mapping(answer(status, body)))
            got = classify(mapped)
            assert got.verdict is Verdict(verdict), got.reason
            assert str(status) in got.reason  # the raw status is recorded beside the verdict


def test_a_validation_error_without_adyens_body_proves_nothing() -> None:
    # A 422 or a 400 from something in between (a proxy's page) is not Adyen's refusal.
    for status in (400, 422):
        for body in ({"message": "Bad Request"}, "<html>bad request</html>", None):
            assert map_payment_answer(answer(status, body)).verdict is Verdict.UNKNOWN


def test_the_refund_table_lists_exactly_the_adapters_statuses() -> None:
    assert [row[0] for row in REFUND_ROWS] == list(REFUND_STATUSES)
    for status, verdict, _why in REFUND_ROWS:
        body = {"pspReference": "8800000000000002", "status": status}
        assert map_refund_answer(answer(201, body)).verdict is Verdict(verdict)


def test_a_received_refund_is_never_a_success() -> None:
    assert REFUND_STATUSES["received"].verdict is Verdict.PENDING
    assert Verdict.SUCCEEDED not in {status.verdict for status in REFUND_STATUSES.values()}
