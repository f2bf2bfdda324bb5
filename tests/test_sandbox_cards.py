"""Beneficiaries, cards and card freezes on the sandbox, over real HTTP on loopback: every
scenario, idempotency across endpoints, the truth, the request log, and old files upgraded."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from intentledger.providers.sandbox import create_sandbox_app
from intentledger.providers.sandbox.app import fingerprint
from tests.test_sandbox import eventually, serving

WITHHOLD = 0.6
HANG_UP = 0.2  # client timeout that gives up long before the withhold ends

KINDS = ["beneficiary", "card", "card_action"]
TRUTH = {"beneficiary": "/beneficiaries", "card": "/cards", "card_action": "/card_actions"}
IBAN = "GB82WEST12345698765432"


@pytest.fixture
def database_path(tmp_path: Path) -> str:
    return str(tmp_path / "sandbox.db")


class Sandboxes:
    """Sandbox servers on one database file, started on demand."""

    def __init__(self, database_path: str, stack: ExitStack) -> None:
        self._path = database_path
        self._stack = stack

    def start(self, key_retention: timedelta = timedelta(hours=24)) -> str:
        app = create_sandbox_app(self._path, key_retention, withhold_seconds=WITHHOLD)
        return self._stack.enter_context(serving(app))


@pytest.fixture
def sandboxes(database_path: str) -> Iterator[Sandboxes]:
    with ExitStack() as stack:
        yield Sandboxes(database_path, stack)


@pytest.fixture(scope="module")
def shared_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the tests that need nothing of their own: each writes under fresh
    references and keys, so they cannot see each other, and starting a server per test would
    cost more than the tests."""
    path = tmp_path_factory.mktemp("shared") / "sandbox.db"
    with serving(create_sandbox_app(str(path), timedelta(hours=24), WITHHOLD)) as url:
        yield url


@pytest.fixture
async def client(shared_url: str) -> Any:
    async with httpx.AsyncClient(base_url=shared_url, timeout=10) as client:
        yield client


# -- helpers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one kind of write goes; card actions need a card to act on."""

    kind: str
    path: str
    card_id: str | None = None


async def target_for(client: httpx.AsyncClient, kind: str) -> Target:
    if kind == "beneficiary":
        return Target(kind, "/v1/beneficiaries")
    if kind == "card":
        return Target(kind, "/v1/cards")
    card = await issue_card(client)
    return Target(kind, f"/v1/cards/{card['id']}/freeze", card["id"])


def body_for(kind: str, reference: str, scenario: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"reference": reference}
    if kind == "beneficiary":
        body |= {"name": "Ada Lovelace", "iban": IBAN}
    if kind == "card":
        body |= {"label": "travel"}
    if scenario is not None:
        body["sandbox_scenario"] = scenario
    return body


async def write(
    client: httpx.AsyncClient,
    target: Target,
    reference: str,
    scenario: str | None = None,
    key: str | None = None,
    client_timeout: float | None = None,
    overrides: dict[str, Any] | None = None,
) -> httpx.Response:
    headers = {"Idempotency-Key": key or f"key-{reference}"}
    body = {**body_for(target.kind, reference, scenario), **(overrides or {})}
    kwargs: dict[str, Any] = {} if client_timeout is None else {"timeout": client_timeout}
    return await client.post(target.path, json=body, headers=headers, **kwargs)


async def issue_card(client: httpx.AsyncClient, reference: str | None = None) -> dict[str, Any]:
    reference = reference or new_reference()
    response = await write(client, Target("card", "/v1/cards"), reference)
    assert response.status_code == 200
    card: dict[str, Any] = response.json()
    return card


async def data(client: httpx.AsyncClient, path: str, **params: str) -> list[dict[str, Any]]:
    response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["data"]
    return found


async def executed(client: httpx.AsyncClient, kind: str, reference: str) -> list[dict[str, Any]]:
    return await data(client, TRUTH[kind], reference=reference)


async def executed_once(client: httpx.AsyncClient, kind: str, reference: str) -> dict[str, Any]:
    """The one execution for `reference`, waiting for it: after a client gives up, the server
    may still be mid-transaction."""

    async def one() -> bool:
        return len(await executed(client, kind, reference)) == 1

    await eventually(one)
    [row] = await executed(client, kind, reference)
    return row


