"""How long each provider API documents that it honours an idempotency key.

A same-key replay is only a replay while the provider still remembers the key;
after that, the documented behaviour of most providers is to treat the request
as new and execute it again. Every entry cites its source; the figures are
documented *minimums* (floors), never promises that a key is gone afterwards.
Each entry's `source` names the provider's own documentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class RetentionPolicy:
    provider_api: str
    # The documented minimum time a key is honoured, counted from its first use.
    minimum: timedelta
    # Whether a replay with the same key inside `minimum` is deduplicated.
    deduplicates_by_key: bool
    # What the provider documents for a key reused after retention.
    after_expiry: str
    source: str
    uncertainty: str

    @property
    def note(self) -> str:
        """The one-line summary stored as `provider_retention_note`."""
        return (
            f"{self.provider_api}: keys honoured for at least {_human(self.minimum)}; "
            f"after that: {self.after_expiry}. Source: {self.source}. {self.uncertainty}"
        ).strip()


def _human(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    # Up to a day reads in hours ("24 h"), as providers document it.
    units = (("days", 86400),) if seconds > 86400 else ()
    for unit, size in (*units, ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


REGISTRY: dict[str, RetentionPolicy] = {
    policy.provider_api: policy
    for policy in (
        RetentionPolicy(
            "stripe-v1",
            timedelta(hours=24),
            True,
            "a reused key makes a new request",
            "https://docs.stripe.com/api/idempotent_requests",
            "Keys 'may be pruned once at least 24 hours old': a floor, not a TTL.",
        ),
        RetentionPolicy(
            "stripe-v2",
            timedelta(days=30),
            True,
            "a new request (implied, unconfirmed)",
            "https://docs.stripe.com/api-v2-overview#idempotency",
            "Reuse after 30 days is not explicitly documented.",
        ),
        RetentionPolicy(
            "checkout-com",
            timedelta(hours=24),
            True,
            "processed as normal (a new payment)",
            "https://www.checkout.com/docs/payments/manage-payments/idempotency",
            "24 h by default and adjustable per account; only 2xx answers are cached.",
        ),
        RetentionPolicy(
            "braintree-graphql",
            timedelta(days=30),
            True,
            "treated as if it has not been used",
            "https://developer.paypal.com/braintree/graphql/reference/types/"
            "charge-payment-method-input",
            "Counted from when the first request completes.",
        ),
        RetentionPolicy(
            "mollie",
            timedelta(hours=1),
            True,
            "considered a new request",
            "https://docs.mollie.com/reference/api-idempotency",
            "",
        ),
        RetentionPolicy(
            "adyen",
            timedelta(days=7),
            True,
            "unconfirmed",
            "https://docs.adyen.com/development-resources/api-idempotency",
            "Sources disagree (a minimum of 7 days vs 31 days): the shorter is taken.",
        ),
        RetentionPolicy(
            "paypal-orders-v2-create",
            timedelta(hours=6),
            True,
            "unconfirmed",
            "https://developer.paypal.com/api/orders/v2/#orders_create",
            "6 h by default; 72 h can be arranged through an account manager.",
        ),
    )
}


# The sandbox's key retention unless INTENTLEDGER_SANDBOX_KEY_RETENTION says otherwise.
DEFAULT_SANDBOX_RETENTION = timedelta(hours=24)


def sandbox_policy(retention: timedelta) -> RetentionPolicy:
    """The built-in sandbox honours keys for exactly its configured retention."""
    return RetentionPolicy(
        "sandbox",
        retention,
        True,
        "a reused key creates a new charge (as Stripe v1 documents)",
        "intentledger sandbox, INTENTLEDGER_SANDBOX_KEY_RETENTION",
        "",
    )


# Which provider API (and so which documented key retention) each adapter speaks.
PROVIDER_APIS = {"stripe": "stripe-v1", "adyen": "adyen"}


def policy_for_provider(provider: str, sandbox_retention: timedelta) -> RetentionPolicy:
    """The retention policy the safety review and operators weigh for `provider`."""
    if provider == "sandbox":
        return sandbox_policy(sandbox_retention)
    return REGISTRY[PROVIDER_APIS[provider]]
