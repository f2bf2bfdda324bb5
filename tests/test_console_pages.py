"""The console's pages in process, on both databases: what the work queue shows
and in which order, its paging and filters, the partial index it reads through,
and every refusal (each changes nothing). The browser tests are test_console.py.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import event, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.app import create_app
from intentledger.console.pages import human_duration, templates
from intentledger.console.session import COOKIE, csrf_token
from intentledger.domain.states import NextAction, State
from intentledger.domain.work_queue import QueueFacts, needs
from intentledger.engine.api_keys import create_api_key, hash_token
from intentledger.store.console_sessions import find_key, open_session
from intentledger.store.ledger import Ledger
from intentledger.store.tables import attempts, cards, decisions, mandates, operations
from intentledger.store.work_queue import QueueFilter, work_queue

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
THRESHOLD = timedelta(minutes=15)
HTML = {"Accept": "text/html"}


@dataclass
class Console:
    client: httpx.AsyncClient
    operator_token: str
    merchant_token: str
    engine: AsyncEngine
    session: str

    def csrf(self) -> str:
        return csrf_token(self.session)

    async def session_of(self, token: str) -> str:
        """A session opened straight in the store (sign-in refuses a merchant's
        key; the pages must refuse its session too, should one exist)."""
        async with self.engine.begin() as conn:
            key = await find_key(conn, hash_token(token))
            assert key is not None
            opened = await open_session(conn, key, NOW, timedelta(hours=1))
        return opened.session_id


@pytest.fixture
async def console(engine: AsyncEngine) -> AsyncIterator[Console]:
    operator_token = await create_api_key(engine, lambda: NOW, "olive", True)
    merchant_token = await create_api_key(engine, lambda: NOW, "dora", False)
    app = create_app(engine, lambda: NOW, "sandbox", operator_queue_after=THRESHOLD)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console.test") as client:
        made = Console(client, operator_token, merchant_token, engine, "")
        made.session = await made.session_of(operator_token)
        client.cookies.set(COOKIE, made.session)
        yield made


_serial = iter(range(1, 1_000_000))


async def add_operation(
    engine: AsyncEngine,
    *,
    state: State,
    next_action: NextAction,
    age: timedelta,
    actor: str = "dora",
    provider: str = "sandbox",
    duplicate: bool = False,
    contradicted: bool = False,
    mandate_id: str | None = None,
    kind: str = "payment",
) -> str:
    operation_id = f"op_{next(_serial):06d}"
    at = NOW - age
    async with engine.begin() as conn:
        await conn.execute(
            insert(operations).values(
                operation_id=operation_id,
                idempotency_key=f"k-{operation_id}",
                state=state.value,
                request_context={"route": "POST /v1/payments", "body": {}},
                next_action=next_action.value,
                actor=actor,
                route="POST /v1/payments",
                kind=kind,
                request_hash="0" * 64,
                provider=provider,
                amount=990,
                currency="EUR",
                mandate_id=mandate_id,
                version=1,
                created_at=at,
                updated_at=at,
                duplicate_detected=duplicate,
                outcome_contradicted=contradicted,
                outcome="succeeded" if state == State.OUTCOME_KNOWN else None,
            )
        )
    return operation_id


def listed(page: str) -> list[str]:
    return re.findall(r'<a href="/console/operations/(op_\d+)">', page)


def count(page: str, name: str) -> int:
    found = re.search(rf'id="count-{name}">(\d+)<', page)
    assert found is not None, name
    return int(found.group(1))


async def test_the_queue_shows_what_needs_a_person_oldest_first_in_pages(console: Console) -> None:
    engine = console.engine
    expected: list[tuple[timedelta, str]] = []
    shown_not: list[str] = []
    minute = timedelta(minutes=1)
    for i in range(60):
        age = (i + 1) * minute
        op = await add_operation(
            engine, state=State.MANUAL_REVIEW, next_action=NextAction.OPERATOR, age=age
        )
        expected.append((age, op))
    for i in range(12):
        age = THRESHOLD + i * minute
        op = await add_operation(
            engine, state=State.UNKNOWN, next_action=NextAction.RECONCILE, age=age
        )
        expected.append((age, op))
    for i in range(5):  # still young: the engine is working on them
        shown_not.append(
            await add_operation(
                engine,
                state=State.SAFETY_REVIEW,
                next_action=NextAction.REVIEW_SAFETY,
                age=THRESHOLD - (i + 1) * minute,
            )
        )
    for i in range(4):
        age = timedelta(days=2, minutes=i)
        expected.append(
            (
                age,
                await add_operation(
                    engine,
                    state=State.OUTCOME_KNOWN,
                    next_action=NextAction.OPERATOR,
                    age=age,
                    duplicate=i % 2 == 0,
                    contradicted=i % 2 == 1,
                ),
            )
        )
    for _ in range(6):
        shown_not.append(
            await add_operation(
                engine,
                state=State.OUTCOME_KNOWN,
                next_action=NextAction.NONE,
                age=timedelta(days=3),
            )
        )

    seen: list[str] = []
    response = await console.client.get("/console/queue")
    first = response.text
    while True:
        assert response.status_code == 200, response.text
        seen.extend(listed(response.text))
        following = re.search(r'href="/console/queue(\?[^"]+)" rel="next"', response.text)
        if following is None:
            break
        response = await console.client.get(
            "/console/queue" + following.group(1).replace("&amp;", "&")
        )
    oldest_first = [op for _, op in sorted(expected, key=lambda pair: pair[0], reverse=True)]
    assert seen == oldest_first
    assert not set(seen) & set(shown_not)
    assert count(first, "total") == 76
    assert (count(first, "operator"), count(first, "waiting")) == (64, 12)
    assert (count(first, "duplicate"), count(first, "contradicted")) == (2, 2)


async def test_the_queue_and_the_domain_agree_on_who_needs_a_person(engine: AsyncEngine) -> None:
    """Every combination of state, next action, flags and age: the SQL queue and
    the pure rule (domain/work_queue.needs) pick the same operations."""
    combinations = []
    for state in State:
        for action in (NextAction.OPERATOR, NextAction.RECONCILE, NextAction.NONE):
            for flags in ((False, False), (True, False), (False, True)):
                for age in (THRESHOLD - timedelta(seconds=1), THRESHOLD, timedelta(days=1)):
                    op = await add_operation(
                        engine,
                        state=state,
                        next_action=action,
                        age=age,
                        duplicate=flags[0],
                        contradicted=flags[1],
                    )
                    facts = QueueFacts(state, action, flags[0], flags[1], NOW - age)
                    combinations.append((op, bool(needs(facts, NOW, THRESHOLD))))
    async with engine.connect() as conn:
        page = await work_queue(conn, NOW, THRESHOLD, QueueFilter(), None, 10_000)
    assert {row.operation_id for row in page.rows} == {op for op, wanted in combinations if wanted}


async def test_the_queue_reads_through_its_partial_index(console: Console) -> None:
    """The page query itself, as sent, is planned on the partial index: its
    WHERE carries the index's predicate the way SQLite needs to see it."""
    for _ in range(3):
        await add_operation(
            console.engine,
            state=State.MANUAL_REVIEW,
            next_action=NextAction.OPERATOR,
            age=THRESHOLD,
        )
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "ORDER BY operations.created_at" in statement:
            sent.append((statement, parameters))

    sync_engine = console.engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", capture)
    try:
        async with console.engine.connect() as conn:
            await work_queue(conn, NOW, THRESHOLD, QueueFilter(actor="dora"), None, 50)
    finally:
        event.remove(sync_engine, "before_cursor_execute", capture)
    [(statement, parameters)] = sent
    async with console.engine.connect() as conn:
        if console.engine.dialect.name == "sqlite":
            plan = await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
        else:
            # A three-row table is read fastest whole, or through any index
            # (the primary key holds the actor): give it the settled many a
            # real ledger has, which the partial index leaves out.
            await conn.exec_driver_sql(
                "INSERT INTO operations (operation_id, idempotency_key, state, "
                "request_context, next_action, actor, route, kind, request_hash, provider, "
                "version, created_at, updated_at) SELECT 'op_settled_' || n, 'k' || n, "
                "'OUTCOME_KNOWN', '{}', 'none', 'dora', 'r', 'payment', 'h', 'sandbox', 1, "
                "now(), now() FROM generate_series(1, 5000) AS n"
            )
            await conn.exec_driver_sql("ANALYZE operations")
            await conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            plan = await conn.exec_driver_sql("EXPLAIN " + statement, parameters)
        described = " ".join(str(row) for row in plan.all())
    assert "ix_operations_work_queue" in described, described