async def card_now(client: httpx.AsyncClient, card_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/cards/{card_id}")
    assert response.status_code == 200
    card: dict[str, Any] = response.json()
    return card


def new_reference() -> str:
    return f"op_{uuid.uuid4().hex}"


def parse_utc(text: str) -> datetime:
    assert text.endswith("Z")
    return datetime.fromisoformat(text)


def assert_answer_shape(target: Target, answer: dict[str, Any], reference: str) -> None:
    if target.kind == "beneficiary":
        assert set(answer) == {"id", "reference", "name", "iban", "status", "created_at"}
        assert re.fullmatch(r"ba_[0-9a-f]{24}", answer["id"])
        assert (answer["reference"], answer["name"], answer["iban"]) == (
            reference,
            "Ada Lovelace",
            IBAN,
        )
        assert answer["status"] == "active"
        parse_utc(answer["created_at"])
        return
    assert set(answer) == {"id", "reference", "label", "status", "created_at", "updated_at"}
    assert re.fullmatch(r"card_[0-9a-f]{24}", answer["id"])
    assert parse_utc(answer["updated_at"]) >= parse_utc(answer["created_at"])
    if target.kind == "card":
        assert (answer["reference"], answer["label"], answer["status"]) == (
            reference,
            "travel",
            "active",
        )
    else:
        # A card action answers with the card, which keeps the reference it was issued under.
        assert answer["id"] == target.card_id
        assert answer["reference"] != reference
        assert answer["status"] == "frozen"


def executed_id(target: Target, row: dict[str, Any]) -> str:
    """The id a write's answer carries for the execution `row` of the truth."""
    return str(row["card_id"] if target.kind == "card_action" else row["id"])


async def submits(client: httpx.AsyncClient, reference: str) -> list[dict[str, Any]]:
    return [
        r for r in await data(client, "/requests", reference=reference) if r["kind"] == "submit"
    ]


# -- every scenario, for each kind of write ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_ok_executes_once_and_a_retry_replays(client: httpx.AsyncClient, kind: str) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    first = await write(client, target, reference)
    assert first.status_code == 200
    assert "Idempotent-Replayed" not in first.headers
    assert_answer_shape(target, first.json(), reference)

    again = await write(client, target, reference)
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()

    [row] = await executed(client, kind, reference)
    assert executed_id(target, row) == first.json()["id"]
    assert row["idempotency_key"] == f"key-{reference}"
    logged = await submits(client, reference)
    assert [(r["resource"], r["response_status"]) for r in logged] == [(kind, 200), (kind, 200)]


@pytest.mark.parametrize("kind", KINDS)
async def test_declined_does_not_execute_and_is_kept_against_the_key(
    client: httpx.AsyncClient, kind: str
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    first = await write(client, target, reference, "declined")
    assert first.status_code == 422
    error = first.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "rejected")
    assert error["message"]

    again = await write(client, target, reference, "declined")
    assert again.status_code == 422
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await executed(client, kind, reference) == []
    if target.card_id is not None:
        assert (await card_now(client, target.card_id))["status"] == "active"


@pytest.mark.parametrize("kind", KINDS)
async def test_timeout_after_execute_withholds_the_executed_answer(
    client: httpx.AsyncClient, kind: str
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    started = time.monotonic()
    response = await write(client, target, reference, "timeout_after_execute")
    assert time.monotonic() - started >= WITHHOLD
    assert response.status_code == 200
    assert "Idempotent-Replayed" not in response.headers
    assert_answer_shape(target, response.json(), reference)
    assert len(await executed(client, kind, reference)) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_timeout_after_execute_hang_up_then_the_retry_replays(
    client: httpx.AsyncClient, kind: str
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    with pytest.raises(httpx.ReadTimeout):
        await write(client, target, reference, "timeout_after_execute", client_timeout=HANG_UP)
    row = await executed_once(client, kind, reference)

    # The retry is not delayed: it replays what executed, and executes nothing more.
    started = time.monotonic()
    retry = await write(client, target, reference, "timeout_after_execute")
    assert time.monotonic() - started < WITHHOLD
    assert retry.status_code == 200
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == executed_id(target, row)
    assert len(await executed(client, kind, reference)) == 1

    async def hang_up_recorded() -> bool:
        first, _ = await submits(client, reference)
        # NULL: the server noticed the hang-up and delivered no answer.
        return first["response_status"] is None

    await eventually(hang_up_recorded)


@pytest.mark.parametrize("kind", KINDS)
async def test_timeout_before_execute_withholds_then_the_retry_executes(
    client: httpx.AsyncClient, kind: str
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    started = time.monotonic()
    first = await write(client, target, reference, "timeout_before_execute")
    assert time.monotonic() - started >= WITHHOLD
    assert first.status_code == 504
    error = first.json()["error"]
    assert (error["type"], error["code"]) == ("api_error", "timeout")
    assert await executed(client, kind, reference) == []

    # Nothing was kept against the key, so the same key now runs afresh, like "ok".
    retry = await write(client, target, reference, "timeout_before_execute")
    assert retry.status_code == 200
    assert "Idempotent-Replayed" not in retry.headers
    assert_answer_shape(target, retry.json(), reference)
    assert len(await executed(client, kind, reference)) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_unknown_scenario_is_refused_and_not_kept(
    client: httpx.AsyncClient, kind: str
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    refused = await write(client, target, reference, "pm_declined")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "parameter_invalid")
    assert "sandbox_scenario" in error["message"]
    assert await executed(client, kind, reference) == []

    corrected = await write(client, target, reference, "ok")
    assert corrected.status_code == 200
    assert "Idempotent-Replayed" not in corrected.headers


async def test_first_attempt_is_per_kind_of_write_and_reference(
    client: httpx.AsyncClient,
) -> None:
    reference = new_reference()
    beneficiaries, cards = Target("beneficiary", "/v1/beneficiaries"), Target("card", "/v1/cards")
    assert (await write(client, beneficiaries, reference)).status_code == 200
    # A beneficiary under this reference is no earlier attempt at issuing a card under it...
    with pytest.raises(httpx.ReadTimeout):
        await write(
            client,
            cards,
            reference,
            "timeout_before_execute",
            key=f"k1-{reference}",
            client_timeout=HANG_UP,
        )
    # ...but a new key for the same reference is a later attempt of that card.
    later = await write(client, cards, reference, "timeout_before_execute", key=f"k2-{reference}")
    assert later.status_code == 200
    # Nor is any of it an earlier attempt of a charge under the same reference.
    charge = {"reference": reference, "amount": 100, "currency": "eur"}
    unavailable = await client.post(
        "/v1/charges",
        json={**charge, "payment_method": "pm_unavailable"},
        headers={"Idempotency-Key": f"k3-{reference}"},
    )
    assert unavailable.status_code == 503
    assert len(await executed(client, "card", reference)) == 1


# -- invalid requests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("beneficiary", {"name": ""}),
        ("beneficiary", {"name": "x" * 141}),
        ("beneficiary", {"name": 7}),
        ("beneficiary", {"iban": "GB82WEST1234"}),  # 8 after the check digits
        ("beneficiary", {"iban": "GB82" + "A" * 31}),
        ("beneficiary", {"iban": "G182WEST12345698765432"}),
        ("beneficiary", {"iban": "GBX2WEST12345698765432"}),
        ("beneficiary", {"iban": "GB82 WEST 1234 5698 7654 32"}),
        ("beneficiary", {"iban": IBAN + "\n"}),
        ("beneficiary", {"reference": ""}),
        ("card", {"label": "x" * 101}),
        ("card", {"label": 5}),
        ("card", {"reference": 5}),
        ("card_action", {"reference": None}),
        ("card_action", {"sandbox_scenario": 3}),
    ],
)
async def test_invalid_body_is_refused_and_not_kept(
    client: httpx.AsyncClient, kind: str, overrides: dict[str, Any]
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    response = await write(client, target, reference, overrides=overrides)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "parameter_invalid")
    assert await executed(client, kind, reference) == []
    assert (await write(client, target, reference)).status_code == 200


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("beneficiary", {"name": "x" * 140, "iban": "de89" + "3" * 11}),
        ("beneficiary", {"iban": "NL91" + "Ab1" * 10}),
        ("card", {"label": "x" * 100}),
        ("card", {"label": None}),
    ],
)
async def test_bounds_are_inclusive(
    client: httpx.AsyncClient, kind: str, overrides: dict[str, Any]
) -> None:
    target = await target_for(client, kind)
    response = await write(client, target, new_reference(), overrides=overrides)
    assert response.status_code == 200, response.text
    for name, value in overrides.items():
        assert response.json()[name] == value


