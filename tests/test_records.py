"""The typed records (store/records.py) are their tables' columns, in column
order and of compatible types: `of(row)` relies on the order, and mypy on the types."""

from __future__ import annotations

import typing
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import JSON, Boolean, Integer, Interval, String, Text
from sqlalchemy.sql.expression import ColumnElement
from sqlalchemy.types import TypeEngine

from intentledger.store import records, tables
from intentledger.store.work_queue import QUEUE_COLUMNS

RECORDS: dict[type[records.TableRecord], Any] = {
    records.ApiKeyRecord: tables.api_keys,
    records.ConsoleSessionRecord: tables.console_sessions,
    records.OperationRecord: tables.operations,
    records.IdempotencyRecord: tables.idempotency_records,
    records.DecisionRecord: tables.decisions,
    records.AttemptRecord: tables.attempts,
    records.ObservationRecord: tables.observations,
    records.ObservationWithDetailRecord: tables.observations_with_detail,
    records.ObservationDetailRecord: tables.observation_details,
    records.TransitionRecord: tables.transitions,
    records.MandateRecord: tables.mandates,
    records.CardRecord: tables.cards,
    records.OutboxRecord: tables.outbox,
    records.ProviderEventRecord: tables.provider_events,
    records.WebhookEndpointRecord: tables.webhook_endpoints,
    records.MerchantEventRecord: tables.merchant_events,
    records.WebhookDeliveryRecord: tables.webhook_deliveries,
    records.WebhookAttemptRecord: tables.webhook_attempts,
}


def _python_type(sql_type: TypeEngine[Any]) -> object:
    if isinstance(sql_type, JSON):
        return Any
    if isinstance(sql_type, tables.UTCDateTime):
        return datetime
    for sql, python in ((Boolean, bool), (Integer, int), (String, str), (Text, str)):
        if isinstance(sql_type, sql):
            return python
    if isinstance(sql_type, Interval):
        return timedelta
    raise AssertionError(f"no Python type known for {sql_type!r}")


def _expected(column: ColumnElement[Any]) -> object:
    python = _python_type(column.type)
    # A label (a joined column renamed) is as nullable as what it names.
    nullable = getattr(getattr(column, "element", column), "nullable", True)
    return python if python is Any or not nullable else python | None


def _assert_fields_are(record: type[records.TableRecord], columns: list[Any]) -> None:
    hints = typing.get_type_hints(record)
    assert record.__match_args__ == tuple(c.name for c in columns)
    for column in columns:
        assert hints[column.name] == _expected(column), (record.__name__, column.name)


def test_every_table_has_its_record() -> None:
    assert {t.name for t in RECORDS.values()} >= set(tables.metadata.tables)


@pytest.mark.parametrize("record", list(RECORDS), ids=lambda r: r.__name__)
def test_a_record_is_its_tables_columns(record: type[records.TableRecord]) -> None:
    _assert_fields_are(record, list(RECORDS[record].c))


def test_the_queues_rows_are_its_columns() -> None:
    _assert_fields_are(records.QueueRow, list(QUEUE_COLUMNS))


def test_a_listed_delivery_is_the_delivery_and_its_events_fields() -> None:
    extra = [tables.merchant_events.c.type, tables.merchant_events.c.object_id]
    extra.append(tables.merchant_events.c.created_at.label("event_created_at"))
    _assert_fields_are(records.ListedDeliveryRecord, [*tables.webhook_deliveries.c, *extra])


def test_of_and_as_dict_follow_the_columns() -> None:
    names = records.MandateRecord.__match_args__
    values = tuple(f"v{i}" for i in range(len(names)))
    mandate = records.MandateRecord.of(values)  # type: ignore[arg-type]
    assert mandate == records.MandateRecord(*values)  # type: ignore[arg-type]
    assert mandate.as_dict() == dict(zip(names, values, strict=True))
    with pytest.raises(ValueError):
        records.MandateRecord.of(values[:-1])  # type: ignore[arg-type]
