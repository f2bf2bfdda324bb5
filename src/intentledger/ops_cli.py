"""`intentledger ops`: operators list, inspect and resolve stuck operations."""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from intentledger.documents import event_documents, json_value, operation_document
from intentledger.domain.currencies import format_amount
from intentledger.domain.operator_rules import action_facts, available_actions
from intentledger.domain.states import Outcome, State
from intentledger.engine import operator, refunds
from intentledger.engine.clock import system_clock
from intentledger.engine.refusal import Refusal
from intentledger.providers.registry import retention_policy_for
from intentledger.settings import Settings
from intentledger.store.database import UnsupportedDatabase, create_ledger_engine
from intentledger.store.schema_check import SchemaNotCurrent, require_current_schema
from intentledger.store.tables import ACTOR_LENGTH

ops_app = typer.Typer(
    help="Investigate and resolve operations (operator actions).", no_args_is_help=True
)
# Messages stay one line each, whatever the terminal's width (logs, CI, grep).
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")

DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="INTENTLEDGER_DATABASE_URL")
]
By = Annotated[str | None, typer.Option("--by", help="Who is acting (default: your login name).")]


def print_table(table: Table) -> None:
    """On a terminal, at its width (the columns say what may wrap). Off a
    terminal (a pipe, a file), as wide as the table needs, whatever COLUMNS
    says: nothing is wrapped or cut for a width no one is looking at."""
    console = Console()
    if not console.is_terminal:
        widest = Measurement.get(console, console.options.update_width(10_000), table).maximum
        console = Console(width=widest)
    console.print(table)


def _settings(database_url: str | None) -> Settings:
    given: dict[str, Any] = {"database_url": database_url} if database_url else {}
    return Settings(**given)


def _run(database_url: str | None, work: Callable[[Any], Awaitable[T]]) -> T:
    settings = _settings(database_url)
    try:
        require_current_schema(settings.database_url, settings.database_pooler)
    except (SchemaNotCurrent, UnsupportedDatabase) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc

    async def main() -> T:
        engine = create_ledger_engine(settings.database_url, pooler=settings.database_pooler)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except (Refusal, ValueError) as exc:
        # Every refusal (not found, not allowed, no room for a refund's new key):
        # one line, exit 1, nothing written.
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc


def _who(by: str | None) -> str:
    """The declared name, marked as typed here: the console shows an action's
    source, and a CLI action must never read as one made by a signed-in key."""
    who = f"cli:{by}" if by else f"cli:{_os_user()}"
    if len(who) > ACTOR_LENGTH or not who.isprintable():
        err.print(f"[red]--by is 1-{ACTOR_LENGTH - len('cli:')} printable characters[/red]")
        raise typer.Exit(2)
    return who


def _action(operation_id: str, by: str | None, reason: str) -> operator.OperatorAction:
    """An action typed here: the declared name, and the OS user and host beside
    it, since this command writes with the database's credentials and anyone
    who has them may declare any name (docs/operations.md)."""
    return operator.OperatorAction(
        operation_id, _who(by), reason, os_user=_os_user(), host=socket.gethostname()
    )


# The kernel's "no login user" (a daemon, a container without an audit session).
_NO_LOGIN_UID = 2**32 - 1


def _os_user() -> str:
    """Who the machine says runs this: the effective user from the password
    database (not $USER or $LOGNAME, which the caller sets), and, where the
    kernel keeps one, the user who logged in (its audit login uid, which sudo
    and su leave unchanged: the person behind `sudo -u intentledger`)."""
    effective = os.geteuid()
    name = _user_name(effective)
    try:
        login = int(Path("/proc/self/loginuid").read_text())
    except (OSError, ValueError):  # not Linux, or no audit support
        return name
    if login in (effective, _NO_LOGIN_UID):
        return name
    return f"{name} (logged in as {_user_name(login)})"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # no entry for this uid (a container's arbitrary user)
        return f"uid {uid}"


