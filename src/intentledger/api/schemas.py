"""Request bodies the API accepts, validated strictly (a string is not an amount)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema

from intentledger.domain.currencies import normalise_currency

# Stripe's own ceiling on a charge amount is 99,999,999 minor units; we allow
# far more, but not beyond what every database integer type holds exactly.
MAX_AMOUNT = 10**15
# The largest row id an INTEGER column holds (int4 on PostgreSQL). An id the
# client sends back (a page cursor) is bounded by it: beyond it PostgreSQL
# refuses the comparison itself, while no row could have such an id.
MAX_ROW_ID = 2**31 - 1

# Documented as three letters (a superset of what normalise_currency accepts),
# so the OpenAPI document is never stricter than the API, nor much looser.
Currency = Annotated[
    str,
    AfterValidator(normalise_currency),
    WithJsonSchema({"type": "string", "pattern": "^[A-Za-z]{3}$"}),
]

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=40)]
MetadataValue = Annotated[str, StringConstraints(max_length=500)]


class PaymentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    amount: int = Field(
        gt=0,
        le=MAX_AMOUNT,
        description="Amount in minor units (cents): a whole number, so 1250.0 is 1250 "
        "and 12.5 is refused.",
    )
    currency: Currency = Field(
        description="ISO 4217 alphabetic code, e.g. EUR (case-insensitive).", examples=["EUR"]
    )
    payment_method: str = Field(
        min_length=1, max_length=255, description="Provider payment method, e.g. pm_ok."
    )
    description: str | None = Field(default=None, max_length=1000)
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=50)
    mandate_id: str | None = Field(default=None, min_length=1, max_length=40)


def payment_body(payment: PaymentRequest) -> dict[str, Any]:
    """`payment.model_dump(mode="json", exclude_none=True)`, read off the model:
    its fields are JSON already (an int, strings, a dict of strings), and
    pydantic's serialiser cost intake 14,700 instructions an intent, this 6,100
    (docs/benchmarks.md step 38). tests/test_payment_body.py holds the two equal."""
    return {name: value for name, value in payment.__dict__.items() if value is not None}
