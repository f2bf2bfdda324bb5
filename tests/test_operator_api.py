"""Operator endpoints over HTTP: role, idempotency, and a new-key request linked to its attempt."""

from __future__ import annotations

import httpx
import pytest

from tests.served import Served


def post(served: Served, path: str, body: dict[str, str], key: str | None) -> httpx.Response:
    headers = dict(served.operator_auth)
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{served.url}/v1/ops/operations/{path}", json=body, headers=headers)


@pytest.mark.parametrize("served", ["3s"], indirect=True)
def test_operator_actions_are_keyed_recorded_and_linked(served: Served) -> None:
    settled = served.pay("pm_ok", "op-api-ok")
    stuck = served.pay("pm_blackhole", "op-api-stuck")
    served.settle(settled, {"OUTCOME_KNOWN"})
    served.settle(stuck, {"MANUAL_REVIEW"})

    assert httpx.get(f"{served.url}/v1/ops/operations", headers=served.auth).status_code == 403
    listed = httpx.get(
        f"{served.url}/v1/ops/operations",
        params={"state": "MANUAL_REVIEW"},
        headers=served.operator_auth,
    ).json()["data"]
    assert [row["id"] for row in listed] == [stuck] and listed[0]["next_action"] == "operator"
    bad_state = httpx.get(
        f"{served.url}/v1/ops/operations", params={"state": "LOST"}, headers=served.operator_auth
    )
    assert bad_state.status_code == 422

    reason = {"reason": "provider support confirmed no charge exists; new request is safe"}
    assert post(served, f"{stuck}/approve-resubmission", reason, None).status_code == 400
    assert post(served, f"{settled}/approve-resubmission", reason, "a-0").status_code == 409
    assert (
        post(served, f"{stuck}/resolve", {"outcome": "failed", "evidence": "  "}, "r-0").status_code
        == 422
    )

    approved = post(served, f"{stuck}/approve-resubmission", reason, "a-1")
    assert approved.status_code == 200, approved.text
    assert approved.json()["action"].startswith("new request approved")
    replay = post(served, f"{stuck}/approve-resubmission", reason, "a-1")
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert (
        post(served, f"{stuck}/approve-resubmission", {"reason": "other"}, "a-1").status_code == 409
    )

    shown = httpx.get(
        f"{served.url}/v1/ops/operations/{stuck}", headers=served.operator_auth
    ).json()
    [approval] = [
        e
        for e in shown["events"]
        if e["type"] == "decision" and e["rule"] == "operator_approved_new_request"
    ]
    assert approval["source"] == "operator:olive"
    op = served.settle(stuck, {"MANUAL_REVIEW"})  # the blackhole swallows the new request too
    while len(op["attempts"]) < 2:
        op = served.settle(stuck, {"MANUAL_REVIEW"})
    first, second = op["attempts"][:2]
    assert second["provider_idempotency_key"] == f"{stuck}:2" != first["provider_idempotency_key"]
    assert (second["relation"], second["resubmission_of"], second["decision_id"]) == (
        "resubmission",
        1,
        approval["id"],
    )
    assert served.charges(stuck) == 0
