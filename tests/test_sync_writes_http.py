"""Beneficiaries and cards: provider writes in the request path, honest when the answer is lost."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx

from intentledger.ports import free_port
from tests.served import Served
from tests.support import Process, wait_until
from tests.test_intake_http import create_key

IBAN = "DE89 3704 0044 0532 0130 00"


def post(served: Served, path: str, body: dict[str, Any], key: str | None) -> httpx.Response:
    headers = dict(served.auth)
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{served.url}{path}", json=body, headers=headers, timeout=30)


def card(served: Served, card_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{served.url}/v1/cards/{card_id}", headers=served.auth).json()
    return body


def truth(served: Served, what: str, **params: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = httpx.get(f"{served.url}/_sandbox/{what}", params=params).json()[
        "data"
    ]
    return data


def test_beneficiary_outcomes(served: Served) -> None:
    ok = post(served, "/v1/beneficiaries", {"name": "Ada Lovelace", "iban": IBAN}, "b-ok")
    assert ok.status_code == 201, ok.text
    assert (ok.json()["state"], ok.json()["outcome"]) == ("OUTCOME_KNOWN", "succeeded")
    assert ok.json()["provider_reference"].startswith("ba_")
    replay = post(served, "/v1/beneficiaries", {"name": "Ada Lovelace", "iban": IBAN}, "b-ok")
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"

    declined = post(
        served,
        "/v1/beneficiaries",
        {"name": "Bob", "iban": IBAN, "sandbox_scenario": "declined"},
        "b-no",
    )
    assert declined.status_code == 201
    assert (declined.json()["state"], declined.json()["outcome"]) == ("OUTCOME_KNOWN", "failed")

    lost = post(
        served,
        "/v1/beneficiaries",
        {"name": "Cy", "iban": IBAN, "sandbox_scenario": "timeout_after_execute"},
        "b-lost",
    )
    assert lost.status_code == 202, lost.text
    assert (lost.json()["state"], lost.json()["outcome"]) == ("UNKNOWN", None)
    op_id = lost.json()["id"]
    settled = served.settle(op_id, {"OUTCOME_KNOWN"})
    assert (settled["outcome"], settled["reconciliation_status"]) == (
        "succeeded",
        "found_succeeded",
    )
    assert len(truth(served, "beneficiaries", reference=op_id)) == 1

    for body, status in (
        ({"name": "x", "iban": "DE00 3704 0044 0532 0130 00"}, 422),  # bad check digits
        ({"name": "x", "iban": "not an iban"}, 422),
        ({"name": "", "iban": IBAN}, 422),
        ({"name": "x", "iban": IBAN, "sandbox_scenario": "explode"}, 422),
        ({"name": "x", "iban": IBAN, "extra": 1}, 422),
    ):
        response = post(served, "/v1/beneficiaries", body, f"b-bad-{status}-{len(str(body))}")
        assert response.status_code == status, (body, response.text)
    assert post(served, "/v1/beneficiaries", {"name": "x", "iban": IBAN}, None).status_code == 400


async def test_an_equal_retry_while_the_original_waits_is_409_then_replays(
    served: Served,
) -> None:
    """Eight card requests with one key while the first waits on a provider that
    withholds its answer: the seven others get 409 request-in-progress with a
    Retry-After, never a half-made state; once the first has answered (UNKNOWN,
    after the sync timeout), an equal retry replays it."""
    body = {"label": "in flight", "sandbox_scenario": "timeout_after_execute"}
    headers = {**served.auth, "Idempotency-Key": "c-in-flight"}
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
        first = asyncio.create_task(client.post("/v1/cards", json=body, headers=headers))
        await asyncio.sleep(0.5)  # the first is now waiting on the provider
        others = await asyncio.gather(
            *(client.post("/v1/cards", json=body, headers=headers) for _ in range(7))
        )
        original = await first
        replay = await client.post("/v1/cards", json=body, headers=headers)
    for response in others:
        assert response.status_code == 409, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert response.json()["type"].endswith("/request-in-progress")
        assert response.headers["retry-after"] == "1"
    assert original.status_code == 202, original.text
    assert original.json()["operation"]["state"] == "UNKNOWN"
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json()["id"] == original.json()["id"]


def test_lost_card_freeze_is_indeterminate_until_reconciled(served: Served) -> None:
    issued = post(served, "/v1/cards", {"label": "travel"}, "c-issue")
    assert issued.status_code == 201, issued.text
    card_id = issued.json()["id"]
    assert (issued.json()["status"], issued.json()["indeterminate"]) == ("active", False)

    frozen = post(
        served,
        f"/v1/cards/{card_id}/freeze",
        {"sandbox_scenario": "timeout_after_execute"},
        "c-freeze",
    )
    assert frozen.status_code == 202, frozen.text
    op = frozen.json()["operation"]
    assert (op["state"], op["outcome"]) == ("UNKNOWN", None)
    now = card(served, card_id)
    assert (now["indeterminate"], now["pending_operation_id"], now["status"]) == (
        True,
        op["id"],
        "active",
    )
    busy = post(served, f"/v1/cards/{card_id}/unfreeze", {}, "c-busy")
    assert busy.status_code == 409

    served.settle(op["id"], {"OUTCOME_KNOWN"})
    now = card(served, card_id)
    assert (now["status"], now["indeterminate"], now["pending_operation_id"]) == (
        "frozen",
        False,
        None,
    )
    assert len(truth(served, "card_actions", card_id=issued.json()["provider_card_id"])) == 1
    assert post(served, f"/v1/cards/{card_id}/freeze", {}, "c-again").status_code == 409
    thawed = post(served, f"/v1/cards/{card_id}/unfreeze", {}, "c-thaw")
    assert thawed.status_code == 201 and thawed.json()["status"] == "active"
    assert httpx.get(f"{served.url}/v1/cards/crd_nope", headers=served.auth).status_code == 404
    assert (
        httpx.get(f"{served.url}/v1/cards/{card_id}", headers=served.operator_auth).status_code
        == 404
    )  # another actor's card


def test_api_killed_mid_call_leaves_submitting_which_the_sweeper_makes_unknown(
    database_url: str, tmp_path: Path
) -> None:
    sandbox_port, api_port = free_port(), free_port()
    sandbox_url = f"http://127.0.0.1:{sandbox_port}/_sandbox"
    sandbox = Process(
        [
            "sandbox",
            "--port",
            str(sandbox_port),
            "--sandbox-database",
            str(tmp_path / "sandbox.db"),
        ],
        {},
        tmp_path / "sandbox.log",
    )
    api_args = [
        "serve",
        "--no-workers",
        "--port",
        str(api_port),
        "--database-url",
        database_url,
        "--provider-url",
        sandbox_url,
        "--sync-timeout",
        "30s",
        "--sandbox-database",
        str(tmp_path / "unused.db"),
    ]
    api = Process(api_args, {}, tmp_path / "api.log")
    url = f"http://127.0.0.1:{api_port}"
    auth = {"Authorization": f"Bearer {create_key(database_url, 'kim')}"}
    worker = None
    try:
        sandbox.wait_healthy(sandbox_url + "/healthz")
        api.wait_healthy(url + "/healthz")
        issued = httpx.post(f"{url}/v1/cards", json={}, headers={**auth, "Idempotency-Key": "k1"})
        card_id = issued.json()["id"]
        provider_card = issued.json()["provider_card_id"]
        # The sandbox withholds this answer and executes nothing; we stop waiting.
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/cards/{card_id}/freeze",
                json={"sandbox_scenario": "timeout_before_execute"},
                headers={**auth, "Idempotency-Key": "k2"},
                timeout=0.5,
            )

        def freeze_reached_provider() -> bool:
            log = httpx.get(f"{sandbox_url}/requests").json()["data"]
            return any(r["resource"] == "card_action" for r in log)

        wait_until(freeze_reached_provider, 20, "the freeze to reach the sandbox")
        api.kill()

        worker = Process(
            [
                "worker",
                "--database-url",
                database_url,
                "--provider-url",
                sandbox_url,
                "--stale-submitting",
                "2s",
                "--submit-timeout",
                "1s",
                "--sync-timeout",
                "1s",
                "--recheck-backoff",
                "1h",
            ],
            {"INTENTLEDGER_SWEEP_INTERVAL": "500ms"},
            tmp_path / "worker.log",
        )
        deadline = time.monotonic() + 30
        while True:
            api_state = _operation_state(database_url, card_id)
            if api_state == "UNKNOWN":
                break
            assert api_state == "SUBMITTING" and time.monotonic() < deadline, api_state
            time.sleep(0.2)
        time.sleep(1.0)
        actions = [
            r
            for r in httpx.get(f"{sandbox_url}/requests").json()["data"]
            if r["resource"] == "card_action" and r["kind"] == "submit"
        ]
        assert len(actions) == 1  # the sweeper never calls the provider
        assert (
            httpx.get(f"{sandbox_url}/card_actions", params={"card_id": provider_card}).json()[
                "data"
            ]
            == []
        )
    finally:
        for proc in (worker, api, sandbox):
            if proc is not None:
                proc.stop()


def _operation_state(database_url: str, card_id: str) -> str:
    from sqlalchemy import select

    from intentledger.store.database import create_sync_engine
    from intentledger.store.tables import cards, operations

    engine = create_sync_engine(database_url)
    try:
        with engine.connect() as conn:
            pending = conn.execute(
                select(cards.c.pending_operation_id).where(cards.c.card_id == card_id)
            ).scalar_one()
            return str(
                conn.execute(
                    select(operations.c.state).where(operations.c.operation_id == pending)
                ).scalar_one()
            )
    finally:
        engine.dispose()