def _age(since: datetime, now: datetime) -> str:
    seconds = max(0, int((now - since).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _due(due_at: datetime | None, now: datetime) -> str:
    """When a check is due, relative like the age: short enough for 80 columns."""
    if due_at is None:
        return ""
    if due_at <= now:
        return f"{_age(due_at, now)} ago"
    return f"in {_age(now, due_at)}"


@ops_app.command("list")
def list_(
    state: Annotated[State | None, typer.Option("--state", help="Only this state.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 100,
    database_url: DatabaseUrl = None,
) -> None:
    """A table of operations with their age, state and next action."""
    rows = _run(database_url, lambda engine: operator.list_operations(engine, state, limit))
    table = Table(
        title=f"operations{f' in {state}' if state else ''}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    # Two lines a row, so that 80 columns hold it. On a terminal the id column
    # is exactly as wide as the ids, which people copy and grep for and so are
    # never cut; the other columns give way (an amount wraps at its spaces, an
    # actor folds). Off a terminal nothing gives way (print_table).
    amounts = [format_amount(row.amount, row.currency) for row in rows]
    ids_width = max((len(row.operation_id) for row in rows), default=None)
    table.add_column(
        "id\nactor", overflow="fold", width=ids_width if Console().is_terminal else None
    )
    table.add_column("amount", overflow="fold")
    table.add_column("state\nnext action", overflow="fold")
    table.add_column("age", overflow="fold")
    table.add_column("check due\nlast check", overflow="fold")
    now = datetime.now(UTC)
    for row, amount in zip(rows, amounts, strict=True):
        table.add_row(
            f"{row.operation_id}\n{row.actor}",
            amount,
            f"{row.state}\n{row.next_action}",
            _age(row.created_at, now),
            f"{_due(row.retry_after_at, now)}\n{row.reconciliation_status or ''}",
        )
    print_table(table)


@ops_app.command()
def show(operation_id: str, database_url: DatabaseUrl = None) -> None:
    """The record and its whole timeline."""
    shown = _run(database_url, lambda engine: operator.show(engine, operation_id))
    op = shown["operation"]
    record = Table(show_header=False, title=operation_id)
    record.add_column("field", no_wrap=True)
    record.add_column("value", overflow="fold")
    for name in (
        "state",
        "outcome",
        "next_action",
        "actor",
        "amount",
        "first_attempt_at",
        "last_observed_at",
        "retry_after_at",
        "reconciliation_status",
        "key_age_at_decision",
        "provider_retention_note",
        "provider_reference",
        "created_at",
    ):
        value = (
            format_amount(op.amount, op.currency)
            if name == "amount"
            else json_value(getattr(op, name))
        )
        record.add_row(name, "" if value is None else str(value))
    # What `intentledger ops` may do to it now: the rules the engine refuses by.
    facts = action_facts(operation_document(op), attempted=bool(shown["attempts"]))
    record.add_row("actions", ", ".join(available_actions(facts)) or "none")
    print_table(record)
    timeline = Table(title="timeline")
    for column in ("at", "type", "what", "why"):
        timeline.add_column(column, overflow="fold")
    for event in event_documents(shown["events"]):
        timeline.add_row(event["at"], event["type"], _what(event), event.get("reason") or "")
    print_table(timeline)


def _what(event: dict[str, Any]) -> str:
    if event["type"] == "transition":
        return f"{event['from_state'] or '-'} -> {event['to_state']} (next: {event['next_action']})"
    if event["type"] == "decision":
        age = event.get("key_age_at_decision")
        inputs = event.get("inputs") or {}
        typed_at = (
            f", typed by OS user {inputs['os_user']} on {inputs['host']}"
            if "os_user" in inputs and "host" in inputs
            else ""
        )
        return (
            f"rule {event['rule']} -> {event['next_action']}"
            + (f", key age {age:.0f}s" if age is not None else "")
            + typed_at
        )
    parts = [event["kind"], event.get("verdict") or ""]
    if event.get("http_status"):
        parts.append(str(event["http_status"]))
    if event.get("error_class"):
        parts.append(event["error_class"])
    if event.get("retry_after_raw"):
        parts.append(f"Retry-After {event['retry_after_raw']!r} -> {event.get('retry_after_at')}")
    return " ".join(p for p in parts if p)


def _act(database_url: str | None, action: operator.Action) -> None:
    done, _ = _run(database_url, lambda engine: operator.perform(engine, system_clock, action))
    out.print(done)


@ops_app.command()
def resolve(
    operation_id: str,
    outcome: Annotated[Outcome, typer.Option("--outcome", help="What the evidence shows.")],
    evidence: Annotated[str, typer.Option("--evidence", help="What you found, and where.")],
    by: By = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Settle an unresolved operation on evidence you found."""
    action = _action(operation_id, by, evidence)
    _act(database_url, lambda ledger, now: operator.resolve(ledger, now, action, outcome))


@ops_app.command("approve-resubmission")
def approve_resubmission(
    operation_id: str,
    reason: Annotated[str, typer.Option("--reason", help="Why a new request is safe.")],
    by: By = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Approve a deliberate new request (a new provider key) for an operation in MANUAL_REVIEW."""
    action = _action(operation_id, by, reason)
    settings = _settings(database_url)
    # The composition root's, imported here: the rest of `ops` needs no service.
    from intentledger.service import provider_config

    policy_for = retention_policy_for(provider_config(settings))
    _act(
        database_url,
        lambda ledger, now: operator.approve_resubmission(ledger, now, action, policy_for),
    )


@ops_app.command()
def escalate(
    operation_id: str,
    reason: Annotated[str, typer.Option("--reason", help="Why.")] = "escalated from the CLI",
    by: By = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Hand an unresolved operation to a person now (MANUAL_REVIEW)."""
    action = _action(operation_id, by, reason)
    _act(database_url, lambda ledger, now: operator.escalate(ledger, now, action))


@ops_app.command("refund-duplicate")
def refund_duplicate(
    operation_id: str,
    charge: Annotated[
        str, typer.Option("--charge", help="The executed charge to refund (not the settled one).")
    ],
    reason: Annotated[str, typer.Option("--reason", help="Why.")],
    by: By = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Refund a duplicate charge of a payment flagged duplicate_detected."""
    action = _action(operation_id, by, reason)
    _act(database_url, lambda ledger, now: refunds.refund_duplicate(ledger, now, action, charge))
