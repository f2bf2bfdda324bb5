"""Intake writes its rows and its answer with orjson, and the batch its own rows;
they must say exactly what the stdlib's JSON said (store/batches.py,
store/intake.py, api/app.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from enum import Enum, IntEnum
from zoneinfo import ZoneInfo

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from intentledger.api.app import AcceptedIntent
from intentledger.documents import new_payment_document, operation_document
from intentledger.domain.canonical import request_hash
from intentledger.domain.states import NextAction, State
from intentledger.domain.transport import Transport, Verdict
from intentledger.engine.intake import IntakeResult, Intent, operation_values
from intentledger.store.batches import (
    _CONTAINERS_WALKED_AT_MOST,
    _json_answer_rows,
    _stdlib_answer_rows,
    json_instant,
    json_rows,
)
from intentledger.store.intake import json_intake_rows
from intentledger.store.records import OperationRecord

ROUTE = "POST /v1/payments"
LONDON_WINTER = datetime(2026, 12, 1, 20, 0, tzinfo=ZoneInfo("Europe/London"))
# Any Unicode a validated request may carry (no lone surrogates: the canonical
# hash refuses them before intake), control characters and quotes included.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


@given(
    reference=TEXT,
    metadata=st.dictionaries(TEXT, TEXT, max_size=4),
    amount=st.integers(1, 99_999_999),
    micros=st.integers(0, 999_999),
    mandate_id=st.none() | TEXT,
)
def test_intake_rows_and_answer_say_what_the_stdlib_said(
    reference: str, metadata: dict[str, str], amount: int, micros: int, mandate_id: str | None
) -> None:
    body = {
        "amount": amount,
        "currency": "EUR",
        "payment_method": "pm_ok",
        "reference": reference,
        "metadata": metadata,
        **({} if mandate_id is None else {"mandate_id": mandate_id}),
    }
    intent = Intent("ana", ROUTE, "k-é", request_hash("ana", ROUTE, body), body, "sandbox")
    now = datetime(2026, 12, 1, 20, 0, tzinfo=UTC) + timedelta(microseconds=micros)
    rows = [{**operation_values(intent, now), "transition_source": "intake"}]
    assert json.loads(json_intake_rows(rows)) == json.loads(_json_answer_rows(rows))
    document = operation_document(rows[0])
    answer, stdlib = AcceptedIntent(document), JSONResponse(document, status_code=202)
    assert answer.body == stdlib.body
    assert (answer.status_code, answer.raw_headers) == (stdlib.status_code, stdlib.raw_headers)
    assert answer.background is None
    # The answer intake sends, written from the values (new_payment_document).
    assert new_payment_document(rows[0]) is None  # the row carries its transition's source
    values = operation_values(intent, now)
    assert new_payment_document(values) is not None
    sent = AcceptedIntent.of(IntakeResult(values, replayed=False))
    written = JSONResponse(operation_document(values), status_code=202)
    assert (sent.body, sent.status_code, sent.raw_headers) == (
        written.body,
        written.status_code,
        written.raw_headers,
    )


@pytest.mark.parametrize(
    "change",
    [
        # Each makes the values no longer a just-accepted payment's: the
        # answer is then `operation_document`'s, whatever it holds.
        {"created_at": datetime(2026, 12, 1, 22, 0, tzinfo=timezone(timedelta(hours=2)))},
        # The same instant, one object for both, in a zone of offset 0 that is
        # not `UTC` itself: told by its zone alone.
        {"created_at": LONDON_WINTER, "updated_at": LONDON_WINTER},
        {"updated_at": datetime(2026, 12, 1, 20, 0, 1, tzinfo=UTC)},
        {"state": State.OUTCOME_KNOWN, "outcome": "succeeded", "provider_reference": "ch_1"},
        {"kind": "refund", "parent_operation_id": "op_1"},
        {"first_attempt_at": datetime(2026, 12, 1, 20, 0, 2, tzinfo=UTC)},
        {"key_age_at_decision": timedelta(hours=1)},
    ],
)
def test_any_other_operation_is_answered_by_its_whole_document(change: dict[str, object]) -> None:
    values = {**_accepted_values(), **change}
    assert new_payment_document(values) is None
    sent = AcceptedIntent.of(IntakeResult(values, replayed=False))
    written = JSONResponse(operation_document(values), status_code=202)
    assert (sent.body, sent.raw_headers) == (written.body, written.raw_headers)


def test_without_one_of_intakes_fields_an_answer_takes_the_whole_document() -> None:
    values = _accepted_values()
    del values["duplicate_detected"]
    assert new_payment_document(values) is None
    assert (
        AcceptedIntent.of(IntakeResult(values, replayed=False)).body
        == JSONResponse(operation_document(values)).body
    )


def test_a_record_takes_the_whole_document_and_writes_what_its_values_do() -> None:
    """A group that failed after its commit answers its intent with the record
    read back (engine/group_intake.py: `own_write`): a record is never written
    by `new_payment_document`. Made here from the same values, it writes the
    same bytes. (Read back from PostgreSQL, its `request_context` has jsonb's
    key order: the same JSON, other bytes.)"""
    values = _accepted_values()
    record = OperationRecord(
        **{name: values.get(name) for name in OperationRecord.__match_args__} | {"live_keys": 0}
    )
    assert (
        AcceptedIntent.of(IntakeResult(record, replayed=False)).body
        == AcceptedIntent.of(IntakeResult(values, replayed=False)).body
    )


def _accepted_values() -> dict[str, object]:
    body = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}
    intent = Intent("ana", ROUTE, "k-1", request_hash("ana", ROUTE, body), body, "sandbox")
    return operation_values(intent, datetime(2026, 12, 1, 20, 0, tzinfo=UTC))


@given(
    operation_id=TEXT,
    source=TEXT,
    references=st.lists(TEXT, max_size=3),
    version=st.integers(0, 2**31 - 1),
    micros=st.integers(0, 999_999),
    state=st.sampled_from(State),
    next_action=st.sampled_from(NextAction),
)
def test_the_batch_rows_say_what_the_stdlib_said(
    operation_id: str,
    source: str,
    references: list[str],
    version: int,
    micros: int,
    state: State,
    next_action: NextAction,
) -> None:
    """The kinds of value the batch's own rows hold (engine/dispatcher.py's
    attempt, changes.plan's values and transition): text, integers, instants
    with and without microseconds, states, null, lists of references."""
    now = datetime(2026, 12, 4, 18, 0, tzinfo=UTC) + timedelta(microseconds=micros)
    rows = [
        {
            "operation_id": operation_id,
            "version": version,
            "updated_at": now,
            # Another zone: the row says the instant in UTC, as json_instant writes it.
            "first_attempt_at": datetime(2026, 12, 4, 19, 0, tzinfo=timezone(timedelta(hours=2))),
            "state": state,
            "next_action": next_action,
            "retry_after_at": None,
            "executed_references": references,
            "source": source,
        },
        {
            # The same instants again, one of them in another zone: each is
            # written once per call and reused (json_rows), and must still
            # read as the instant it is, in UTC.
            "operation_id": operation_id,
            "updated_at": now.astimezone(timezone(timedelta(hours=-3, minutes=-30))),
            "first_attempt_at": now,
            "at": now + timedelta(microseconds=1),
        },
    ]
    assert json.loads(json_rows(rows)) == json.loads(_json_answer_rows(rows))


def test_instants_equal_in_python_but_an_hour_apart_keep_their_own_text() -> None:
    """Across a change of clocks one wall-clock reading is two instants
    (`fold`), which Python calls equal in the same zone: `json_rows` writes
    each once per call, so it must not take one for the other."""
    new_york = ZoneInfo("America/New_York")
    first = datetime(2026, 11, 1, 1, 30, tzinfo=new_york)
    second = first.replace(fold=1)
    assert first == second and first.astimezone(UTC) != second.astimezone(UTC)
    rows = [{"at": first}, {"at": second}, {"at": first.astimezone(UTC)}]
    written = json.loads(json_rows(rows))
    assert written == json.loads(_json_answer_rows(rows))
    assert [row["at"] for row in written] == [
        "2026-11-01T05:30:00+00:00",
        "2026-11-01T06:30:00+00:00",
        "2026-11-01T05:30:00+00:00",
    ]


# -- observation rows: a provider's answer, written by orjson where it writes the same JSON --

ANSWER_TEXT = st.lists(
    st.sampled_from(["a", "é", "😀", "\x00", "\ud800", '"', "\\", "\u2028"]), max_size=4
).map("".join)
# Integers past 64 bits and floats of every kind (NaN and the infinities, which
# orjson would write as null), as a plug-in's answer may hold them.
ANSWER_NUMBERS = st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)


class _Body(dict):  # type: ignore[type-arg]
    """A plug-in's own mapping: orjson writes a dict's subclass as a dict."""


class _Seq(list):  # type: ignore[type-arg]
    pass


class _Float(float):
    pass


class _Amount(Enum):
    NONE = float("nan")
    SOME = 1.5


class _Text(str):
    pass


class _Count(IntEnum):
    ONE = 1


@dataclass
class _Faked:
    """Says it is text (`isinstance` believes it): a dataclass, which orjson
    would write and the standard library refuses."""

    amount: int = 1

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # type: ignore[override]
        return str


ANSWER_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | ANSWER_NUMBERS
    | ANSWER_TEXT
    | st.builds(_Float, st.floats(allow_nan=True))
    | st.sampled_from(_Amount)
    | st.sampled_from(Transport)
    | st.sampled_from(_Count)
    | ANSWER_TEXT.map(_Text)
    | st.datetimes(timezones=st.sampled_from([UTC, ZoneInfo("Europe/London")])),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.lists(inner, max_size=3).map(_Seq)
        | st.dictionaries(ANSWER_TEXT, inner, max_size=3)
        | st.dictionaries(ANSWER_TEXT, inner, max_size=3).map(_Body)
        | st.dictionaries(
            st.integers(0, 3) | st.booleans() | st.none() | ANSWER_TEXT.map(_Text),
            inner,
            max_size=2,
        )
    ),
    max_leaves=20,
)


def _json_values(text: str) -> object:
    """The JSON's values as jsonb reads them: every number exact, an integer
    told from a fraction, a boolean from a number and NaN from its text."""
    return json.loads(
        text,
        parse_float=lambda number: ("fraction", Decimal(number)),
        parse_int=lambda number: ("integer", int(number)),
        parse_constant=lambda constant: ("constant", constant),
    )


# Each kind of value orjson would write otherwise than the standard library
# writes it, write where the standard library refuses, or refuse.
@example(details=[{"fee": float("nan")}], status=None, micros=0)
@example(details=[[float("-inf")]], status=200, micros=1)
@example(details=[(float("inf"),)], status=200, micros=0)
@example(details=[None], status=float("nan"), micros=0)
@example(details=[_Body(fee=float("nan"))], status=200, micros=0)
@example(details=[_Seq([float("nan")])], status=200, micros=0)
@example(details=[_Float("nan")], status=200, micros=0)
@example(details=[_Amount.SOME], status=200, micros=0)
@example(details=[{"n": 2**70}], status=200, micros=0)
@example(details=[{"\ud800": 1}], status=200, micros=0)
@example(details=[{1: "a"}], status=200, micros=0)
@example(details=[{True: "a", None: "b"}], status=200, micros=0)
@example(details=[{_Text("k"): "a"}], status=200, micros=0)
@example(details=[_Faked()], status=200, micros=0)
@example(details=[[[[1.5]]] * 3, {"at": datetime(2026, 12, 7, tzinfo=UTC)}], status=200, micros=0)
@given(
    details=st.lists(st.none() | ANSWER_VALUES, min_size=1, max_size=3),
    status=st.none() | st.integers(100, 599) | st.floats(allow_nan=True),
    micros=st.integers(0, 999_999),
)
def test_answer_rows_say_what_the_stdlib_said(
    details: list[object], status: object, micros: int
) -> None:
    """Whatever an answer holds, the group statement's rows are the standard
    library's JSON: the same text where orjson would write other JSON (NaN,
    an infinity), the same values everywhere else; and a row the standard
    library refuses is refused alike."""
    now = datetime(2026, 12, 7, 18, 0, tzinfo=UTC) + timedelta(microseconds=micros)
    rows = [
        {
            "operation_id": f"op_{n}",
            "at": now,
            "transport": Transport.RESPONSE,
            "verdict": Verdict.SUCCEEDED,
            "http_status": status,
            "detail": detail,
        }
        for n, detail in enumerate(details)
    ]
    _say_what_the_stdlib_said(rows)


def _say_what_the_stdlib_said(rows: list[dict[str, object]]) -> None:
    try:
        stdlib = _stdlib_answer_rows(rows)
    except Exception as refused:
        with pytest.raises(Exception) as raised:
            _json_answer_rows(rows)
        assert raised.type is type(refused)
        return
    written = _json_answer_rows(rows)
    if any(token in stdlib for token in ("NaN", "Infinity")):
        assert written == stdlib
    assert _json_values(written) == _json_values(stdlib)


def test_an_answer_that_holds_itself_is_refused_as_the_stdlib_refuses_it() -> None:
    """A plug-in's answer can hold itself, which no parsed body can: the walk
    must end (the standard library raises), however many times it does."""
    looped: list[object] = []
    looped.append(looped)
    twice: list[object] = []
    twice.extend([twice, twice])
    itself: dict[str, object] = {}
    itself["again"] = itself
    for detail in (looped, twice, itself):
        _say_what_the_stdlib_said([{"operation_id": "op_1", "detail": detail}])


def test_a_deep_or_wide_answer_is_written_as_the_stdlib_writes_it() -> None:
    """Past orjson's depth, and past the walk's count of containers, the
    standard library writes what it writes."""
    deep: object = 1
    for _ in range(300):
        deep = [deep]
    wide = [[n] for n in range(_CONTAINERS_WALKED_AT_MOST + 1)]
    for detail in (deep, wide):
        rows = [{"operation_id": "op_1", "detail": detail}]
        _say_what_the_stdlib_said(rows)
        assert _json_answer_rows(rows) == _stdlib_answer_rows(rows)


def test_a_plain_answer_is_written_by_orjson() -> None:
    """The walk does not send every row to the standard library: an answer
    as the bench's stand-in gives it is written by orjson (its compact
    separators), and one with NaN by the standard library."""
    row = {
        "operation_id": "op_1",
        "at": datetime(2026, 12, 7, 18, 0, tzinfo=UTC),
        "detail": {"body": {"id": "ch_1", "status": "succeeded", "amount": 1.25}},
    }
    assert (
        _json_answer_rows([row])
        == orjson.dumps(
            [row], option=orjson.OPT_PASSTHROUGH_DATETIME, default=json_instant
        ).decode()
    )
    nan = {**row, "detail": {"body": [{"fee": float("nan")}]}}
    assert _json_answer_rows([nan]) == _stdlib_answer_rows([nan])
    assert '"fee": NaN' in _json_answer_rows([nan])
