"""Arbitrary input at every route on PostgreSQL: never a 5xx, and a 4xx writes nothing.

Hypothesis generates the route, the path id (any text, percent-encoded), the
headers (key and token, any Latin-1 text, sometimes absent or repeated) and
the body (any JSON, raw bytes, or a payment-shaped object with odd values),
and sends them over real HTTP to `intentledger serve` on PostgreSQL — the
database that refuses what SQLite would store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from intentledger.store.database import create_sync_engine
from intentledger.store.tables import metadata
from tests.conftest import BACKENDS, Databases
from tests.test_intake_http import create_key, serving

pytestmark = pytest.mark.skipif(
    "postgresql" not in BACKENDS, reason="INTENTLEDGER_TEST_BACKENDS excludes PostgreSQL"
)

ROUTES = [
    ("POST", "/v1/payments"),
    ("GET", "/v1/operations/{id}"),
    ("GET", "/v1/operations/{id}/events"),
    ("POST", "/v1/mandates"),
    ("GET", "/v1/mandates/{id}"),
    ("POST", "/v1/mandates/{id}/suspend"),
    ("POST", "/v1/mandates/{id}/resume"),
    ("POST", "/v1/mandates/{id}/revoke"),
    ("POST", "/v1/beneficiaries"),
    ("POST", "/v1/cards"),
    ("GET", "/v1/cards/{id}"),
    ("POST", "/v1/cards/{id}/freeze"),
    ("POST", "/v1/cards/{id}/unfreeze"),
    ("GET", "/v1/ops/operations"),
    ("GET", "/v1/ops/operations/{id}"),
    ("POST", "/v1/ops/operations/{id}/resolve"),
    ("POST", "/v1/ops/operations/{id}/approve-resubmission"),
    ("POST", "/v1/ops/operations/{id}/escalate"),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
odd_text = st.text(max_size=50)
payment_like = st.fixed_dictionaries(
    {},
    optional={
        "amount": st.integers(min_value=-5, max_value=10**16) | odd_text,
        "currency": st.sampled_from(["EUR", "eur", "XYZ", "", "EU\u0000"]) | odd_text,
        "payment_method": st.sampled_from(["pm_ok", "pm_declined"]) | odd_text,
        "description": odd_text,
        "metadata": st.dictionaries(odd_text, odd_text, max_size=3),
        "mandate_id": odd_text,
        "max_amount": st.integers(min_value=-5, max_value=10**16),
        "total_limit": st.integers(min_value=-5, max_value=10**16),
        "name": odd_text,
        "iban": st.sampled_from(["DE89370400440532013000"]) | odd_text,
        "label": odd_text,
        "outcome": st.sampled_from(["succeeded", "failed"]) | odd_text,
        "evidence": odd_text,
        "reason": odd_text,
    },
)
bodies = st.one_of(
    st.none(),
    payment_like.map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
)
latin1 = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
    # A field value has no leading or trailing whitespace on the wire (RFC 9110
    # 5.5: it is not part of the value), and httpx refuses to send any.
).filter(lambda value: value == value.strip(" \t"))
ids = st.one_of(st.sampled_from(["op_missing", "md_missing", "crd_missing"]), st.text(max_size=60))


def _counts(database_url: str) -> dict[str, int]:
    engine = create_sync_engine(database_url)
    try:
        with engine.connect() as conn:
            return {
                t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                for t in metadata.sorted_tables
            }
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def target(
    databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    database_url = databases.create("postgresql")
    tokens = {
        "actor": create_key(database_url, "petra"),
        "operator": create_key(database_url, "otto", operator=True),
    }
    workdir: Path = tmp_path_factory.mktemp("properties")
    with serving(database_url, workdir) as url:
        yield {"url": url, "database_url": database_url, "tokens": tokens}


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(ROUTES),
    path_id=ids,
    key=st.one_of(st.none(), latin1, st.sampled_from(["k-1", '"k-1"'])),
    token=st.sampled_from(["actor", "operator", "none", "bogus"]),
    content_type=st.sampled_from(
        ["application/json", "text/plain", None, "application/json; charset=utf-16"]
    ),
    body=bodies,
)
def test_no_input_makes_a_5xx_and_a_refusal_writes_nothing(
    target: dict[str, Any],
    route: tuple[str, str],
    path_id: str,
    key: str | None,
    token: str,
    content_type: str | None,
    body: bytes | None,
) -> None:
    method, template = route
    path = template.replace("{id}", quote(path_id, safe="")) if "{id}" in template else template
    headers: dict[str, bytes] = {}
    if token in target["tokens"]:
        headers["Authorization"] = f"Bearer {target['tokens'][token]}".encode()
    elif token == "bogus":
        headers["Authorization"] = b"Bearer il_bogus"
    if key is not None:
        headers["Idempotency-Key"] = key.encode("latin-1")
    if content_type is not None and body is not None:
        headers["Content-Type"] = content_type.encode()
    before = _counts(target["database_url"])
    response = httpx.request(
        method,
        target["url"] + path,
        headers=headers,
        content=body if method == "POST" else None,
        timeout=30,
    )
    assert response.status_code < 500, (method, path, response.status_code, response.text)
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/problem+json")
        assert _counts(target["database_url"]) == before, (method, path, response.text)