# -- refusals: each is clear, and changes nothing ------------------------------------------


async def decision_count(engine: AsyncEngine, operation_id: str) -> int:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(func.count())
            .select_from(decisions)
            .where(decisions.c.operation_id == operation_id)
        )
        return int(rows.scalar_one())


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ({"state": "LOST"}, "no state"),
        ({"older_than": "1 hour"}, "duration"),
        ({"older_than": "-5m"}, "duration"),
        ({"actor": "x" * 300}, "actor"),
        ({"actor": "nul\x00here"}, "actor"),
        ({"provider": "p" * 33}, "provider"),
        ({"after": "yesterday"}, "queue position"),
        ({"after": "2026-11-30T12:00:00~op_1"}, "queue position"),  # no time zone
        ({"after": "2026-11-30T12:00:00+00:00~op_\x00"}, "queue position"),
        ({"after": "2026-11-30T12:00:00+00:00~" + "o" * 41}, "queue position"),
        ({"older_than": "999999999d"}, "at most"),
        ({"after": "0001-01-01T00:00:00+01:00~op_x"}, "queue position"),
        ({"after": "9999-12-31T23:59:59-01:00~op_x"}, "queue position"),
    ],
)
async def test_a_bad_queue_filter_is_a_clear_400(
    console: Console, query: dict[str, str], detail: str
) -> None:
    answer = await console.client.get("/console/queue", params=query)
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/problem+json"
    assert detail in answer.json()["detail"]
    page = await console.client.get("/console/queue", params=query, headers=HTML)
    assert page.status_code == 400 and "text/html" in page.headers["content-type"]
    assert detail in page.text