async def test_card_without_a_label_has_a_null_label(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    response = await client.post(
        "/v1/cards", json={"reference": reference}, headers={"Idempotency-Key": f"key-{reference}"}
    )
    assert response.status_code == 200
    assert response.json()["label"] is None


@pytest.mark.parametrize("kind", KINDS)
async def test_missing_idempotency_key_is_refused_and_logged(
    client: httpx.AsyncClient, kind: str
) -> None:
    target = await target_for(client, kind)
    reference = new_reference()
    response = await client.post(target.path, json=body_for(kind, reference))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parameter_missing"
    assert await executed(client, kind, reference) == []
    [logged] = await submits(client, reference)
    assert (logged["resource"], logged["idempotency_key"], logged["response_status"]) == (
        kind,
        None,
        400,
    )


async def test_body_that_is_not_an_object_is_refused(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/beneficiaries",
        content=b'"hello"',
        headers={"Idempotency-Key": f"key-{new_reference()}"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parameter_invalid"


# -- idempotency ------------------------------------------------------------------------------


async def test_same_key_different_body_is_an_idempotency_error(
    client: httpx.AsyncClient,
) -> None:
    target = Target("beneficiary", "/v1/beneficiaries")
    reference = new_reference()
    assert (await write(client, target, reference)).status_code == 200
    conflicting = await write(client, target, reference, overrides={"name": "Someone Else"})
    assert conflicting.status_code == 400
    error = conflicting.json()["error"]
    assert (error["type"], error["code"]) == ("idempotency_error", "idempotency_key_reused")
    assert len(await executed(client, "beneficiary", reference)) == 1


ENDPOINTS = ["charge", "beneficiary", "card", "freeze_a", "freeze_b", "unfreeze_a"]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("charge", "beneficiary"),
        ("beneficiary", "charge"),
        ("beneficiary", "card"),
        ("card", "freeze_a"),  # the same body: only the route differs
        ("freeze_a", "freeze_b"),  # the same body on another card
        ("freeze_a", "unfreeze_a"),
    ],
)
async def test_a_key_reused_on_another_endpoint_is_an_idempotency_error(
    client: httpx.AsyncClient, first: str, second: str
) -> None:
    card_a, card_b = await issue_card(client), await issue_card(client)
    reference, key = new_reference(), f"shared-{uuid.uuid4().hex}"

    async def post(endpoint: str) -> httpx.Response:
        path, body = {
            "charge": (
                "/v1/charges",
                {"amount": 100, "currency": "eur", "payment_method": "pm_ok"},
            ),
            "beneficiary": ("/v1/beneficiaries", {"name": "Ada", "iban": IBAN}),
            "card": ("/v1/cards", {}),
            "freeze_a": (f"/v1/cards/{card_a['id']}/freeze", {}),
            "freeze_b": (f"/v1/cards/{card_b['id']}/freeze", {}),
            "unfreeze_a": (f"/v1/cards/{card_a['id']}/unfreeze", {}),
        }[endpoint]
        headers = {"Idempotency-Key": key}
        return await client.post(path, json={"reference": reference, **body}, headers=headers)

    assert (await post(first)).status_code == 200
    reused = await post(second)
    assert reused.status_code == 400
    error = reused.json()["error"]
    assert (error["type"], error["code"]) == ("idempotency_error", "idempotency_key_reused")
    # The first endpoint still replays its own answer.
    assert (await post(first)).headers["Idempotent-Replayed"] == "true"


async def test_key_reused_after_retention_creates_a_second_beneficiary(
    sandboxes: Sandboxes,
) -> None:
    retention = timedelta(seconds=0.5)
    target = Target("beneficiary", "/v1/beneficiaries")
    async with httpx.AsyncClient(base_url=sandboxes.start(retention), timeout=10) as client:
        reference = new_reference()
        first = await write(client, target, reference)
        await asyncio.sleep(retention.total_seconds() + 0.1)
        second = await write(client, target, reference)
        assert second.status_code == 200
        assert "Idempotent-Replayed" not in second.headers
        assert second.json()["id"] != first.json()["id"]
        found = await data(client, "/v1/beneficiaries", reference=reference)
        assert [b["id"] for b in found] == [first.json()["id"], second.json()["id"]]
        # The new use starts a new retention window: an immediate retry replays it.
        third = await write(client, target, reference)
        assert third.headers["Idempotent-Replayed"] == "true"
        assert third.json() == second.json()
        assert len(await executed(client, "beneficiary", reference)) == 2


async def test_concurrent_freezes_with_one_key_execute_once(sandboxes: Sandboxes) -> None:
    # Two servers on one file: the key check holds across them, not just within one.
    async with (
        httpx.AsyncClient(base_url=sandboxes.start(), timeout=10) as here,
        httpx.AsyncClient(base_url=sandboxes.start(), timeout=10) as there,
    ):
        card = await issue_card(here)
        target = Target("card_action", f"/v1/cards/{card['id']}/freeze", card["id"])
        reference = new_reference()
        clients = [here, there] * 10
        responses = await asyncio.gather(*(write(c, target, reference) for c in clients))
        assert {r.status_code for r in responses} == {200}
        assert len({r.text for r in responses}) == 1
        assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in responses) == 19
        assert len(await data(here, "/card_actions", card_id=card["id"])) == 1
        assert len(await submits(there, reference)) == 20


