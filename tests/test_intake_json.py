"""Intake writes its rows and its answer with orjson; they must say exactly what
the stdlib's JSON said (store/batches.py, api/app.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from intentledger.api.app import AcceptedIntent
from intentledger.documents import operation_document
from intentledger.domain.canonical import request_hash
from intentledger.engine.intake import Intent, operation_values
from intentledger.store.batches import _json_rows
from intentledger.store.intake import json_intake_rows

ROUTE = "POST /v1/payments"
# Any Unicode a validated request may carry (no lone surrogates: the canonical
# hash refuses them before intake), control characters and quotes included.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


@given(
    reference=TEXT,
    metadata=st.dictionaries(TEXT, TEXT, max_size=4),
    amount=st.integers(1, 99_999_999),
    micros=st.integers(0, 999_999),
)
def test_intake_rows_and_answer_say_what_the_stdlib_said(
    reference: str, metadata: dict[str, str], amount: int, micros: int
) -> None:
    body = {
        "amount": amount,
        "currency": "EUR",
        "payment_method": "pm_ok",
        "reference": reference,
        "metadata": metadata,
    }
    intent = Intent("ana", ROUTE, "k-é", request_hash("ana", ROUTE, body), body, "sandbox")
    now = datetime(2026, 12, 1, 20, 0, tzinfo=UTC) + timedelta(microseconds=micros)
    rows = [{**operation_values(intent, now), "transition_source": "intake"}]
    assert json.loads(json_intake_rows(rows)) == json.loads(_json_rows(rows))
    document = operation_document(rows[0])
    assert AcceptedIntent(document).body == JSONResponse(document).body
