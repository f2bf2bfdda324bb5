"""The payments table both bench peers (Procrastinate, DBOS) keep, one shape for both:
the same flow must cost them the same rows."""

PAYMENTS_TABLE = """
CREATE TABLE payments (
    id bigserial PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    amount bigint NOT NULL,
    currency text NOT NULL,
    payment_method text NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    provider_reference text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
)
"""
