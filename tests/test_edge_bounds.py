"""The API's numbers agree with its schema and its columns (issue 35, item 9),
over real HTTP on both databases.

- Every integer query parameter the OpenAPI document declares is sent at its
  minimum and maximum (an answer, never a 5xx) and one past each (422
  problem+json, nothing written), on real resources so that the value reaches
  the database. `starting_after` was documented up to 2^62 while delivery ids
  are INTEGER: on PostgreSQL 2^31 was a 500.
- A whole number written `1250.0` or `1.25e3` is an integer, as JSON Schema
  reads the document's `integer`; `12.5` and a fraction a float would round
  away are refused where an integer is due.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from intentledger.api.schemas import MAX_AMOUNT
from tests.conftest import BACKENDS, Databases
from tests.test_intake_http import PAYMENT, Service, assert_problem, create_key, serving

JSON = "application/json"
# A public address literal: accepted as a target without resolving a name.
ENDPOINT_URL = "https://93.184.216.34/hooks"


@pytest.fixture(scope="module", params=BACKENDS)
def bounded(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    database_url = databases.create(str(request.param))
    tokens = {"alice": create_key(database_url, "alice")}
    tokens["olive"] = create_key(database_url, "olive", operator=True)
    with serving(database_url, tmp_path_factory.mktemp("bounds")) as url:
        yield Service(url, database_url, tokens)


def _integer_bounds(schema: dict[str, Any]) -> tuple[int, int] | None:
    """(minimum, maximum) of an integer parameter, optional ones included."""
    for option in [schema, *schema.get("anyOf", [])]:
        if option.get("type") == "integer":
            return option["minimum"], option["maximum"]
    return None


def _integer_query_parameters(spec: dict[str, Any]) -> list[tuple[str, str, str, int, int]]:
    found = []
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            for parameter in operation.get("parameters", []):
                bounds = _integer_bounds(parameter["schema"])
                if parameter["in"] == "query" and bounds is not None:
                    found.append((method, path, parameter["name"], *bounds))
    return found


def _real_ids(service: Service) -> dict[str, str]:
    """One resource of each kind a GET with query parameters names."""
    endpoint = httpx.post(
        f"{service.url}/v1/webhook-endpoints",
        json={"url": ENDPOINT_URL},
        headers=service.headers(key="bounds-endpoint"),
    )
    assert endpoint.status_code in (200, 201), endpoint.text
    return {"endpoint_id": endpoint.json()["id"]}


def test_every_integer_query_parameter_at_and_past_its_bounds(bounded: Service) -> None:
    spec = httpx.get(f"{bounded.url}/openapi.json").json()
    parameters = _integer_query_parameters(spec)
    names = {(path, name) for _, path, name, *_ in parameters}
    # The ones the API has today; a new one is covered the moment it is declared.
    assert {
        ("/v1/webhook-endpoints/{endpoint_id}/deliveries", "limit"),
        ("/v1/webhook-endpoints/{endpoint_id}/deliveries", "starting_after"),
        ("/v1/ops/operations", "limit"),
    } <= names
    ids = _real_ids(bounded)
    for method, path, name, lowest, highest in parameters:
        assert method == "get", f"{method} {path}: only reads take integer query parameters"
        url = bounded.url + path.format(**ids)
        actor = "olive" if path.startswith("/v1/ops/") else "alice"
        headers = bounded.headers(actor)
        for value in (lowest, highest):
            answer = httpx.get(url, params={name: value}, headers=headers)
            assert answer.status_code == 200, f"{path}?{name}={value}: {answer.text}"
        before = bounded.snapshot()
        for value in (lowest - 1, highest + 1, 2**63, 10**30):
            answer = httpx.get(url, params={name: value}, headers=headers)
            assert_problem(answer, 422)
        assert bounded.snapshot() == before


def test_a_delivery_cursor_past_the_id_column_is_refused_not_a_500(bounded: Service) -> None:
    """The black-box pass's own case: 2^31 .. 2^62 were a 500 on PostgreSQL."""
    ids = _real_ids(bounded)
    url = f"{bounded.url}/v1/webhook-endpoints/{ids['endpoint_id']}/deliveries"
    for value in (2**31, 2**40, 2**62):
        body = assert_problem(
            httpx.get(url, params={"starting_after": value}, headers=bounded.headers()), 422
        )
        assert "starting_after" in json.dumps(body)
    within = httpx.get(url, params={"starting_after": 2**31 - 1}, headers=bounded.headers())
    assert within.status_code == 200 and within.json() == {"data": [], "has_more": False}


def _post_raw(service: Service, path: str, body: bytes, key: str) -> httpx.Response:
    headers = {**service.headers(key=key), "Content-Type": JSON}
    return httpx.post(f"{service.url}{path}", content=body, headers=headers)


def _payment(amount: str) -> bytes:
    return b'{"amount": %s, "currency": "EUR", "payment_method": "pm_ok"}' % amount.encode()


def test_a_whole_amount_written_with_a_fraction_is_that_integer(bounded: Service) -> None:
    first = _post_raw(bounded, "/v1/payments", _payment("1250.0"), "bounds-whole")
    assert first.status_code == 202, first.text
    assert first.json()["amount"] == 1250
    # The same request as 1250: an equal retry, replayed.
    again = _post_raw(bounded, "/v1/payments", json.dumps(PAYMENT).encode(), "bounds-whole")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    exponent = _post_raw(bounded, "/v1/payments", _payment("1.25e3"), "bounds-exponent")
    assert exponent.status_code == 202 and exponent.json()["amount"] == 1250
    mandate = _post_raw(
        bounded,
        "/v1/mandates",
        b'{"currency": "EUR", "max_amount": 500.0, "total_limit": 1e3}',
        "bounds-mandate",
    )
    assert mandate.status_code == 201, mandate.text
    assert (mandate.json()["max_amount"], mandate.json()["total_limit"]) == (500, 1000)


@pytest.mark.parametrize(
    "amount",
    ["12.5", "1250.00000000000001", "1e-3", "0.0", f"{MAX_AMOUNT + 1}.0", "1e40"],
)
def test_a_fractional_or_out_of_range_amount_is_refused(bounded: Service, amount: str) -> None:
    # 1250.00000000000001 is 1250.0 as a float: the exact text decides.
    before = bounded.snapshot()
    answer = _post_raw(bounded, "/v1/payments", _payment(amount), f"bounds-bad-{amount}")
    assert_problem(answer, 422)
    assert bounded.snapshot() == before


def test_the_largest_amounts_fit_their_columns(bounded: Service) -> None:
    payment = _post_raw(
        bounded, "/v1/payments", _payment(f"{MAX_AMOUNT}"), "bounds-largest-payment"
    )
    assert payment.status_code == 202 and payment.json()["amount"] == MAX_AMOUNT
    limits = {"currency": "EUR", "max_amount": MAX_AMOUNT, "total_limit": MAX_AMOUNT}
    mandate = _post_raw(bounded, "/v1/mandates", json.dumps(limits).encode(), "bounds-largest")
    assert mandate.status_code == 201, mandate.text
    assert mandate.json()["total_limit"] == MAX_AMOUNT