# -- cards: freeze, unfreeze, unknown cards ---------------------------------------------------


async def test_freeze_and_unfreeze_change_the_card_and_record_actions(
    client: httpx.AsyncClient,
) -> None:
    issued_under = new_reference()
    card = await issue_card(client, issued_under)
    assert await card_now(client, card["id"]) == card
    frozen_by, unfrozen_by = new_reference(), new_reference()
    freeze = Target("card_action", f"/v1/cards/{card['id']}/freeze", card["id"])
    unfreeze = Target("card_action", f"/v1/cards/{card['id']}/unfreeze", card["id"])

    frozen = await write(client, freeze, frozen_by)
    assert frozen.status_code == 200
    assert frozen.json()["status"] == "frozen"
    assert await card_now(client, card["id"]) == frozen.json()
    assert parse_utc(frozen.json()["updated_at"]) > parse_utc(card["updated_at"])

    active = await write(client, unfreeze, unfrozen_by)
    assert active.json()["status"] == "active"
    assert await card_now(client, card["id"]) == active.json()
    [truth] = await data(client, "/cards", reference=issued_under)
    assert truth == {**active.json(), "idempotency_key": f"key-{issued_under}"}

    actions = await data(client, "/card_actions", card_id=card["id"])
    assert [(a["action"], a["reference"], a["idempotency_key"]) for a in actions] == [
        ("freeze", frozen_by, f"key-{frozen_by}"),
        ("unfreeze", unfrozen_by, f"key-{unfrozen_by}"),
    ]
    assert all(re.fullmatch(r"ca_[0-9a-f]+", a["id"]) for a in actions)
    assert actions[0]["executed_at"] == frozen.json()["updated_at"]
    assert [a["action"] for a in await data(client, "/card_actions", reference=unfrozen_by)] == [
        "unfreeze"
    ]

    # A replay answers what the freeze answered then, not the card as it is now.
    replay = await write(client, freeze, frozen_by)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json() == frozen.json()
    assert (await card_now(client, card["id"]))["status"] == "active"
    assert len(await data(client, "/card_actions", card_id=card["id"])) == 2


