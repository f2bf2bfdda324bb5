"""Operator rules: which action a person may take on an operation in which state. Pure.

One table for both sides: the engine (engine/operator.py) refuses what it does
not allow, and the console and the ops CLI offer only what it allows.

    resolve               an unresolved operation, or a contradiction at any state
    approve-resubmission  MANUAL_REVIEW waiting for a person (none approved yet),
                          with an attempt to resubmit
    escalate              UNKNOWN, RECONCILIATION_DUE, SAFETY_REVIEW
    refund-duplicate      a payment flagged duplicate_detected with an executed
                          charge beyond the one its books settled on
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from intentledger.domain.states import UNRESOLVED, NextAction, State

Verb = Literal["resolve", "approve-resubmission", "escalate", "refund-duplicate"]

RESOLVABLE = UNRESOLVED
APPROVABLE = frozenset({State.MANUAL_REVIEW})
ESCALATABLE = frozenset({State.UNKNOWN, State.RECONCILIATION_DUE, State.SAFETY_REVIEW})


def may_resolve(state: State, contradicted: bool) -> bool:
    return contradicted or state in RESOLVABLE


def approval_awaited(state: State, next_action: str) -> bool:
    """Is a person's approval of a new request what the operation waits for? Not
    once one is approved (next action resubmit): a second approval would be a
    third request nobody weighed."""
    return state in APPROVABLE and next_action == NextAction.OPERATOR


def may_escalate(state: State) -> bool:
    return state in ESCALATABLE


def duplicate_charges(executed: Iterable[str], settled_charge: str | None) -> list[str]:
    """The executed charges beyond the one the books settled on."""
    return [reference for reference in executed if reference != settled_charge]


@dataclass(frozen=True)
class ActionFacts:
    """What the rules read of an operation."""

    state: State
    next_action: str
    outcome_contradicted: bool
    attempted: bool
    duplicate_detected: bool
    executed: tuple[str, ...]
    settled_charge: str | None


def action_facts(document: Mapping[str, Any], attempted: bool) -> ActionFacts:
    """What the rules read of an operation's document (documents.operation_document)."""
    return ActionFacts(
        state=State(document["state"]),
        next_action=document["next_action"],
        outcome_contradicted=bool(document["outcome_contradicted"]),
        attempted=attempted,
        duplicate_detected=bool(document["duplicate_detected"]),
        executed=tuple(document["executed_references"]),
        settled_charge=document["provider_reference"],
    )


def available_actions(facts: ActionFacts) -> list[Verb]:
    """The actions a person may take now, in the order they are offered."""
    actions: list[Verb] = []
    if may_resolve(facts.state, facts.outcome_contradicted):
        actions.append("resolve")
    if approval_awaited(facts.state, facts.next_action) and facts.attempted:
        actions.append("approve-resubmission")
    if may_escalate(facts.state):
        actions.append("escalate")
    if facts.duplicate_detected and duplicate_charges(facts.executed, facts.settled_charge):
        actions.append("refund-duplicate")
    return actions


__all__ = [
    "APPROVABLE",
    "ESCALATABLE",
    "RESOLVABLE",
    "ActionFacts",
    "Verb",
    "action_facts",
    "approval_awaited",
    "available_actions",
    "duplicate_charges",
    "may_escalate",
    "may_resolve",
]
