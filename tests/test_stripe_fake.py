"""The Stripe fake (tests/stripe_fake.py) behaves as the Stripe adapter's tests assume.

Each test talks form-encoded HTTP to the proxy, like a Stripe client, and reads
what really happened from localstripe with the official SDK.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.stripe_fake import StripeFake, fresh_stripe, stripe_fake  # noqa: F401

AUTH = {"Authorization": "Bearer sk_test_x"}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}
REFERENCE_QUERY = "metadata['intentledger_reference']:'{}'"


def create_body(reference: str = "op1", amount: int = 100, card: str = "pm_card_visa") -> str:
    return (
        f"amount={amount}&currency=eur&payment_method={card}&confirm=true"
        f"&metadata[intentledger_reference]={reference}&description=x"
    )


@pytest.fixture
def api(fresh_stripe: StripeFake) -> Iterator[httpx.Client]:  # noqa: F811
    with httpx.Client(base_url=fresh_stripe.api_base, headers=AUTH, timeout=10) as client:
        yield client


def create(
    client: httpx.Client, key: str | None = None, body: str | None = None, **kwargs: Any
) -> httpx.Response:
    headers = {**FORM, **({"Idempotency-Key": key} if key else {})}
    return client.post(
        "/v1/payment_intents", content=body or create_body(), headers=headers, **kwargs
    )


def search(client: httpx.Client, reference: str) -> httpx.Response:
    query = REFERENCE_QUERY.format(reference)
    return client.get("/v1/payment_intents/search", params={"query": query})


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_create_looks_like_real_stripe(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    response = create(api, "k-create")

    assert response.status_code == 200, response.text
    intent = response.json()
    assert intent["object"] == "payment_intent"
    assert intent["status"] == "succeeded"
    assert intent["metadata"] == {"intentledger_reference": "op1"}
    assert isinstance(intent["latest_charge"], str)
    assert intent["latest_charge"].startswith("ch_")
    assert response.headers["Request-Id"].startswith("req_")
    assert "Idempotent-Replayed" not in response.headers
    # localstripe refuses `description`: the proxy took it out, and kept it in its log.
    (entry,) = fresh_stripe.log()
    assert entry["params"]["description"] == "x"
    assert entry["forwarded"] is True
    assert entry["status"] == 200
    assert entry["idempotency_key"] == "k-create"
    (truth,) = fresh_stripe.payment_intents()
    assert truth["id"] == intent["id"]


def test_every_answer_has_its_own_request_id(api: httpx.Client) -> None:
    first = api.get("/v1/payment_intents")
    second = api.get("/v1/payment_intents/pi_missing")

    assert first.status_code == 200
    assert second.status_code == 404
    ids = {first.headers["Request-Id"], second.headers["Request-Id"]}
    assert len(ids) == 2


def test_the_same_key_and_parameters_replay_the_first_answer(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    first = create(api, "k-replay")
    second = create(api, "k-replay")

    assert first.status_code == second.status_code == 200
    assert second.json()["id"] == first.json()["id"]
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["Original-Request"] == first.headers["Request-Id"]
    assert second.headers["Request-Id"] != first.headers["Request-Id"]
    assert len(fresh_stripe.payment_intents()) == 1
    assert [(e["forwarded"], e["replayed"]) for e in fresh_stripe.log()] == [
        (True, False),
        (False, True),
    ]


def test_keys_belong_to_one_api_key(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    first = create(api, "k-shared")

    with httpx.Client(
        base_url=fresh_stripe.api_base, headers={"Authorization": "Bearer sk_test_other"}
    ) as other:
        second = create(other, "k-shared")

    assert second.json()["id"] != first.json()["id"]
    assert len(fresh_stripe.payment_intents()) == 2


def test_the_same_key_with_other_parameters_is_refused(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    assert create(api, "k-other").status_code == 200

    response = create(api, "k-other", body=create_body(amount=200))

    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "idempotency_error"
    assert error["message"].startswith("Keys for idempotent requests can only be used")
    assert len(fresh_stripe.payment_intents()) == 1
    assert fresh_stripe.log()[-1]["forwarded"] is False


def test_a_key_still_in_flight_is_in_use(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    fresh_stripe.configure(queue=["hold_after"], hold_seconds=1.5)
    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(create, api, "k-busy")
        # The first request has executed upstream and its answer is being held.
        deadline = time.monotonic() + 5
        while not any(entry["forwarded"] for entry in fresh_stripe.log()):
            assert time.monotonic() < deadline, fresh_stripe.log()
            time.sleep(0.02)

        concurrent = create(api, "k-busy")

        first = held.result(timeout=10)

    assert concurrent.status_code == 409
    error = error_of(concurrent)
    assert error["type"] == "idempotency_error"
    assert error["code"] == "idempotency_key_in_use"
    assert first.status_code == 200
    later = create(api, "k-busy")
    assert later.headers["Idempotent-Replayed"] == "true"
    assert later.json()["id"] == first.json()["id"]
    assert len(fresh_stripe.payment_intents()) == 1


def test_an_expired_key_is_new_again(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    first = create(api, "k-old")
    fresh_stripe.expire_keys()
    second = create(api, "k-old")

    assert "Idempotent-Replayed" not in second.headers
    assert second.json()["id"] != first.json()["id"]
    assert len(fresh_stripe.payment_intents()) == 2


def test_a_validation_failure_does_not_bind_the_key(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    # Stripe saves no result when the parameters fail validation.
    refused = create(api, "k-invalid", body=create_body() + "&unsupported_parameter=1")
    assert refused.status_code == 400

    corrected = create(api, "k-invalid")

    assert corrected.status_code == 200, corrected.text
    assert "Idempotent-Replayed" not in corrected.headers


def test_rate_limited_answers_429_and_executes_nothing(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    fresh_stripe.configure(queue=["rate_limited"], retry_after=2)

    response = create(api, "k-429")

    assert response.status_code == 429
    assert response.headers["Retry-After"] == "2"
    assert response.headers["Stripe-Should-Retry"] == "true"
    assert response.headers["Request-Id"].startswith("req_")
    error = error_of(response)
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit")
    assert fresh_stripe.payment_intents() == []
    # Nothing was stored under the key: the retry executes.
    retry = create(api, "k-429")
    assert retry.status_code == 200
    assert "Idempotent-Replayed" not in retry.headers
    assert [e["fault"] for e in fresh_stripe.log()] == ["rate_limited", "none"]


def test_error_before_answers_500_and_executes_nothing(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    fresh_stripe.configure(queue=["error_before"])

    response = create(api, "k-500-before")

    assert response.status_code == 500
    assert error_of(response)["type"] == "api_error"
    assert fresh_stripe.payment_intents() == []
    assert fresh_stripe.log()[-1]["forwarded"] is False
    retry = create(api, "k-500-before")
    assert retry.status_code == 200
    assert len(fresh_stripe.payment_intents()) == 1


def test_error_after_executes_and_replays_the_500(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    fresh_stripe.configure(queue=["error_after"])

    response = create(api, "k-500-after")

    assert response.status_code == 500
    assert error_of(response)["type"] == "api_error"
    assert len(fresh_stripe.payment_intents()) == 1
    replay = create(api, "k-500-after")
    assert replay.status_code == 500
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(fresh_stripe.payment_intents()) == 1


def test_reset_after_executes_then_drops_the_connection(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    fresh_stripe.configure(queue=["reset_after"])

    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        create(api, "k-reset")

    (truth,) = fresh_stripe.payment_intents()
    replay = create(api, "k-reset")
    assert replay.status_code == 200
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == truth["id"]
    assert fresh_stripe.log()[0]["status"] is None


def test_hold_after_executes_and_the_client_times_out(
    fresh_stripe: StripeFake,  # noqa: F811
    api: httpx.Client,
) -> None:
    fresh_stripe.configure(queue=["hold_after"], hold_seconds=1.0)

    with pytest.raises(httpx.ReadTimeout):
        create(api, "k-hold", timeout=0.5)

    assert len(fresh_stripe.payment_intents()) == 1


def test_a_closed_listener_refuses_connections_while_control_answers(
    fresh_stripe: StripeFake,  # noqa: F811
) -> None:
    fresh_stripe.listener(open=False)

    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{fresh_stripe.api_base}/v1/payment_intents", headers=AUTH)
    assert fresh_stripe.log() == []

    fresh_stripe.listener(open=True)
    response = httpx.get(f"{fresh_stripe.api_base}/v1/payment_intents", headers=AUTH)
    assert response.status_code == 200


def test_refuse_drops_the_request_and_closes_the_port_for_a_while(
    fresh_stripe: StripeFake,  # noqa: F811
) -> None:
    fresh_stripe.configure(queue=["refuse"], refuse_seconds=1.0)
    refused_at = time.monotonic()

    with (
        httpx.Client(base_url=fresh_stripe.api_base, headers=AUTH) as client,
        pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)),
    ):
        create(client, "k-refuse")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{fresh_stripe.api_base}/v1/payment_intents", headers=AUTH)
    assert time.monotonic() - refused_at < 1.0, "too slow to observe the refusal window"
    assert fresh_stripe.payment_intents() == []

    time.sleep(max(0.0, refused_at + 1.2 - time.monotonic()))
    with httpx.Client(base_url=fresh_stripe.api_base, headers=AUTH) as client:
        retry = create(client, "k-refuse")
    assert retry.status_code == 200
    assert "Idempotent-Replayed" not in retry.headers


def test_faults_touch_creates_only(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    fresh_stripe.configure(queue=["error_before"])

    assert api.get("/v1/payment_intents").status_code == 200
    assert search(api, "op1").status_code == 200

    assert create(api).status_code == 500  # the queued fault was still waiting


def test_a_seeded_mix_repeats_itself(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    def statuses(seed: int) -> list[int]:
        fresh_stripe.configure(mix={"none": 1, "rate_limited": 1, "error_before": 1}, seed=seed)
        return [create(api).status_code for _ in range(12)]

    first = statuses(seed=3)
    second = statuses(seed=3)

    assert first == second
    assert statuses(seed=4) != first
    assert set(first) == {200, 429, 500}


def test_search_finds_by_reference(api: httpx.Client) -> None:
    wanted = create(api, body=create_body(reference="op-find")).json()
    create(api, body=create_body(reference="op-other"))

    response = search(api, "op-find")

    assert response.status_code == 200
    result = response.json()
    assert result["object"] == "search_result"
    assert (result["has_more"], result["next_page"]) == (False, None)
    assert [intent["id"] for intent in result["data"]] == [wanted["id"]]
    assert isinstance(result["data"][0]["latest_charge"], str)


def test_search_refuses_other_queries(api: httpx.Client) -> None:
    response = api.get("/v1/payment_intents/search", params={"query": "status:'succeeded'"})

    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


def test_search_lags_behind_a_create(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    fresh_stripe.configure(search_lag=1.0)
    created = create(api, body=create_body(reference="op-lag")).json()
    created_at = time.monotonic()

    assert search(api, "op-lag").json()["data"] == []

    time.sleep(max(0.0, created_at + 1.05 - time.monotonic()))
    assert [intent["id"] for intent in search(api, "op-lag").json()["data"]] == [created["id"]]


def test_search_can_be_switched_off(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    fresh_stripe.configure(search=False)

    response = search(api, "op1")

    assert response.status_code == 404
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Unrecognized request URL")


def test_a_declined_card_is_a_card_error(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    response = create(api, "k-decline", body=create_body(card="pm_card_chargeCustomerFail"))

    assert response.status_code == 402
    error = error_of(response)
    assert (error["type"], error["code"]) == ("card_error", "card_declined")
    (truth,) = fresh_stripe.payment_intents()
    assert error["payment_intent"]["id"] == truth["id"]
    assert isinstance(error["payment_intent"]["latest_charge"], str)
    assert truth["status"] == "requires_payment_method"
    # A decline is an executed request: its answer is kept under the key.
    replay = create(api, "k-decline", body=create_body(card="pm_card_chargeCustomerFail"))
    assert replay.status_code == 402
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_reset_empties_localstripe(fresh_stripe: StripeFake, api: httpx.Client) -> None:  # noqa: F811
    create(api, "k-before-reset")
    fresh_stripe.configure(queue=["error_before"], search=False)

    fresh_stripe.reset()

    assert fresh_stripe.payment_intents() == []
    assert fresh_stripe.log() == []
    assert create(api, "k-before-reset").status_code == 200
    assert search(api, "op1").status_code == 200