async def test_freezing_a_frozen_card_with_a_new_key_is_a_second_action(
    client: httpx.AsyncClient,
) -> None:
    card = await issue_card(client)
    freeze = Target("card_action", f"/v1/cards/{card['id']}/freeze", card["id"])
    reference = new_reference()
    await write(client, freeze, reference, key=f"first-{reference}")
    again = await write(client, freeze, reference, key=f"second-{reference}")
    assert again.status_code == 200
    assert again.json()["status"] == "frozen"
    assert len(await data(client, "/card_actions", card_id=card["id"])) == 2


@pytest.mark.parametrize("action", ["freeze", "unfreeze"])
async def test_unknown_card_is_missing_not_executed_and_not_kept(
    client: httpx.AsyncClient, action: str
) -> None:
    reference = new_reference()
    missing = Target("card_action", f"/v1/cards/card_nope/{action}")
    started = time.monotonic()
    # Even a timeout scenario answers at once: the card is checked before any fault.
    response = await write(client, missing, reference, "timeout_before_execute")
    assert time.monotonic() - started < WITHHOLD
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "type": "invalid_request_error",
            "code": "resource_missing",
            "message": "No such card: 'card_nope'",
        }
    }
    assert await data(client, "/card_actions", reference=reference) == []

    # Nothing was kept against the key: it is free for the same action on a real card.
    card = await issue_card(client)
    real = Target("card_action", f"/v1/cards/{card['id']}/{action}", card["id"])
    done = await write(client, real, reference)
    assert done.status_code == 200
    assert "Idempotent-Replayed" not in done.headers