async def test_action_posts_are_refused_unless_complete_and_change_nothing(
    console: Console,
) -> None:
    # UNKNOWN: escalating it is allowed, so "changes nothing" below can fail.
    op = await add_operation(
        console.engine, state=State.UNKNOWN, next_action=NextAction.RECONCILE, age=THRESHOLD
    )
    path = f"/console/operations/{op}/escalate"
    good = {
        "csrf_token": console.csrf(),
        "reason": "why",
        "idempotency_key": "console-abcdefgh",
        "version": "1",
    }

    async def refused(status: int, slug: str, **kwargs: Any) -> None:
        answer = await console.client.post(kwargs.pop("path", path), **kwargs)
        assert answer.status_code == status, answer.text
        assert answer.json()["type"].endswith("/" + slug)

    await refused(415, "unsupported-media-type", json=good)
    await refused(413, "body-too-large", data={**good, "reason": "x" * 20_000})
    await refused(
        400,
        "invalid-form",
        content="csrf_token=a&csrf_token=b",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    await refused(400, "invalid-form", data={**good, "reason": "a\x00b"})
    await refused(400, "confirmation-invalid", data={**good, "idempotency_key": "mine"})
    await refused(
        400, "idempotency-key-invalid", data={**good, "idempotency_key": "console-\x01 x"}
    )
    await refused(
        400, "confirmation-invalid", data={k: v for k, v in good.items() if k != "version"}
    )
    await refused(400, "confirmation-invalid", data={**good, "version": "1e3"})
    await refused(409, "changed-since-reviewed", data={**good, "version": "2"})
    await refused(422, "invalid-request", data={**good, "reason": ""})
    await refused(
        403, "csrf-token-invalid", data={k: v for k, v in good.items() if k != "csrf_token"}
    )
    await refused(403, "cross-origin-post", data=good, headers={"Origin": "https://evil.example"})
    await refused(404, "not-found", data=good, path=f"/console/operations/{op}/delete")
    await refused(404, "not-found", data=good, path=f"/console/operations/{'x' * 41}/escalate")
    # An UNKNOWN operation cannot be approved a new request: the engine's refusal.
    await refused(
        409, "action-not-allowed", data=good, path=f"/console/operations/{op}/approve-resubmission"
    )
    await refused(
        404, "operation-not-found", data=good, path="/console/operations/op_nobody/escalate"
    )
    console.client.cookies.clear()
    await refused(401, "unauthorized", data=good)
    merchant_session = await console.session_of(console.merchant_token)
    console.client.cookies.set(COOKIE, merchant_session)
    await refused(
        403, "operator-role-required", data={**good, "csrf_token": csrf_token(merchant_session)}
    )
    assert await decision_count(console.engine, op) == 0
    # The complete form, from the operator's session, does it (so the above could fail).
    console.client.cookies.set(COOKIE, console.session)
    done = await console.client.post(path, data=good)
    assert done.status_code == 303 and await decision_count(console.engine, op) == 1


async def test_pages_carry_their_security_headers_and_sign_in_never_redirects_away(
    console: Console,
) -> None:
    page = await console.client.get("/console/queue")
    assert page.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-store"
    console.client.cookies.clear()
    away = await console.client.post(
        "/console/sign-in", data={"token": console.operator_token, "next": "//evil.example/x"}
    )
    assert away.status_code == 303 and away.headers["location"] == "/console/queue"
    cookie = away.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
    console.client.cookies.clear()
    anonymous = await console.client.get("/console/operations/op_1", headers=HTML)
    assert anonymous.status_code == 303
    assert anonymous.headers["location"].startswith("/console/sign-in?next=")


async def test_mandate_and_card_pages_show_reservations_and_indeterminate_projections(
    console: Console,
) -> None:
    async with console.engine.begin() as conn:
        await conn.execute(
            insert(mandates).values(
                mandate_id="md_console",
                actor="dora",
                currency="EUR",
                max_amount=5000,
                total_limit=20000,
                reserved=1980,
                spent=990,
                status="active",
                version=1,
                created_at=NOW,
                updated_at=NOW,
            )
        )
    pending = await add_operation(
        console.engine,
        state=State.UNKNOWN,
        next_action=NextAction.RECONCILE,
        age=timedelta(minutes=1),
        mandate_id="md_console",
    )
    card_op = await add_operation(
        console.engine,
        state=State.UNKNOWN,
        next_action=NextAction.RECONCILE,
        age=timedelta(minutes=1),
        kind="card_freeze",
    )
    async with console.engine.begin() as conn:
        await conn.execute(
            insert(cards).values(
                card_id="crd_console",
                actor="dora",
                label="travel",
                provider_card_id="card_1",
                status="active",
                indeterminate=True,
                pending_operation_id=card_op,
                version=1,
                created_at=NOW,
                updated_at=NOW,
            )
        )
    listed_mandates = await console.client.get("/console/mandates", params={"status": "active"})
    assert "md_console" in listed_mandates.text and ">19.80 EUR (1980)<" in listed_mandates.text
    mandate = await console.client.get("/console/mandates/md_console")
    assert pending in mandate.text and "19.80 EUR (1980)" in mandate.text
    indeterminate = await console.client.get("/console/cards", params={"indeterminate": "yes"})
    assert "crd_console" in indeterminate.text and card_op in indeterminate.text
    determinate = await console.client.get("/console/cards", params={"indeterminate": "no"})
    assert "crd_console" not in determinate.text
    card = await console.client.get("/console/cards/crd_console")
    assert card_op in card.text and "indeterminate" in card.text.lower()
    assert (await console.client.get("/console/cards/crd_nobody")).status_code == 404
    assert (
        await console.client.get("/console/mandates", params={"status": "x"})
    ).status_code == 400


def test_amounts_read_in_major_units_beside_the_minor_units() -> None:
    money = templates.env.filters["money"]  # the domain's format_amount
    assert (money(990, "EUR"), money(5, "JPY"), money(-1005, "USD")) == (
        "9.90 EUR (990)",
        "5 JPY (5)",
        "-10.05 USD (-1005)",
    )
    assert (money(None, "EUR"), money(12, None)) == ("—", "12 (minor units)")


async def test_the_queue_and_an_operation_show_amounts_the_one_way(console: Console) -> None:
    """The console shows an amount as `ops list`, `ops show` and `demo` do
    (domain/currencies.format_amount): major units, then the API's minor units."""
    stuck = await add_operation(
        console.engine,
        state=State.MANUAL_REVIEW,
        next_action=NextAction.OPERATOR,
        age=timedelta(hours=1),
    )
    queue = await console.client.get("/console/queue")
    assert stuck in queue.text and "9.90 EUR (990)" in queue.text, queue.text
    page = await console.client.get(f"/console/operations/{stuck}")
    assert page.status_code == 200 and "9.90 EUR (990)" in page.text


async def test_the_sign_in_page_says_the_cookie_holds_a_session_id(console: Console) -> None:
    console.client.cookies.clear()
    page = await console.client.get("/console/sign-in")
    assert page.status_code == 200
    text = " ".join(re.sub(r"<[^>]+>", " ", page.text).split())
    assert "the cookie holds only that session's random id" in text, text
    assert "The key is not kept in your browser" in text
    assert "12 h at most" in text


async def test_refunding_a_duplicate_offers_only_the_extra_charge_and_confirms_first(
    console: Console,
) -> None:
    op = await add_operation(
        console.engine,
        state=State.OUTCOME_KNOWN,
        next_action=NextAction.OPERATOR,
        age=timedelta(hours=1),
        duplicate=True,
    )
    async with console.engine.begin() as conn:
        await conn.execute(
            operations.update()
            .where(operations.c.operation_id == op)
            .values(provider_reference="ch_settled", executed_references=["ch_settled", "ch_extra"])
        )
    story = await console.client.get(f"/console/operations/{op}")
    assert f'/console/operations/{op}/refund-duplicate"' in story.text
    assert "/resolve" not in story.text  # settled and not contradicted: nothing to resolve
    form = await console.client.get(f"/console/operations/{op}/refund-duplicate")
    assert re.findall(r'<option value="(ch_\w+)"', form.text) == ["ch_extra"]
    review = await console.client.post(
        f"/console/operations/{op}/refund-duplicate/review",
        data={"csrf_token": console.csrf(), "charge": "ch_extra", "reason": "charged twice"},
    )
    assert review.status_code == 200
    [key] = re.findall(r'name="idempotency_key" value="(console-[\w-]+)"', review.text)
    assert 'name="charge" value="ch_extra"' in review.text
    assert await decision_count(console.engine, op) == 0, "a review page does nothing"
    another = await console.client.post(
        f"/console/operations/{op}/refund-duplicate/review",
        data={"csrf_token": console.csrf(), "charge": "ch_extra", "reason": "charged twice"},
    )
    assert key not in another.text, "each confirmation page makes its own key"

    # Confirmed twice (a double click): one refund, and the second answer says so.
    confirm = {
        "csrf_token": console.csrf(),
        "idempotency_key": key,
        "version": re.findall(r'name="version" value="(\d+)"', review.text)[0],
        "charge": "ch_extra",
        "reason": "charged twice",
    }
    path = f"/console/operations/{op}/refund-duplicate"
    first = await console.client.post(path, data=confirm)
    assert first.status_code == 303
    assert "Refund duplicate: Done." in (await console.client.get(first.headers["location"])).text
    second = await console.client.post(path, data=confirm)
    assert second.status_code == 303
    shown = (await console.client.get(second.headers["location"])).text
    assert "Refund duplicate: Already done" in shown
    assert "Already done" not in (await console.client.get(second.headers["location"])).text
    async with console.engine.connect() as conn:
        made = await conn.execute(select(operations).where(operations.c.parent_operation_id == op))
        assert len(made.all()) == 1
    # The other confirmation page, from before the refund: the engine refuses a
    # second refund of the charge while the first is in flight.
    [other_key] = re.findall(r'name="idempotency_key" value="(console-[\w-]+)"', another.text)
    stale = await console.client.post(path, data={**confirm, "idempotency_key": other_key})
    assert stale.status_code == 409 and "in flight" in stale.json()["detail"]


async def test_two_review_pages_for_one_approval_approve_once(console: Console) -> None:
    """Two operators (or two tabs) review the same new-key request; each page
    has its own key, so only the operation's version keeps the second out."""
    op = await add_operation(
        console.engine, state=State.MANUAL_REVIEW, next_action=NextAction.OPERATOR, age=THRESHOLD
    )
    async with console.engine.begin() as conn:
        await conn.execute(
            attempts.insert().values(
                operation_id=op,
                actor="dora",
                number=1,
                provider_idempotency_key=f"{op}:1",
                submitted_at=NOW - THRESHOLD,
                relation="original",
                source="test",
            )
        )
    reason = {"csrf_token": console.csrf(), "reason": "support says nothing executed"}
    path = f"/console/operations/{op}/approve-resubmission"
    pages = [(await console.client.post(path + "/review", data=reason)).text for _ in range(2)]
    assert all(f"{op}:2" in page for page in pages)
    answers = []
    for page in pages:
        [key] = re.findall(r'name="idempotency_key" value="(console-[\w-]+)"', page)
        [version] = re.findall(r'name="version" value="(\d+)"', page)
        answers.append(
            await console.client.post(
                path, data={**reason, "idempotency_key": key, "version": version}
            )
        )
    assert [a.status_code for a in answers] == [303, 409]
    async with console.engine.connect() as conn:
        rows = await conn.execute(select(decisions.c.rule).where(decisions.c.operation_id == op))
        assert [r.rule for r in rows] == ["operator_approved_new_request"]
    # Nor does the API approve a second time while the first is on its way.
    page = (await console.client.get(f"/console/operations/{op}")).text
    assert "approve-resubmission" not in page


def test_durations_read_like_a_person_writes_them() -> None:
    assert [human_duration(s) for s in (None, 3.86, 42, 3_900, 90_061)] == [
        "—",
        "3.9 s",
        "42 s",
        "1 h 5 min",
        "1 d 1 h",
    ]


async def test_a_session_ends_on_sign_out_on_expiry_and_when_its_key_is_revoked(
    console: Console,
) -> None:
    async def shows_queue(session: str) -> bool:
        console.client.cookies.set(COOKIE, session)
        answer = await console.client.get("/console/queue")
        return answer.status_code == 200

    assert await shows_queue(console.session)
    # Sign-out closes it on the server: the same cookie, sent again, opens nothing.
    out = await console.client.post("/console/sign-out", data={"csrf_token": console.csrf()})
    assert out.status_code == 303
    assert not await shows_queue(console.session)

    async with console.engine.begin() as conn:
        key = await find_key(conn, hash_token(console.operator_token))
        assert key is not None
        expired = await open_session(conn, key, NOW - timedelta(hours=13), timedelta(hours=12))
    assert not await shows_queue(expired.session_id)

    fresh = await console.session_of(console.operator_token)
    assert await shows_queue(fresh)
    async with console.engine.begin() as conn:
        await Ledger(conn).revoke_api_key(key.key_id, NOW)
    assert not await shows_queue(fresh), "a revoked key's session ends at once"
    # And the key signs nobody in again, at once (no cache on the way in).
    console.client.cookies.clear()
    again = await console.client.post("/console/sign-in", data={"token": console.operator_token})
    assert again.status_code == 401 and "set-cookie" not in again.headers
