"""The operator console in a real browser: Debian's Chromium driven by Playwright,
against `intentledger serve` with its workers and sandbox, on both databases.

Screenshots are written to INTENTLEDGER_SCREENSHOTS when it is set (the ones in
docs/screenshots/ were made that way) and to a temporary directory otherwise.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.served import Served

# Debian's real binary, not the /usr/bin/chromium wrapper script
# (scripts/ensure-test-tools installs it; Playwright's own download is not reachable).
CHROMIUM = "/usr/lib/chromium/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure-test-tools (make test does)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get("INTENTLEDGER_SCREENSHOTS")
    folder = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def token_of(auth: dict[str, str]) -> str:
    return auth["Authorization"].removeprefix("Bearer ")


def shoot(page: Any, folder: Path, name: str, backend: str) -> None:
    # One set per run is enough for the docs; both backends write it (same pages).
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, f"{path} looks empty"


def sign_in(page: Any, served: Served, token: str) -> None:
    page.goto(f"{served.url}/console")
    assert "/console/sign-in" in page.url
    page.fill("#token", token)
    page.click("button[type=submit]")


def decisions(served: Served, op_id: str, rule: str) -> list[dict[str, Any]]:
    shown = httpx.get(
        f"{served.url}/v1/ops/operations/{op_id}", headers=served.operator_auth
    ).json()
    return [e for e in shown["events"] if e["type"] == "decision" and e["rule"] == rule]


@pytest.mark.parametrize("served", ["3s"], indirect=True)
def test_an_operator_finds_a_lost_payment_in_the_queue_reads_its_story_and_resolves_it(
    served: Served, browser: Any, screenshots: Path, backend: str
) -> None:
    settled = served.pay("pm_ok", "console-ok")
    lost = served.pay("pm_blackhole", "console-lost")
    served.settle(settled, {"OUTCOME_KNOWN"})
    served.settle(lost, {"MANUAL_REVIEW"})

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    sign_in(page, served, token_of(served.operator_auth))
    assert page.url.endswith("/console/queue"), page.content()
    [cookie] = context.cookies()
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/console")
    # A session id: the key itself never leaves the sign-in form.
    assert token_of(served.operator_auth) not in cookie["value"]

    # The work queue: the lost payment is there, the settled one is not.
    queue = page.locator("table.queue")
    assert queue.locator(f"a:text-is('{lost}')").count() == 1
    assert queue.locator(f"a:text-is('{settled}')").count() == 0
    assert int(page.inner_text("#count-operator")) >= 1
    shoot(page, screenshots, "console-queue", backend)
    # Filters narrow it; a state nothing is in empties it.
    page.goto(f"{served.url}/console/queue?state=UNKNOWN")
    assert page.locator(f"a:text-is('{lost}')").count() == 0
    page.goto(f"{served.url}/console/queue?state=MANUAL_REVIEW&provider=sandbox&actor=dora")
    assert page.locator(f"a:text-is('{lost}')").count() == 1

    # Its whole story: the attempt with its key, the lookups, the decision that
    # the key's retention passed, with the key's age and the provider's policy.
    page.click(f"a:text-is('{lost}')")
    assert page.inner_text("#state") == "MANUAL_REVIEW"
    assert page.locator("#attempts tbody tr").count() == 1
    assert (
        page.locator("#attempts")
        .inner_text()
        .count(served.operation(lost)["attempts"][0]["provider_idempotency_key"])
        == 1
    )
    lookups = int(re.match(r"(\d+)", page.inner_text("#lookup-count")).group(1))  # type: ignore[union-attr]
    assert lookups >= 1
    decision = page.locator("li.rule-retention_passed")
    assert decision.count() == 1
    assert "key age at decision" in decision.inner_text()
    assert "keys honoured for at least" in decision.locator(".policy").inner_text()
    shoot(page, screenshots, "console-operation", backend)

    # Resolve it: form, confirmation, done.
    page.click("a.button:text-is('Resolve')")
    page.check("input[name=outcome][value=failed]")
    page.fill("#evidence", "sandbox truth: no charge under this reference")
    page.click("button:text-is('Review')")
    assert "Confirm" in page.inner_text("h1")
    shoot(page, screenshots, "console-confirm", backend)
    page.click("button:text-is('Confirm')")
    assert "Resolve: Done." in page.inner_text(".flash")
    assert page.inner_text("#state") == "OUTCOME_KNOWN"
    shown = served.operation(lost)
    assert (shown["state"], shown["outcome"]) == ("OUTCOME_KNOWN", "failed")
    [resolution] = decisions(served, lost, "operator_resolution")
    assert resolution["source"] == "operator:olive"
    assert resolution["inputs"]["evidence"] == "sandbox truth: no charge under this reference"

    # Off the queue.
    page.goto(f"{served.url}/console/queue")
    assert page.locator(f"a:text-is('{lost}')").count() == 0
    context.close()


@pytest.mark.parametrize("served", ["3s"], indirect=True)
def test_a_double_submitted_action_does_one_thing_and_the_console_refuses_what_it_must(
    served: Served, browser: Any, screenshots: Path, backend: str
) -> None:
    lost = served.pay("pm_blackhole", "console-double")
    served.settle(lost, {"MANUAL_REVIEW"})
    # The console's pages allow no script to fetch anything (CSP connect-src
    # 'none'); this test's own script, standing in for a double click, may.
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    sign_in(page, served, token_of(served.operator_auth))
    page.goto(f"{served.url}/console/operations/{lost}/approve-resubmission")
    assert "passed" in page.inner_text("#key-review")
    page.fill("#reason", "provider support: no charge; a new request is safe")
    page.click("button:text-is('Review')")

    # The confirmation form sent twice at once, as a double click on a slow
    # network does: the same page-made Idempotency-Key, so one approval.
    answers = page.evaluate(
        """async () => {
            const form = document.getElementById('confirm-form');
            const send = () => fetch(form.action, {
                method: 'POST', body: new URLSearchParams(new FormData(form)),
            }).then((r) => r.status);
            return Promise.all([send(), send()]);
        }"""
    )
    assert answers == [200, 200]
    assert len(decisions(served, lost, "operator_approved_new_request")) == 1

    # The same form without its CSRF token, or with another session's, is
    # refused and changes nothing.
    form = page.evaluate(
        "() => Object.fromEntries(new FormData(document.getElementById('confirm-form')))"
    )
    action = f"{served.url}/console/operations/{lost}/approve-resubmission"
    without = {k: v for k, v in form.items() if k != "csrf_token"}
    for sent in (without, {**form, "csrf_token": "0" * 64}):
        refused = page.request.post(action, form={**sent, "idempotency_key": "console-other"})
        assert refused.status == 403
        assert refused.json()["type"].endswith("/csrf-token-invalid")
    # From another site (its Origin), even with the token: refused.
    foreign = page.request.post(
        action,
        form={**form, "idempotency_key": "console-foreign"},
        headers={"Origin": "http://attacker.example"},
    )
    assert foreign.status == 403
    assert len(decisions(served, lost, "operator_approved_new_request")) == 1
    context.close()

    # A key without the operator role signs nobody in; signing out ends the session.
    stranger = browser.new_context()
    page = stranger.new_page()
    sign_in(page, served, token_of(served.auth))
    assert "/console/sign-in" in page.url
    assert "operator role" in page.inner_text(".error")
    assert stranger.cookies() == []
    shoot(page, screenshots, "console-refused", backend)
    page.goto(f"{served.url}/console/queue")
    assert "/console/sign-in" in page.url

    # Nor does a key put in the cookie by hand: the cookie holds a session id.
    stranger.add_cookies(
        [
            {
                "name": "intentledger_console",
                "value": token_of(served.operator_auth),
                "url": served.url + "/console",
            }
        ]
    )
    page.goto(f"{served.url}/console/queue")
    assert "/console/sign-in" in page.url
    stranger.clear_cookies()

    sign_in(page, served, "il_not-a-key")
    assert "unknown or revoked" in page.inner_text(".error")

    sign_in(page, served, token_of(served.operator_auth))
    assert page.url.endswith("/console/queue")
    page.click("button:text-is('Sign out')")
    assert "/console/sign-in" in page.url
    assert stranger.cookies() == []
    page.goto(f"{served.url}/console/queue")
    assert "/console/sign-in" in page.url
    stranger.close()
