"""The OpenAPI document tells the truth: schemathesis, with all its checks, on
both databases, as an actor and as an operator (issue 13, defect 10).

Rejections no JSON Schema can state (an unknown currency code, IBAN check
digits, ids that name nothing, state rules) are allowed as the documented
404/409/422 problems by tests/schemathesis.toml; every other check is on.

All of schemathesis' phases run, the coverage phase among them: it sends every
integer query parameter at its minimum and maximum and one past each. A random
path id names nothing (404 before a query parameter is read), so the routes
whose query parameters reach the database get a real resource of the caller's
(schemathesis.toml binds it): a delivery cursor past its INTEGER column was a
500 on PostgreSQL until its schema said where the column ends (issue 35).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import BACKENDS, Databases
from tests.test_intake_http import create_key, serving

CONFIG = Path(__file__).parent / "schemathesis.toml"


@pytest.fixture(scope="module", params=BACKENDS)
def api(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    database_url = databases.create(str(request.param))
    tokens = {
        "actor": create_key(database_url, "ada"),
        "operator": create_key(database_url, "otto", operator=True),
    }
    # A lost provider answer holds a synchronous write for the sync timeout.
    with serving(database_url, tmp_path_factory.mktemp("openapi"), "--sync-timeout", "1s") as url:
        endpoints = {who: _endpoint_of(url, token) for who, token in tokens.items()}
        yield {"url": url, "tokens": tokens, "endpoints": endpoints}


def _endpoint_of(url: str, token: str) -> str:
    """A live endpoint of the caller's: its deliveries read the query
    parameters from the database, and the list hands schemathesis a URL it can
    register, delete and replay (a deleted endpoint reads back with its
    `deleted_at`, and DELETE is idempotent)."""
    auth = {"Authorization": f"Bearer {token}"}
    created = httpx.post(
        url + "/v1/webhook-endpoints",
        json={"url": "https://93.184.216.34/hooks"},  # public literal: nothing to resolve
        headers={**auth, "Idempotency-Key": "openapi-endpoint"},
    )
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_the_document_declares_security_errors_and_formats(api: dict[str, Any]) -> None:
    spec = httpx.get(api["url"] + "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    freeze = spec["paths"]["/v1/cards/{card_id}/freeze"]["post"]
    assert {
        *("200", "201", "202", "400", "401", "404", "409", "413", "415", "422", "431", "503")
    } <= set(freeze["responses"])
    assert "application/problem+json" in freeze["responses"]["409"]["content"]
    assert freeze["responses"]["201"]["content"]["application/json"]["schema"]
    [key] = [p for p in freeze["parameters"] if p["name"] == "Idempotency-Key"]
    assert key["required"] and key["schema"]["pattern"]
    payment = spec["paths"]["/v1/payments"]["post"]["requestBody"]["content"]
    currency = payment["application/json"]["schema"]["properties"]["currency"]
    assert currency["pattern"] == "^[A-Za-z]{3}$"


@pytest.mark.parametrize("who", ["actor", "operator"])
def test_schemathesis_finds_nothing(api: dict[str, Any], who: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("schemathesis")),
            "--config-file",
            str(CONFIG),
            "--no-color",
            "run",
            api["url"] + "/openapi.json",
            "--checks",
            "all",
            "--header",
            f"Authorization: Bearer {api['tokens'][who]}",
            "--max-examples",
            "25",
            "--seed",
            "1",
            "--request-timeout",
            "15",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
        env={**os.environ, "INTENTLEDGER_SCHEMATHESIS_ENDPOINT": api["endpoints"][who]},
    )
    assert done.returncode == 0, done.stdout[-6000:]
    [summary] = [line for line in done.stdout.splitlines() if " generated, " in line]
    assert " passed" in summary and "found" not in summary, summary
