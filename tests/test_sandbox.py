"""The sandbox provider over real HTTP on loopback: every scenario, idempotency, durability."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from intentledger.providers.sandbox import create_sandbox_app

WITHHOLD = 1.0
LOOKUP_LAG = 1.0
SLOW = 0.3
HANG_UP = 0.3  # client timeout that gives up long before the withhold ends

StartSandbox = Callable[..., str]


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Run `app` mounted at /_sandbox under uvicorn on a free loopback port."""
    outer = FastAPI()
    outer.mount("/_sandbox", app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(outer, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.started:
        assert time.monotonic() < deadline, "sandbox server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/_sandbox"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


@pytest.fixture
def database_path(tmp_path: Path) -> str:
    return str(tmp_path / "sandbox.db")


@pytest.fixture
def start_sandbox(database_path: str) -> Iterator[StartSandbox]:
    """Start a sandbox server (any number of them) on the test's database file."""
    with ExitStack() as stack:

        def start(key_retention: timedelta = timedelta(hours=24), **timing: Any) -> str:
            options: dict[str, Any] = {
                "withhold_seconds": WITHHOLD,
                "lookup_lag_seconds": LOOKUP_LAG,
                "slow_seconds": SLOW,
                **timing,
            }
            app = create_sandbox_app(database_path, key_retention, **options)
            return stack.enter_context(serving(app))

        yield start


@pytest.fixture
def base_url(start_sandbox: StartSandbox) -> str:
    return start_sandbox()


@pytest.fixture
async def client(base_url: str) -> Any:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        yield client


def charge_body(payment_method: str, reference: str, amount: int = 1250) -> dict[str, Any]:
    return {
        "reference": reference,
        "amount": amount,
        "currency": "eur",
        "payment_method": payment_method,
        "description": "test charge",
        "metadata": {"order": "42"},
    }


async def submit(
    client: httpx.AsyncClient,
    payment_method: str,
    reference: str,
    key: str | None = None,
    client_timeout: float | None = None,
    **overrides: Any,
) -> httpx.Response:
    headers = {"Idempotency-Key": key or f"key-{reference}"}
    body = {**charge_body(payment_method, reference), **overrides}
    kwargs: dict[str, Any] = {} if client_timeout is None else {"timeout": client_timeout}
    return await client.post("/v1/charges", json=body, headers=headers, **kwargs)


async def truth(client: httpx.AsyncClient, reference: str | None = None) -> list[dict[str, Any]]:
    params = {} if reference is None else {"reference": reference}
    response = await client.get("/charges", params=params)
    assert response.status_code == 200
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def received(client: httpx.AsyncClient, reference: str) -> list[dict[str, Any]]:
    response = await client.get("/requests", params={"reference": reference})
    assert response.status_code == 200
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def executed_once(client: httpx.AsyncClient, reference: str) -> dict[str, Any]:
    """The one charge for `reference`, waiting for it: after a client gives up, the server may
    still be mid-transaction."""

    async def one_charge() -> bool:
        return len(await truth(client, reference)) == 1

    await eventually(one_charge)
    [charge] = await truth(client, reference)
    return charge


async def lookup(client: httpx.AsyncClient, reference: str) -> httpx.Response:
    return await client.get("/v1/charges", params={"reference": reference})


def new_reference() -> str:
    return f"op_{uuid.uuid4().hex}"


def parse_utc(text: str) -> datetime:
    assert text.endswith("Z") or text.endswith("+00:00")
    return datetime.fromisoformat(text)


async def eventually(check: Callable[[], Any], within: float = 2.0) -> None:
    """Await `check()` until it is truthy; the server notices hang-ups on its own clock."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.05)


# -- plain outcomes ---------------------------------------------------------------------------


async def test_healthz(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_ok_executes_and_answers_with_the_charge(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    response = await submit(client, "pm_ok", reference)
    assert response.status_code == 200
    assert "Idempotent-Replayed" not in response.headers
    charge = response.json()
    assert charge["id"].startswith("ch_")
    assert charge["reference"] == reference
    assert charge["status"] == "succeeded"
    assert (charge["amount"], charge["currency"]) == (1250, "eur")
    parse_utc(charge["executed_at"])

    [executed] = await truth(client, reference)
    assert executed["idempotency_key"] == f"key-{reference}"
    assert executed["executed_at"] == charge["executed_at"]
    [logged] = await received(client, reference)
    assert logged["kind"] == "submit"
    assert logged["payment_method"] == "pm_ok"
    assert logged["response_status"] == 200
    parse_utc(logged["received_at"])


async def test_declined_does_not_execute_and_is_kept_against_the_key(
    client: httpx.AsyncClient,
) -> None:
    reference = new_reference()
    first = await submit(client, "pm_declined", reference)
    assert first.status_code == 402
    assert first.json()["error"]["type"] == "card_error"
    assert first.json()["error"]["code"] == "card_declined"

    again = await submit(client, "pm_declined", reference)
    assert again.status_code == 402
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await truth(client, reference) == []


async def test_unknown_payment_method_is_a_kept_refusal(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    first = await submit(client, "pm_nonsense", reference)
    assert first.status_code == 400
    assert first.json()["error"] == {
        "type": "invalid_request_error",
        "code": "resource_missing",
        "message": "No such payment_method",
    }
    again = await submit(client, "pm_nonsense", reference)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await truth(client, reference) == []


async def test_slow_answers_late_but_answers(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    started = time.monotonic()
    response = await submit(client, "pm_slow", reference)
    assert response.status_code == 200
    assert time.monotonic() - started >= SLOW
    assert len(await truth(client, reference)) == 1


async def test_slow_stays_executed_when_the_client_hangs_up(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    with pytest.raises(httpx.ReadTimeout):
        await submit(client, "pm_slow", reference, client_timeout=SLOW / 3)
    await executed_once(client, reference)


# -- invalid requests -------------------------------------------------------------------------


async def test_missing_idempotency_key_is_rejected_and_logged(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    response = await client.post("/v1/charges", json=charge_body("pm_ok", reference))
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert await truth(client, reference) == []
    [logged] = await received(client, reference)
    assert logged["idempotency_key"] is None
    assert logged["response_status"] == 400


@pytest.mark.parametrize(
    "overrides",
    [{"amount": 0}, {"amount": "1250"}, {"amount": 12.5}, {"currency": 7}, {"metadata": {"a": 1}}],
)
async def test_invalid_body_is_refused_and_not_kept(
    client: httpx.AsyncClient, overrides: dict[str, Any]
) -> None:
    reference = new_reference()
    response = await submit(client, "pm_ok", reference, **overrides)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "parameter_invalid")
    assert await truth(client, reference) == []
    # Nothing was kept against the key, so the corrected request executes with it.
    assert (await submit(client, "pm_ok", reference)).status_code == 200


async def test_body_that_is_not_an_object_is_refused(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/charges", content=b"[1, 2]", headers={"Idempotency-Key": "k-not-object"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parameter_invalid"


# -- idempotency ------------------------------------------------------------------------------


async def test_same_key_replays_without_a_second_charge(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    first = await submit(client, "pm_ok", reference)
    second = await submit(client, "pm_ok", reference)
    assert second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.json() == first.json()
    assert len(await truth(client, reference)) == 1
    assert [r["response_status"] for r in await received(client, reference)] == [200, 200]


async def test_same_key_different_body_is_an_idempotency_error(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    assert (await submit(client, "pm_ok", reference)).status_code == 200
    conflicting = await submit(client, "pm_ok", reference, amount=999)
    assert conflicting.status_code == 400
    error = conflicting.json()["error"]
    assert (error["type"], error["code"]) == ("idempotency_error", "idempotency_key_reused")
    assert len(await truth(client, reference)) == 1


async def test_key_reused_after_retention_creates_a_new_charge(
    start_sandbox: StartSandbox,
) -> None:
    retention = timedelta(seconds=0.5)
    async with httpx.AsyncClient(base_url=start_sandbox(retention), timeout=10) as client:
        reference = new_reference()
        first = await submit(client, "pm_ok", reference)
        await asyncio.sleep(retention.total_seconds() + 0.1)
        second = await submit(client, "pm_ok", reference)
        assert second.status_code == 200
        assert "Idempotent-Replayed" not in second.headers
        assert second.json()["id"] != first.json()["id"]
        assert len(await truth(client, reference)) == 2
        # The new use starts a new retention window: an immediate retry replays it.
        third = await submit(client, "pm_ok", reference)
        assert third.headers["Idempotent-Replayed"] == "true"
        assert third.json() == second.json()


async def test_concurrent_submits_with_one_key_execute_once(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    responses = await asyncio.gather(*(submit(client, "pm_ok", reference) for _ in range(20)))
    assert {r.status_code for r in responses} == {200}
    assert len({r.json()["id"] for r in responses}) == 1
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in responses) == 19
    assert len(await truth(client, reference)) == 1
    assert len(await received(client, reference)) == 20


# -- first-attempt faults ---------------------------------------------------------------------


async def test_timeout_after_execute_withholds_the_executed_answer(
    client: httpx.AsyncClient,
) -> None:
    reference = new_reference()
    started = time.monotonic()
    response = await submit(client, "pm_timeout_after_execute", reference)
    assert time.monotonic() - started >= WITHHOLD
    assert response.status_code == 200
    assert len(await truth(client, reference)) == 1


async def test_timeout_after_execute_client_hang_up_leaves_the_charge(
    client: httpx.AsyncClient,
) -> None:
    reference = new_reference()
    with pytest.raises(httpx.ReadTimeout):
        await submit(client, "pm_timeout_after_execute", reference, client_timeout=HANG_UP)
    executed = await executed_once(client, reference)

    # The retry with the same key is not delayed: it replays the charge that executed.
    retry = await submit(client, "pm_timeout_after_execute", reference)
    assert retry.status_code == 200
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == executed["id"]
    assert len(await truth(client, reference)) == 1

    async def hang_up_recorded() -> bool:
        first, _ = await received(client, reference)
        # NULL: the server noticed the hang-up and delivered no answer.
        return first["response_status"] is None

    await eventually(hang_up_recorded)


async def test_timeout_before_execute_withholds_and_executes_nothing(
    client: httpx.AsyncClient,
) -> None:
    reference = new_reference()
    started = time.monotonic()
    response = await submit(client, "pm_timeout_before_execute", reference)
    assert time.monotonic() - started >= WITHHOLD
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "api_error"
    assert response.json()["error"]["code"] == "timeout"
    assert await truth(client, reference) == []

    retry = await submit(client, "pm_timeout_before_execute", reference)
    assert retry.status_code == 200
    assert "Idempotent-Replayed" not in retry.headers
    assert len(await truth(client, reference)) == 1


@pytest.mark.parametrize(
    ("payment_method", "status", "retry_after"),
    [("pm_unavailable", 503, "2"), ("pm_rate_limited", 429, "1")],
)
async def test_refusals_on_first_attempt_then_execute_with_the_same_key(
    client: httpx.AsyncClient, payment_method: str, status: int, retry_after: str
) -> None:
    reference = new_reference()
    first = await submit(client, payment_method, reference)
    assert first.status_code == status
    assert first.headers["Retry-After"] == retry_after
    assert "error" in first.json()
    assert await truth(client, reference) == []

    retry = await submit(client, payment_method, reference)
    assert retry.status_code == 200
    assert "Idempotent-Replayed" not in retry.headers
    assert len(await truth(client, reference)) == 1
    statuses = [r["response_status"] for r in await received(client, reference)]
    assert statuses == [status, 200]


async def test_first_attempt_is_per_reference_not_per_key(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    assert (await submit(client, "pm_unavailable", reference, key="k1")).status_code == 503
    # A new key for the same operation is still a later attempt of that operation.
    assert (await submit(client, "pm_unavailable", reference, key="k2")).status_code == 200


# -- lookups ----------------------------------------------------------------------------------


async def test_lookup_finds_charges_by_reference(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    charge = (await submit(client, "pm_ok", reference)).json()
    response = await lookup(client, reference)
    assert response.status_code == 200
    assert response.json() == {"data": [{**charge, "idempotency_key": f"key-{reference}"}]}
    kinds = [r["kind"] for r in await received(client, reference)]
    assert kinds == ["submit", "lookup"]


async def test_lookup_of_unknown_reference_is_an_empty_list(client: httpx.AsyncClient) -> None:
    response = await lookup(client, new_reference())
    assert response.status_code == 200
    assert response.json() == {"data": []}


async def test_lookup_lag_hides_the_charge_until_the_lag_passes(
    client: httpx.AsyncClient,
) -> None:
    reference = new_reference()
    with pytest.raises(httpx.ReadTimeout):
        await submit(client, "pm_lookup_lag", reference, client_timeout=HANG_UP)
    executed = await executed_once(client, reference)  # the truth has no lag
    assert (await lookup(client, reference)).json() == {"data": []}

    lag_ends = parse_utc(executed["executed_at"]) + timedelta(seconds=LOOKUP_LAG)
    await asyncio.sleep(max(0.0, (lag_ends - datetime.now(lag_ends.tzinfo)).total_seconds()))
    [found] = (await lookup(client, reference)).json()["data"]
    assert found["id"] == executed["id"]

    retry = await submit(client, "pm_lookup_lag", reference)
    assert retry.headers["Idempotent-Replayed"] == "true"


async def test_blackhole_times_out_every_submit_and_lookup(client: httpx.AsyncClient) -> None:
    reference = new_reference()
    submits = [asyncio.create_task(submit(client, "pm_blackhole", reference)) for _ in range(2)]

    async def both_submits_logged() -> bool:
        return len(await received(client, reference)) == 2

    # Lookups time out once the provider has seen a blackholed submit for the reference.
    await eventually(both_submits_logged)
    looked_up = await lookup(client, reference)
    first, retry = await asyncio.gather(*submits)
    assert (first.status_code, retry.status_code, looked_up.status_code) == (504, 504, 504)
    assert await truth(client, reference) == []
    assert len(await received(client, reference)) == 3


# -- the truth --------------------------------------------------------------------------------


async def test_truth_and_request_log_filter_and_order(client: httpx.AsyncClient) -> None:
    a, b = new_reference(), new_reference()
    await submit(client, "pm_ok", a)
    await submit(client, "pm_ok", b)
    await submit(client, "pm_ok", a, key="another-key")
    everything = await truth(client)
    assert [c["reference"] for c in everything] == [a, b, a]
    times = [parse_utc(c["executed_at"]) for c in everything]
    assert times == sorted(times)
    assert set(everything[0]) >= {"reference", "idempotency_key", "amount", "currency"}
    assert [c["idempotency_key"] for c in await truth(client, a)] == [f"key-{a}", "another-key"]
    logged = await received(client, a)
    assert [r["id"] for r in logged] == sorted(r["id"] for r in logged)
    assert {r["reference"] for r in logged} == {a}


async def test_truth_survives_a_new_app_on_the_same_file(start_sandbox: StartSandbox) -> None:
    reference = new_reference()
    async with httpx.AsyncClient(base_url=start_sandbox(), timeout=10) as first:
        charge = (await submit(first, "pm_ok", reference)).json()
    async with httpx.AsyncClient(base_url=start_sandbox(), timeout=10) as second:
        [executed] = await truth(second, reference)
        assert executed["id"] == charge["id"]
        replay = await submit(second, "pm_ok", reference)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.json() == charge


@contextmanager
def sandbox_process(database_path: str) -> Iterator[str]:
    """A second OS process serving the same database file."""
    script = textwrap.dedent(
        """
        import datetime, socket, sys
        import uvicorn
        from fastapi import FastAPI
        from intentledger.providers.sandbox import create_sandbox_app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        outer = FastAPI()
        outer.mount("/_sandbox", create_sandbox_app(sys.argv[1], datetime.timedelta(hours=24)))
        print(sock.getsockname()[1], flush=True)
        uvicorn.Server(uvicorn.Config(outer, log_level="warning", lifespan="off")).run([sock])
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, database_path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        base_url = f"http://127.0.0.1:{process.stdout.readline().strip()}/_sandbox"
        deadline = time.monotonic() + 10
        while not _answers(base_url):
            assert time.monotonic() < deadline, "sandbox process did not start"
            time.sleep(0.05)
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=10)


def _answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


async def test_one_truth_across_processes(start_sandbox: StartSandbox, database_path: str) -> None:
    reference = new_reference()
    with sandbox_process(database_path) as other_url:
        async with (
            httpx.AsyncClient(base_url=start_sandbox(), timeout=10) as here,
            httpx.AsyncClient(base_url=other_url, timeout=10) as there,
        ):
            clients = [here, there] * 10
            responses = await asyncio.gather(*(submit(c, "pm_ok", reference) for c in clients))
            assert {r.status_code for r in responses} == {200}
            assert len({r.json()["id"] for r in responses}) == 1
            assert len(await truth(here, reference)) == 1
            assert len(await truth(there, reference)) == 1
