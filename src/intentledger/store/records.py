"""The rows the store hands out, typed: one frozen record per table, its fields
the table's columns in their order (tests/test_records.py keeps them so).

The engine, the documents and the entry points read these, never a raw row:
what a read selected is what its type says, for mypy as for the reader. A
record is made from a row of `select(table)` (or `RETURNING table`) by
`of(row)`, which relies on that column order; reads of a few columns have a
type of their own beside the read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Self, TypeVar

from sqlalchemy import Row


class TableRecord:
    __slots__ = ()
    # The fields in column order (dataclass sets it on each record).
    __match_args__: tuple[str, ...] = ()

    @classmethod
    def of(cls, row: Row[*tuple[Any, ...]]) -> Self:
        """The record of a row holding every column of its table, in table order."""
        return cls(*row)

    def as_dict(self) -> dict[str, Any]:
        """The columns and their values, in column order (for spreading a record)."""
        return {name: getattr(self, name) for name in self.__match_args__}

    def updated(self, values: Mapping[str, Any]) -> Self:
        """The record as a write of `values` leaves its row: a planned change
        applied, without reading the row back. Every name must be a column."""
        unknown = values.keys() - set(self.__match_args__)
        if unknown:
            raise KeyError(f"{type(self).__name__} has no field {sorted(unknown)}")
        return self.of(tuple(values.get(n, getattr(self, n)) for n in self.__match_args__))  # type: ignore[arg-type]


_Record = TypeVar("_Record", bound=type[TableRecord])


def _built(cls: _Record) -> _Record:
    """`of`, `as_dict` and `updated` written out for the record's fields, as
    dataclasses writes `__init__`. A frozen record's `__init__` sets each field through
    `object.__setattr__`: about 9 µs for an operation's 32 columns, where
    these setters (the slots' own) take about 3 (CPython 3.11)."""
    names = cls.__match_args__
    values = ", ".join(f"v{i}" for i in range(len(names)))
    setters = {f"set{i}": getattr(cls, name).__set__ for i, name in enumerate(names)}
    of = "".join(f"    set{i}(record, v{i})\n" for i in range(len(names)))
    items = ", ".join(f"{name!r}: self.{name}" for name in names)
    kept = ", ".join(f"get({name!r}, self.{name})" for name in names)
    source = (
        f"def of(row):\n    ({values},) = row\n    record = new(cls)\n{of}    return record\n"
        f"def as_dict(self):\n    return {{{items}}}\n"
        "def updated(self, values):\n"
        "    if not values.keys() <= fields:\n"
        "        unknown = sorted(values.keys() - fields)\n"
        "        raise KeyError(f'{cls.__name__} has no field {unknown}')\n"
        "    get = values.get\n"
        f"    return of(({kept},))\n"
    )
    namespace: dict[str, Any] = {
        "new": object.__new__,
        "cls": cls,
        "fields": frozenset(names),
        **setters,
    }
    exec(source, namespace)  # code made of the record's own field names
    cls.of = staticmethod(namespace["of"])  # type: ignore[method-assign]
    cls.as_dict = namespace["as_dict"]  # type: ignore[method-assign]
    cls.updated = namespace["updated"]  # type: ignore[method-assign]
    return cls


@_built
@dataclass(frozen=True, slots=True)
class ApiKeyRecord(TableRecord):
    id: int
    token_hash: str
    actor: str
    is_operator: bool
    created_at: datetime
    revoked_at: datetime | None


@_built
@dataclass(frozen=True, slots=True)
class ConsoleSessionRecord(TableRecord):
    session_hash: str
    api_key_id: int
    created_at: datetime
    expires_at: datetime


@_built
@dataclass(frozen=True, slots=True)
class OperationRecord(TableRecord):
    operation_id: str
    idempotency_key: str
    state: str
    request_context: Any
    first_attempt_at: datetime | None
    last_observed_at: datetime | None
    retry_after_at: datetime | None
    reconciliation_status: str | None
    key_age_at_decision: timedelta | None
    provider_retention_note: str | None
    next_action: str
    actor: str
    route: str
    kind: str
    request_hash: str
    provider: str
    provider_reference: str | None
    outcome: str | None
    amount: int | None
    currency: str | None
    mandate_id: str | None
    version: int
    created_at: datetime
    updated_at: datetime
    duplicate_detected: bool
    outcome_contradicted: bool
    executed_references: Any
    parent_operation_id: str | None
    reaped_at: datetime | None
    reaped_through_observation: int | None
    watch: str | None
    live_keys: int


@_built
@dataclass(frozen=True, slots=True)
class IdempotencyRecord(TableRecord):
    actor: str
    route: str
    idempotency_key: str
    request_hash: str
    resource_id: str
    created_at: datetime


@_built
@dataclass(frozen=True, slots=True)
class DecisionRecord(TableRecord):
    id: int
    operation_id: str
    at: datetime
    rule: str
    inputs: Any
    next_action: str
    reason: str
    key_age_at_decision: timedelta | None
    source: str
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class AttemptRecord(TableRecord):
    id: int
    operation_id: str
    number: int
    provider_idempotency_key: str
    submitted_at: datetime
    relation: str
    resubmission_of: int | None
    decision_id: int | None
    source: str
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class ObservationRecord(TableRecord):
    id: int
    operation_id: str
    at: datetime
    kind: str
    source: str
    attempt_number: int | None
    transport: str | None
    error_class: str | None
    http_status: int | None
    verdict: str | None
    reason: str | None
    provider_reference: str | None
    retry_after_raw: str | None
    retry_after_at: datetime | None
    retry_after_problem: str | None
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class ObservationWithDetailRecord(ObservationRecord):
    """An observation as it reads (`observations_with_detail`): with its provider
    answer, None where there was none or retention removed it."""

    detail: Any


@_built
@dataclass(frozen=True, slots=True)
class ObservationDetailRecord(TableRecord):
    observation_id: int
    retention_bucket: datetime
    detail: Any
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class TransitionRecord(TableRecord):
    id: int
    operation_id: str
    at: datetime
    from_state: str | None
    to_state: str
    next_action: str
    reason: str
    source: str
    actor: str


# An entry of an operation's timeline (Ledger.events_of).
TimelineRecord = TransitionRecord | ObservationWithDetailRecord | DecisionRecord


@_built
@dataclass(frozen=True, slots=True)
class MandateRecord(TableRecord):
    mandate_id: str
    actor: str
    currency: str
    max_amount: int
    total_limit: int
    reserved: int
    spent: int
    status: str
    version: int
    created_at: datetime
    updated_at: datetime


@_built
@dataclass(frozen=True, slots=True)
class CardRecord(TableRecord):
    card_id: str
    actor: str
    label: str | None
    provider_card_id: str | None
    status: str
    indeterminate: bool
    pending_operation_id: str | None
    version: int
    created_at: datetime
    updated_at: datetime


@_built
@dataclass(frozen=True, slots=True)
class OutboxRecord(TableRecord):
    id: int
    operation_id: str
    kind: str
    due_at: datetime
    lease_owner: str | None
    deliveries: int
    decision_id: int | None
    done_at: datetime | None
    created_at: datetime
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class ProviderEventRecord(TableRecord):
    id: int
    provider: str
    event_id: str
    type: str
    received_at: datetime
    signed_at: datetime
    object_id: str | None
    reference: str | None
    operation_id: str | None
    disposition: str
    payload: Any


@_built
@dataclass(frozen=True, slots=True)
class WebhookEndpointRecord(TableRecord):
    endpoint_id: str
    actor: str
    url: str
    events: Any
    secret: str
    created_at: datetime
    deleted_at: datetime | None


@_built
@dataclass(frozen=True, slots=True)
class MerchantEventRecord(TableRecord):
    event_id: str
    actor: str
    type: str
    object_id: str
    payload: str
    created_at: datetime


@_built
@dataclass(frozen=True, slots=True)
class WebhookDeliveryRecord(TableRecord):
    id: int
    event_id: str
    endpoint_id: str
    status: str
    due_at: datetime
    lease_owner: str | None
    attempts: int
    created_at: datetime
    finished_at: datetime | None
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class ListedDeliveryRecord(WebhookDeliveryRecord):
    """A delivery as a merchant lists it: with its event's type, object and time."""

    type: str
    object_id: str
    event_created_at: datetime


@_built
@dataclass(frozen=True, slots=True)
class WebhookAttemptRecord(TableRecord):
    id: int
    delivery_id: int
    at: datetime
    duration_ms: int
    http_status: int | None
    error: str | None
    delivered: bool
    next_attempt_at: datetime | None
    actor: str


@_built
@dataclass(frozen=True, slots=True)
class QueueRow(TableRecord):
    """An operation as the operator's work queue lists it: store/work_queue.py's
    `QUEUE_COLUMNS`, in their order."""

    operation_id: str
    kind: str
    actor: str
    provider: str
    state: str
    next_action: str
    amount: int | None
    currency: str | None
    duplicate_detected: bool
    outcome_contradicted: bool
    created_at: datetime
    updated_at: datetime
    watch: str | None
