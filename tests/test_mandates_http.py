"""Mandates over real HTTP (`serve --no-workers`), then a worker that must move no money."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from intentledger.ports import free_port
from tests.support import Process, wait_until
from tests.test_intake_http import create_key


@dataclass
class Api:
    url: str
    database_url: str
    workdir: Path
    headers: dict[str, str]
    other: dict[str, str]

    def post(self, path: str, body: Any, key: str | None, who: str = "me") -> httpx.Response:
        headers = dict(self.headers if who == "me" else self.other)
        if key is not None:
            headers["Idempotency-Key"] = key
        return httpx.post(f"{self.url}{path}", json=body, headers=headers)

    def get(self, path: str, who: str = "me") -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.headers if who == "me" else self.other)


@pytest.fixture
def api(database_url: str, tmp_path: Path) -> Iterator[Api]:
    port = free_port()
    proc = Process(
        [
            "serve",
            "--no-workers",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--sandbox-database",
            str(tmp_path / "sandbox.db"),
        ],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_healthy(url + "/healthz")
        yield Api(
            url,
            database_url,
            tmp_path,
            {"Authorization": f"Bearer {create_key(database_url, 'mia')}"},
            {"Authorization": f"Bearer {create_key(database_url, 'noah')}"},
        )
    finally:
        proc.stop()


def mandate(api: Api, key: str, total: int = 1000, largest: int = 400) -> dict[str, Any]:
    response = api.post(
        "/v1/mandates", {"currency": "EUR", "max_amount": largest, "total_limit": total}, key
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def pay(api: Api, mandate_id: str, amount: int, key: str, currency: str = "EUR") -> httpx.Response:
    body = {
        "amount": amount,
        "currency": currency,
        "payment_method": "pm_ok",
        "mandate_id": mandate_id,
    }
    return api.post("/v1/payments", body, key)


def test_suspension_cancels_queued_payments_and_a_later_worker_moves_no_money(api: Api) -> None:
    md = mandate(api, "md-1")
    assert (md["status"], md["reserved"], md["spent"]) == ("active", 0, 0)
    first = pay(api, md["id"], 300, "p-1")
    second = pay(api, md["id"], 400, "p-2")
    assert (first.status_code, second.status_code) == (202, 202)
    over = pay(api, md["id"], 400, "p-3")  # 300 + 400 + 400 > 1000
    assert over.status_code == 422 and over.json()["type"].endswith("mandate-limit")
    assert api.get(f"/v1/mandates/{md['id']}").json()["reserved"] == 700
    for response in (first, second):
        assert api.get(f"/v1/operations/{response.json()['id']}").json()["state"] == "ACCEPTED"

    suspended = api.post(f"/v1/mandates/{md['id']}/suspend", None, "s-1")
    assert suspended.status_code == 200
    assert (suspended.json()["status"], suspended.json()["reserved"]) == ("suspended", 0)
    for response in (first, second):
        op = api.get(f"/v1/operations/{response.json()['id']}").json()
        assert (op["state"], op["next_action"]) == ("CANCELLED", "none")
    replay = pay(api, md["id"], 300, "p-1")
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert (replay.json()["id"], replay.json()["state"]) == (first.json()["id"], "CANCELLED")

    sandbox = f"{api.url}/_sandbox"
    worker = Process(
        ["worker", "--database-url", api.database_url, "--provider-url", sandbox],
        {},
        api.workdir / "worker.log",
    )
    try:
        wait_until(lambda: "started" in worker.output(), 30, "the worker to start")
        asyncio.run(asyncio.sleep(2.0))  # several polls of an empty outbox
    finally:
        worker.stop()
    assert httpx.get(f"{sandbox}/requests").json()["data"] == []
    assert httpx.get(f"{sandbox}/charges").json()["data"] == []


def test_mandate_rules_and_refusals_write_nothing(api: Api) -> None:
    md = mandate(api, "md-rules")
    replay = api.post(
        "/v1/mandates", {"currency": "EUR", "max_amount": 400, "total_limit": 1000}, "md-rules"
    )
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json()["id"] == md["id"]
    assert (
        api.post(
            "/v1/mandates", {"currency": "EUR", "max_amount": 1, "total_limit": 1000}, "md-rules"
        ).status_code
        == 409
    )
    assert (
        api.post(
            "/v1/mandates", {"currency": "EUR", "max_amount": 5, "total_limit": 4}, "md-bad"
        ).status_code
        == 422
    )
    assert (
        api.post(
            "/v1/mandates", {"currency": "EUR", "max_amount": 5, "total_limit": 9}, None
        ).status_code
        == 400
    )
    assert api.get(f"/v1/mandates/{md['id']}", who="other").status_code == 404
    assert pay(api, md["id"], 401, "too-big").status_code == 422
    assert pay(api, md["id"], 100, "wrong-currency", currency="USD").status_code == 422
    # A refused request is not stored against its key: a corrected retry is a first request.
    assert pay(api, md["id"], 100, "too-big").status_code == 202
    other_mandate = api.post(
        "/v1/payments",
        {"amount": 1, "currency": "EUR", "payment_method": "pm_ok", "mandate_id": md["id"]},
        "x",
        who="other",
    )
    assert other_mandate.status_code == 422

    assert api.post(f"/v1/mandates/{md['id']}/resume", None, "r-0").status_code == 409
    assert api.post(f"/v1/mandates/{md['id']}/suspend", None, "s-0").status_code == 200
    assert pay(api, md["id"], 100, "while-suspended").status_code == 409
    assert (
        api.post(f"/v1/mandates/{md['id']}/suspend", None, "s-0").headers["idempotent-replayed"]
        == "true"
    )
    assert api.post(f"/v1/mandates/{md['id']}/resume", None, "r-1").json()["status"] == "active"
    assert api.post(f"/v1/mandates/{md['id']}/revoke", None, "v-1").json()["status"] == "revoked"
    assert api.post(f"/v1/mandates/{md['id']}/resume", None, "r-2").status_code == 409
    assert pay(api, md["id"], 100, "after-revoke").status_code == 409
    assert api.post("/v1/mandates/md_nope/suspend", None, "s-x").status_code == 404


def test_concurrent_intakes_never_reserve_more_than_the_limit(api: Api) -> None:
    md = mandate(api, "md-race", total=1000, largest=100)

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=30) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/payments",
                        json={
                            "amount": 100,
                            "currency": "EUR",
                            "payment_method": "pm_ok",
                            "mandate_id": md["id"],
                        },
                        headers={"Idempotency-Key": f"flood-{i}"},
                    )
                    for i in range(32)
                )
            )

    statuses = sorted(r.status_code for r in asyncio.run(flood()))
    assert statuses == [202] * 10 + [422] * 22
    assert api.get(f"/v1/mandates/{md['id']}").json()["reserved"] == 1000


def test_concurrent_equal_retries_under_a_mandate_replay_instead_of_refusing(api: Api) -> None:
    md = mandate(api, "md-retry", total=100, largest=100)

    async def retries() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=30) as client:
            body = {
                "amount": 100,
                "currency": "EUR",
                "payment_method": "pm_ok",
                "mandate_id": md["id"],
            }
            return await asyncio.gather(
                *(
                    client.post("/v1/payments", json=body, headers={"Idempotency-Key": "same"})
                    for _ in range(20)
                )
            )

    responses = asyncio.run(retries())
    # The retries wait for the first request's key, then replay it: none is
    # judged against the reservation the first one made.
    assert sorted(r.status_code for r in responses) == [200] * 19 + [202]
    assert len({r.json()["id"] for r in responses}) == 1
    assert api.get(f"/v1/mandates/{md['id']}").json()["reserved"] == 100
