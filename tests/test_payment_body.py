"""Intake reads a validated payment's body off the model (api/schemas.py:
payment_body); it must be exactly what pydantic's JSON dump gives, the body
that is hashed and stored."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from intentledger.api.schemas import PaymentRequest, payment_body

TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20)


def test_the_fields_are_the_ones_payment_body_knows_to_be_json() -> None:
    # A new field may not be JSON as it is (a date, a decimal): look again.
    assert list(PaymentRequest.model_fields) == [
        "amount",
        "currency",
        "payment_method",
        "description",
        "metadata",
        "mandate_id",
    ]


@given(
    amount=st.integers(1, 10**15),
    currency=st.sampled_from(["EUR", "usd", "Gbp"]),
    method=TEXT,
    description=st.none() | TEXT,
    metadata=st.none() | st.dictionaries(TEXT, TEXT, max_size=4),
    mandate_id=st.none() | TEXT,
)
def test_it_is_pydantics_json_dump(
    amount: int,
    currency: str,
    method: str,
    description: str | None,
    metadata: dict[str, str] | None,
    mandate_id: str | None,
) -> None:
    raw: dict[str, object] = {"amount": amount, "currency": currency, "payment_method": method}
    for name, value in (
        ("description", description),
        ("metadata", metadata),
        ("mandate_id", mandate_id),
    ):
        if value is not None:
            raw[name] = value
    payment = PaymentRequest.model_validate(raw)
    body = payment_body(payment)
    dumped = payment.model_dump(mode="json", exclude_none=True)
    assert body == dumped
    assert list(body) == list(dumped)
