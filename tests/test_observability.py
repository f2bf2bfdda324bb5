"""Metrics, logs and redaction, piece by piece (the real-process proofs are in
test_prometheus_scrape.py and test_no_secrets_leak.py)."""

from __future__ import annotations

import json
import logging
import sys
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.states import State
from intentledger.observability.logs import (
    JsonFormatter,
    TextFormatter,
    bind_log_context,
    log_context,
)
from intentledger.observability.metrics import LABEL_NAMES, after_commit
from intentledger.providers.http import (
    DROPPED_FIELDS,
    LAST_FOUR_FIELDS,
    last_four,
    redacted,
    redacted_text,
)
from tests.served import Served

# What no label may ever be: each would make a time series per request.
FORBIDDEN_LABELS = {"operation_id", "actor", "key", "idempotency_key", "url", "endpoint", "id"}


def _record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("intentledger.test")
    return logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, message, args, None, extra=extra
    )


def test_json_formatter_writes_one_object_per_line_with_the_context() -> None:
    with log_context(operation_id="op_1", worker="worker:h:1"), log_context(attempt=2):
        line = JsonFormatter().format(
            _record("%s went\nUNKNOWN", "op_1", event="operation.unknown", rule="r")
        )
    assert "\n" not in line
    document = json.loads(line)
    assert list(document)[:8] == [
        "time",
        "level",
        "logger",
        "message",
        "operation_id",
        "attempt",
        "worker",
        "event",
    ]
    assert document["message"] == "op_1 went\nUNKNOWN"
    assert document["level"] == "WARNING"
    assert document["logger"] == "intentledger.test"
    assert document["time"].endswith("+00:00")
    assert (document["operation_id"], document["attempt"]) == ("op_1", 2)
    assert (document["event"], document["rule"]) == ("operation.unknown", "r")
    # Outside the block the context is gone.
    assert "operation_id" not in json.loads(JsonFormatter().format(_record("plain")))


def test_a_context_leaves_out_none_and_ends_with_its_block_even_on_an_error() -> None:
    def fields() -> dict[str, object]:
        document = json.loads(JsonFormatter().format(_record("x")))
        return {k: document[k] for k in ("operation_id", "attempt", "worker") if k in document}

    with log_context(operation_id="op_1", attempt=None):
        assert fields() == {"operation_id": "op_1"}
        with pytest.raises(ValueError), log_context(attempt=3, operation_id="op_2"):
            assert fields() == {"operation_id": "op_2", "attempt": 3}
            raise ValueError("inside")
        assert fields() == {"operation_id": "op_1"}
    assert fields() == {}


def test_json_formatter_keeps_the_traceback_inside_the_object() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    document = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in document["exception"]


def test_text_formatter_appends_the_context() -> None:
    with log_context(operation_id="op_2"):
        line = TextFormatter().format(_record("sweep", event="sweep"))
    assert line.endswith("sweep [operation_id=op_2 event=sweep]")


async def test_a_bound_context_reaches_tasks_started_after() -> None:
    import asyncio

    async def child() -> str:
        return JsonFormatter().format(_record("child"))

    async def parent() -> str:
        bind_log_context(worker="worker:x")
        return await asyncio.create_task(child())

    assert json.loads(await asyncio.create_task(parent()))["worker"] == "worker:x"


async def test_after_commit_runs_on_commit_only(engine: AsyncEngine) -> None:
    ran: list[str] = []
    async with engine.begin() as conn:
        after_commit(conn, lambda: ran.append("committed"))
        assert ran == []
    assert ran == ["committed"]
    with pytest.raises(RuntimeError):
        async with engine.begin() as conn:
            after_commit(conn, lambda: ran.append("rolled back"))
            raise RuntimeError
    # A read-only unit of work that is closed, not committed, drops its actions too.
    async with engine.connect() as conn:
        after_commit(conn, lambda: ran.append("never committed"))
        await conn.execute(text("SELECT 1"))
    # The pooled connection's next transaction starts with nothing pending.
    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1"))
    assert ran == ["committed"]


def test_account_and_card_numbers_keep_their_last_four() -> None:
    body = {
        "id": "ben_1",
        "iban": "DE89370400440532013000",
        "data": [{"card": {"number": "4242424242424242", "cvc": "123", "last4": "4242"}}],
    }
    assert redacted(body) == {
        "id": "ben_1",
        "iban": "****3000",
        "data": [{"card": {"number": "****4242", "cvc": "***", "last4": "4242"}}],
    }
    text_body = "iban DE89 3704 0044 0532 0130 00 card 4242-4242-4242-4242 ok"
    assert redacted_text(text_body) == "iban ****3000 card ****4242 ok"


