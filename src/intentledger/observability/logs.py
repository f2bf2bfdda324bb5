"""Log lines an on-call engineer can read: `text` (the default) or `json`, one
object per line, with the operation id, attempt, worker and event where known.

Context comes from two places: `log_context` (a contextvar, so a worker's id
set once reaches every line its tasks write, and a delivery's operation id
every line of that delivery), and `extra=` on the call itself. Nothing secret is
ever passed to a log call: tokens, keys, webhook secrets, card numbers and IBANs
are not in any message or field (tests/test_no_secrets_leak.py greps for them).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal

LogFormat = Literal["text", "json"]

# Never mutated: each change sets a new mapping (an immutable empty default).
_CONTEXT: ContextVar[Mapping[str, Any]] = ContextVar(
    "intentledger_log_context", default=MappingProxyType({})
)

# The fields every line may carry, in this order after the fixed ones.
CONTEXT_FIELDS = ("operation_id", "attempt", "worker", "event")

# What a LogRecord has of its own: anything else on it came from `extra=`.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


class log_context:  # a lower-case name: it reads as the function it replaced
    """Fields added to every line logged inside the block (None values are left out).

    A class, not `contextlib.contextmanager`: every payment a worker delivers
    enters one, and a generator's context manager cost 2.5 µs of which this
    takes about 1 (docs/benchmarks.md, "Smaller pieces of a payment's glue")."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        self._token = _CONTEXT.set({**_CONTEXT.get(), **_present(self._fields)})

    def __exit__(self, *exc_info: object) -> None:
        _CONTEXT.reset(self._token)


def bind_log_context(**fields: Any) -> None:
    """Fields for the rest of this task and the tasks it starts (a worker's id)."""
    _CONTEXT.set({**_CONTEXT.get(), **_present(fields)})


def _present(fields: Mapping[str, Any]) -> Mapping[str, Any]:
    # Most contexts name no None: those are merged as they are.
    for value in fields.values():
        if value is None:
            return {name: value for name, value in fields.items() if value is not None}
    return fields


def context_of(record: logging.LogRecord) -> dict[str, Any]:
    """The record's context: the contextvar's fields, then its own `extra=` fields."""
    extra = {
        name: value
        for name, value in record.__dict__.items()
        if name not in _RECORD_ATTRIBUTES and not name.startswith("_")
    }
    merged = {**_CONTEXT.get(), **extra}
    ordered = {name: merged.pop(name) for name in CONTEXT_FIELDS if name in merged}
    return {**ordered, **dict(sorted(merged.items()))}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message,
    then the context fields, then `exception` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **context_of(record),
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        # ensure_ascii keeps a line one line whatever a message holds.
        return json.dumps(document, default=str)


class TextFormatter(logging.Formatter):
    """The readable form: `time LEVEL logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = context_of(record)
        if not context:
            return line
        fields = " ".join(f"{name}={value}" for name, value in context.items())
        head, newline, rest = line.partition("\n")  # a traceback stays below
        return f"{head} [{fields}]{newline}{rest}"


def configure_logging(log_format: LogFormat) -> None:
    """Root logging for `serve` and `worker`: INFO and up, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # A line per provider request and per migration step would drown what matters.
    for noisy in ("httpx", "httpcore", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
