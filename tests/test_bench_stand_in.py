"""The bench's provider stand-in (issue 39) speaks what the worker's sandbox adapter
needs: a real stand-in process, called through the real adapter."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from intentledger.domain.transport import Transport, Verdict
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.providers.sandbox_client import SandboxProvider
from intentledger.service import SANDBOX_MOUNT
from intentledger_tools.bench.runner import turns
from intentledger_tools.bench.stand_in import hangs
from tests.support import serving_module


@contextmanager
def running_stand_in(tmp_path: Path, *options: str) -> Iterator[str]:
    module = "intentledger_tools.bench.stand_in"
    health = f"{SANDBOX_MOUNT}/healthz"
    with serving_module(module, tmp_path / "stand-in.log", health, *options) as url:
        yield f"{url}{SANDBOX_MOUNT}"


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[str]:
    with running_stand_in(tmp_path) as url:
        yield url


def charge(key: str, reference: str = "op_1") -> ProviderRequest:
    body = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok"}
    return ProviderRequest("payment", reference, key, body)


def test_a_charge_succeeds_once_per_key_and_is_found_by_its_reference(stand_in: str) -> None:
    async def calls() -> None:
        provider = SandboxProvider(stand_in, timedelta(seconds=5))
        try:
            first = await provider.submit(charge("key-1"))
            again = await provider.submit(charge("key-1"))
            other = await provider.submit(charge("key-2", "op_2"))
            assert first.mapped is not None and first.mapped.verdict is Verdict.SUCCEEDED
            assert first.provider_reference is not None
            # A resent submit gets the same charge back, never a second one.
            assert again.provider_reference == first.provider_reference
            assert other.provider_reference not in (None, first.provider_reference)
            seen = await provider.lookup(ProviderLookup("payment", "op_1"))
            assert [(c.provider_reference, c.status) for c in seen.charges] == [
                (first.provider_reference, "succeeded")
            ]
            nothing = await provider.lookup(ProviderLookup("payment", "op_never"))
            assert nothing.readable and nothing.charges == ()
        finally:
            await provider.aclose()

    asyncio.run(calls())
    assert httpx.get(f"{stand_in}/stand-in/calls").json() == {
        "calls": 3,
        "hung": 0,
        "merchant_webhooks": 0,
    }


def test_the_mixed_stand_in_leaves_its_share_of_keys_hanging_until_the_client_gives_up(
    tmp_path: Path,
) -> None:
    # The record-delay phase's provider: fast answers, and a share never answered.
    keys = [f"key-{n}" for n in range(40)]
    hanging = [key for key in keys if hangs(key, 0.25)]
    fast = [key for key in keys if not hangs(key, 0.25)]
    assert 0 < len(hanging) < len(keys)  # the choice is by key, about a quarter
    assert hangs(hanging[0], 0.25) and not hangs(hanging[0], 0.0) and hangs(fast[0], 1.0)

    async def calls(url: str) -> None:
        provider = SandboxProvider(url, timedelta(seconds=1))
        try:
            started = time.monotonic()
            answered = await provider.submit(charge(fast[0], "op_fast"))
            fast_took = time.monotonic() - started
            started = time.monotonic()
            unanswered = await provider.submit(charge(hanging[0], "op_hung"))
            hung_took = time.monotonic() - started
            # The same key hangs again when resent.
            again = await provider.submit(charge(hanging[0], "op_hung"))
            assert answered.mapped is not None and answered.mapped.verdict is Verdict.SUCCEEDED
            assert 0.05 <= fast_took < 0.9
            assert unanswered.transport is Transport.NO_RESPONSE
            assert again.transport is Transport.NO_RESPONSE
            assert hung_took >= 0.9  # held until the client's timeout
            # No charge was made: a lookup by its reference finds nothing.
            seen = await provider.lookup(ProviderLookup("payment", "op_hung"))
            assert seen.readable and seen.charges == ()
        finally:
            await provider.aclose()

    with running_stand_in(tmp_path, "--delay-seconds", "0.05", "--hang-share", "0.25") as url:
        asyncio.run(calls(url))
        assert httpx.get(f"{url}/stand-in/calls").json() == {
            "calls": 1,
            "hung": 2,
            "merchant_webhooks": 0,
        }
        assert httpx.get(f"{url}/stand-in/hung").json() == {"references": ["op_hung"] * 2}


def test_a_merchant_webhook_is_taken_and_counted(stand_in: str) -> None:
    for _ in range(2):
        taken = httpx.post(
            f"{stand_in}/stand-in/merchant-webhooks",
            content=b'{"type":"operation.outcome_known"}',
            headers={"webhook-id": "msg_1"},
        )
        assert taken.status_code == 200
    assert httpx.get(f"{stand_in}/stand-in/calls").json()["merchant_webhooks"] == 2
    assert httpx.post(f"{stand_in}/stand-in/elsewhere", content=b"{}").status_code == 404


def test_a_charge_without_a_key_is_refused_as_the_sandbox_refuses_it(stand_in: str) -> None:
    answer = httpx.post(f"{stand_in}/v1/charges", json={"reference": "op_1"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "parameter_missing"
    assert httpx.get(f"{stand_in}/v1/nothing").status_code == 404


def test_rounds_take_their_steps_in_turn_the_order_reversed_every_other_round() -> None:
    assert list(turns(3, 3)) == [
        (0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0), (2, 0), (2, 1), (2, 2)
    ]  # fmt: skip