def _redacted_by_the_rule(value: object) -> object:
    """The redaction rule written plainly, every value through the same call:
    `redacted` keeps scalars without one, and must agree with this."""
    if isinstance(value, dict):
        kept: dict[object, object] = {}
        for name, item in value.items():
            lowered = name.lower() if isinstance(name, str) else name
            if lowered in DROPPED_FIELDS:
                kept[name] = "***"
            elif lowered in LAST_FOUR_FIELDS and isinstance(item, str | int):
                kept[name] = last_four(str(item))
            else:
                kept[name] = _redacted_by_the_rule(item)
        return kept
    if isinstance(value, list):
        return [_redacted_by_the_rule(item) for item in value]
    return value


_FIELD_NAMES = st.sampled_from(
    [*sorted(DROPPED_FIELDS | LAST_FOUR_FIELDS), "CVC", "Number", "id", "status", "card", "data"]
)
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=24)
_BODIES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_FIELD_NAMES, inner, max_size=5),
    max_leaves=20,
)


@given(_BODIES)
def test_redaction_agrees_with_its_rule_on_any_body(body: object) -> None:
    # A number or key nested at any depth, as a scalar or under a container.
    assert json.dumps(redacted(body)) == json.dumps(_redacted_by_the_rule(body))


def _samples(exposition: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    ]


def test_every_metric_of_ours_has_bounded_labels(served: Served) -> None:
    """After a few payments (one ends UNKNOWN), the API's /metrics: only the
    known label names, none naming a request, and the numbers agree with the ledger."""
    ok = served.pay("pm_ok", "m-ok")
    lost = served.pay("pm_timeout_after_execute", "m-lost")
    served.settle(ok, {"OUTCOME_KNOWN"})
    served.settle(lost, {"UNKNOWN", "RECONCILIATION_DUE", "OUTCOME_KNOWN"})
    exposition = httpx.get(f"{served.url}/metrics").text
    samples = _samples(exposition)
    ours = [(name, labels, value) for name, labels, value in samples if "intentledger" in name]
    assert ours
    for name, labels, _ in ours:
        assert set(labels) <= LABEL_NAMES | {"le"}, (name, labels)
        assert not set(labels) & FORBIDDEN_LABELS, (name, labels)
        assert ok not in exposition and lost not in exposition
        for key in ("state", "to_state"):
            if key in labels:
                assert labels[key] in set(State), (name, labels)
    by_name = {(name, tuple(sorted(labels.items()))): value for name, labels, value in ours}
    assert by_name[("intentledger_ledger_readable", ())] == 1
    accepted = by_name[
        ("intentledger_transitions_total", (("from_state", "none"), ("to_state", "ACCEPTED")))
    ]
    assert accepted >= 2
    submits = sum(
        value
        for name, labels, value in ours
        if name == "intentledger_provider_call_seconds_count" and labels["call"] == "submit"
    )
    assert submits >= 2
    assert any(
        name == "intentledger_classifications_total" and labels["transport"] == "no_response"
        for name, labels, _ in ours
    )
    server = {
        name: value for name, labels, value in ours if name.startswith("intentledger_database_")
    }
    if served.database_url.startswith("sqlite"):
        assert server == {}
    else:
        # The suite's server: started before this test, alone, with no standby.
        assert 0 < server["intentledger_database_server_start_time_seconds"] < time.time()
        assert server["intentledger_database_commits_wait_for_standby"] == 0
        assert server["intentledger_database_synchronous_standbys"] == 0


def test_the_process_registry_holds_only_bounded_label_names() -> None:
    """Every metric this package defines, whether or not it has counted yet."""
    names = [
        collector for collector in REGISTRY.collect() if collector.name.startswith("intentledger_")
    ]
    assert {family.name for family in names} >= {
        "intentledger_transitions",
        "intentledger_decisions",
        "intentledger_provider_call_seconds",
        "intentledger_lease_expiries",
        "intentledger_group_commit_size",
    }
    import intentledger.observability.metrics as metrics

    for value in vars(metrics).values():
        label_names = getattr(value, "_labelnames", None)
        if label_names is not None:
            assert set(label_names) <= LABEL_NAMES, value