async def test_retrieving_an_unknown_card_is_missing(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/cards/card_nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "resource_missing")


# -- reads ------------------------------------------------------------------------------------


async def test_lookups_by_reference(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    assert (await client.get("/v1/beneficiaries", params={"reference": reference})).json() == {
        "data": []
    }
    assert (await client.get("/v1/cards", params={"reference": reference})).json() == {"data": []}

    beneficiaries = Target("beneficiary", "/v1/beneficiaries")
    beneficiary = await write(client, beneficiaries, reference, key=f"ben-{reference}")
    first = await issue_card(client, reference)
    second = (
        await write(client, Target("card", "/v1/cards"), reference, key=f"card-{reference}")
    ).json()
    freeze = Target("card_action", f"/v1/cards/{second['id']}/freeze", second["id"])
    frozen = (await write(client, freeze, new_reference())).json()

    assert await data(client, "/v1/beneficiaries", reference=reference) == [beneficiary.json()]
    # Cards with their current status, in the order they were issued.
    assert await data(client, "/v1/cards", reference=reference) == [first, frozen]


@pytest.mark.parametrize("path", ["/v1/beneficiaries", "/v1/cards"])
async def test_lookup_without_a_reference_is_refused(client: httpx.AsyncClient, path: str) -> None:
    response = await client.get(path)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parameter_missing"


async def test_truth_lists_everything_in_time_order(sandboxes: Sandboxes) -> None:
    async with httpx.AsyncClient(base_url=sandboxes.start(), timeout=10) as client:
        await check_truth_order(client)


async def check_truth_order(client: httpx.AsyncClient) -> None:
    a, b = new_reference(), new_reference()
    beneficiaries = Target("beneficiary", "/v1/beneficiaries")
    await write(client, beneficiaries, a)
    await write(client, beneficiaries, b)
    await write(client, beneficiaries, a, key="another-key")
    everything = await data(client, "/beneficiaries")
    assert [row["reference"] for row in everything] == [a, b, a]
    times = [parse_utc(row["created_at"]) for row in everything]
    assert times == sorted(times)
    assert [
        row["idempotency_key"] for row in await data(client, "/beneficiaries", reference=a)
    ] == [
        f"key-{a}",
        "another-key",
    ]
    cards = [await issue_card(client) for _ in range(3)]
    assert [c["id"] for c in await data(client, "/cards")] == [c["id"] for c in cards]


# -- the request log --------------------------------------------------------------------------


async def test_request_log_names_the_resource_of_every_request(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    await client.post(
        "/v1/charges",
        json={"reference": reference, "amount": 100, "currency": "eur", "payment_method": "pm_ok"},
        headers={"Idempotency-Key": f"charge-{reference}"},
    )
    await write(
        client, Target("beneficiary", "/v1/beneficiaries"), reference, key=f"ben-{reference}"
    )
    card = await issue_card(client, reference)
    freeze = Target("card_action", f"/v1/cards/{card['id']}/freeze", card["id"])
    await write(client, freeze, reference, "declined", key=f"freeze-{reference}")
    await client.get("/v1/charges", params={"reference": reference})
    await client.get("/v1/beneficiaries", params={"reference": reference})
    await client.get("/v1/cards", params={"reference": reference})
    await client.get(f"/v1/cards/{card['id']}")

    logged = await data(client, "/requests", reference=reference)
    assert [(r["resource"], r["kind"], r["response_status"]) for r in logged] == [
        ("charge", "submit", 200),
        ("beneficiary", "submit", 200),
        ("card", "submit", 200),
        ("card_action", "submit", 422),
        ("charge", "lookup", 200),
        ("beneficiary", "lookup", 200),
        ("card", "lookup", 200),
    ]
    freeze_logged = logged[3]
    assert (freeze_logged["card_id"], freeze_logged["sandbox_scenario"]) == (card["id"], "declined")
    assert logged[0]["payment_method"] == "pm_ok"

    # A card fetched by id has no reference; it is found by resource and card_id.
    by_id = [r for r in await data(client, "/requests", resource="card") if r["reference"] is None]
    assert [(r["kind"], r["response_status"]) for r in by_id if r["card_id"] == card["id"]] == [
        ("lookup", 200)
    ]


# -- an old sandbox file ----------------------------------------------------------------------

# The schema as the first release of the sandbox wrote it, before any of this existed.
OLD_SCHEMA = """
CREATE TABLE charges (
    id TEXT PRIMARY KEY, reference TEXT NOT NULL, idempotency_key TEXT NOT NULL,
    amount INTEGER NOT NULL, currency TEXT NOT NULL, payment_method TEXT NOT NULL,
    executed_at TEXT NOT NULL
);
CREATE INDEX charges_by_reference ON charges (reference);
CREATE TABLE idempotency_keys (
    key TEXT PRIMARY KEY, first_used_at TEXT NOT NULL, request_fingerprint TEXT NOT NULL,
    response_status INTEGER NOT NULL, response_body TEXT NOT NULL
);
CREATE TABLE requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('submit', 'lookup')),
    reference TEXT, idempotency_key TEXT, payment_method TEXT,
    received_at TEXT NOT NULL, response_status INTEGER
);
CREATE INDEX requests_by_reference ON requests (reference, kind);
"""


def write_old_sandbox_file(path: str, charged: str, refused: str) -> dict[str, Any]:
    """An old file holding one executed charge (with its kept key) and one 503'd submit."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    body = {"reference": charged, "amount": 500, "currency": "eur", "payment_method": "pm_ok"}
    answer = {**body, "id": "ch_old", "status": "succeeded", "executed_at": now}
    del answer["payment_method"]
    conn = sqlite3.connect(path)
    with conn:
        conn.executescript(OLD_SCHEMA)
        conn.execute(
            "INSERT INTO charges VALUES ('ch_old', ?, 'old-key', 500, 'eur', 'pm_ok', ?)",
            (charged, now),
        )
        conn.execute(
            "INSERT INTO idempotency_keys VALUES ('old-key', ?, ?, 200, ?)",
            (now, fingerprint(body), json.dumps(answer)),
        )
        conn.executemany(
            "INSERT INTO requests (kind, reference, idempotency_key, payment_method,"
            " received_at, response_status) VALUES ('submit', ?, ?, ?, ?, ?)",
            [
                (charged, "old-key", "pm_ok", now, 200),
                (refused, "k-503", "pm_unavailable", now, 503),
            ],
        )
    conn.close()
    return {"body": body, "answer": answer}


def request_columns(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[1] for row in conn.execute("PRAGMA table_info(requests)")]
    finally:
        conn.close()


async def test_an_old_sandbox_file_is_upgraded_in_place(
    sandboxes: Sandboxes, database_path: str
) -> None:
    charged, refused = new_reference(), new_reference()
    old = write_old_sandbox_file(database_path, charged, refused)

    async with httpx.AsyncClient(base_url=sandboxes.start(), timeout=10) as client:
        [old_row] = await data(client, "/requests", reference=charged)
        assert (old_row["resource"], old_row["kind"], old_row["idempotency_key"]) == (
            "charge",
            "submit",
            "old-key",
        )
        assert (old_row["sandbox_scenario"], old_row["card_id"]) == (None, None)

        # A key kept before the upgrade still replays: charges' fingerprints did not change.
        replay = await client.post(
            "/v1/charges", json=old["body"], headers={"Idempotency-Key": "old-key"}
        )
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.json() == old["answer"]
        # An old submit still counts as the first attempt of its charge.
        retry = await client.post(
            "/v1/charges",
            json={
                "reference": refused,
                "amount": 1,
                "currency": "eur",
                "payment_method": "pm_unavailable",
            },
            headers={"Idempotency-Key": "k-503"},
        )
        assert retry.status_code == 200

        target = Target("beneficiary", "/v1/beneficiaries")
        assert (await write(client, target, charged)).status_code == 200
        logged = await data(client, "/requests", reference=charged)
        assert [r["resource"] for r in logged] == ["charge", "charge", "beneficiary"]

    columns = request_columns(database_path)
    assert columns[-3:] == ["resource", "sandbox_scenario", "card_id"]
    # Opening the upgraded file again neither fails nor adds anything.
    async with httpx.AsyncClient(base_url=sandboxes.start(), timeout=10) as client:
        assert len(await data(client, "/requests", reference=charged)) == 3
        assert (await issue_card(client))["status"] == "active"
    assert request_columns(database_path) == columns
