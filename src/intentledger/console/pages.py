"""The operator console: server-rendered pages over the ledger, and the
operator actions behind a confirmation step.

Reads go through the engine's queries; every action runs the code the operator
API runs (web/operator_actions.py) under an Idempotency-Key the confirmation
page made, so a form sent twice (a double click, a reload) does one thing, and
the record says who did it and why, exactly as when the API is used.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, StrictUndefined
from pydantic import BaseModel, ValidationError

from intentledger.console.session import (
    CSRF_FIELD,
    SESSION_LENGTH,
    begin,
    csrf_matches,
    csrf_token,
    end,
    key_of,
    same_origin,
    signed_in,
)
from intentledger.documents import (
    card_document,
    event_documents,
    json_value,
    mandate_document,
    operation_document,
)
from intentledger.domain import operator_rules
from intentledger.domain.currencies import format_amount
from intentledger.domain.durations import parse_duration
from intentledger.domain.mandates import MandateStatus
from intentledger.domain.operator_rules import action_facts
from intentledger.domain.safety import attempt_key
from intentledger.domain.states import NextAction, State
from intentledger.domain.work_queue import OPERATION_ID, Cursor, Need, QueueFacts, needs
from intentledger.engine import operator, queries
from intentledger.engine.api_keys import Principal
from intentledger.engine.queries import ACTOR_LENGTH, MerchantEventRecord, QueueFilter
from intentledger.engine.refusal import Refusal
from intentledger.web.operator_actions import ACTION_BODIES, perform_operator_action
from intentledger.web.problems import Problem, problem_response
from intentledger.web.validation import valid_idempotency_key

PREFIX = "/console"
PAGE_SIZE = 50
# Nothing in a ledger is older; a longer one would overflow the date arithmetic.
LONGEST_AGE_FILTER = timedelta(days=36_500)
# A form is a handful of short fields; anything bigger is not from our pages.
MAX_FORM_BYTES = 16 * 1024
# The ids this service issues (api/edge.py's rule for /v1 paths).
ISSUED_ID = OPERATION_ID
# A one-shot note from an action to the page it redirects to (never in the URL,
# where a link could make the page claim something that did not happen).
FLASH_COOKIE = "intentledger_console_flash"
FLASH_NOTES = {
    "done": "Done.",
    "replayed": "Already done: this confirmation was sent before, nothing was done again.",
}
# Security headers for every console page: no framing (an action console must
# not be clickjacked), no script or style from anywhere but here, nothing cached.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Not "no-referrer": with it browsers send `Origin: null` on the console's
    # own form posts, and same_origin() could not tell them from a foreign site's.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix=PREFIX, include_in_schema=False)


class ConsoleRefusal(Exception):
    """A page's refusal: HTML for a browser, problem+json for anything else."""

    def __init__(self, status: int, slug: str, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail


class SignInNeeded(Exception):
    pass


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("intentledger.console", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
    )
    env.filters["duration"] = human_duration
    env.filters["money"] = format_amount  # a dash where there is none
    env.filters["pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True)
    env.globals["session_length"] = human_duration(SESSION_LENGTH.total_seconds())
    return env


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{whole} s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if whole >= size:
            parts.append(f"{whole // size} {unit}")
            whole %= size
    return " ".join(parts[:2])


templates = Jinja2Templates(env=_environment())


# -- sessions and refusals ------------------------------------------------------


def install_console(app: FastAPI, waiting_threshold: timedelta) -> None:
    """Mount the console on the service's app."""
    app.state.console_waiting_threshold = waiting_threshold
    app.include_router(router)
    app.mount(
        f"{PREFIX}/static",
        StaticFiles(packages=[("intentledger.console", "static")]),
        name="console-static",
    )

    @app.exception_handler(ConsoleRefusal)
    async def _refused(request: Request, exc: ConsoleRefusal) -> Response:
        return refusal_response(request, exc)

    @app.exception_handler(SignInNeeded)
    async def _sign_in(request: Request, _exc: SignInNeeded) -> Response:
        if request.method == "GET":
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return _redirect(f"{PREFIX}/sign-in?{urlencode({'next': target})}")
        return refusal_response(
            request,
            ConsoleRefusal(401, "unauthorized", "Unauthorized", "sign in to the console first"),
        )


def refusal_response(request: Request, exc: ConsoleRefusal) -> Response:
    if "text/html" in request.headers.get("accept", ""):
        return _page(
            request,
            "error.html",
            {"status": exc.status, "title": exc.title, "detail": exc.detail, "operator": None},
            status=exc.status,
        )
    response = problem_response(exc.status, exc.slug, exc.title, exc.detail, request.url.path)
    response.headers.update(PAGE_HEADERS)
    return response


def _page(
    request: Request, template: str, context: Mapping[str, Any], status: int = 200
) -> HTMLResponse:
    response = templates.TemplateResponse(
        request, template, {"prefix": PREFIX, **context}, status_code=status
    )
    response.headers.update(PAGE_HEADERS)
    return response


def _redirect(location: str) -> RedirectResponse:
    response = RedirectResponse(location, status_code=303)
    response.headers.update(PAGE_HEADERS)
    return response


async def _operator(request: Request) -> tuple[str, Principal]:
    session = await signed_in(request)
    if session is None:
        raise SignInNeeded()
    token, principal = session
    if not principal.is_operator:
        raise ConsoleRefusal(
            403,
            "operator-role-required",
            "Forbidden",
            "the console needs a key with the operator role",
        )
    return token, principal


def _context(session_id: str, principal: Principal, **values: Any) -> dict[str, Any]:
    return {"operator": principal.actor, "csrf": csrf_token(session_id), **values}


async def _read_form(request: Request) -> dict[str, str]:
    """A urlencoded form, small, each field once; anything else is refused."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise ConsoleRefusal(
            415,
            "unsupported-media-type",
            "Unsupported Media Type",
            "console forms are sent as application/x-www-form-urlencoded",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ConsoleRefusal(
                413,
                "body-too-large",
                "Content Too Large",
                f"a form is at most {MAX_FORM_BYTES} bytes",
            )
    try:
        pairs = parse_qsl(
            body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, max_num_fields=20
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad_form("the form is not readable") from exc
    form: dict[str, str] = {}
    for name, value in pairs:
        if name in form:
            raise _bad_form(f"{name!r} was sent twice")
        if "\x00" in value:
            raise _bad_form(f"{name!r} holds a NUL")
        form[name] = value
    return form


async def _checked_post(request: Request) -> tuple[str, Principal, dict[str, str]]:
    """A state-changing post: signed in as an operator, from this origin, with
    the CSRF token of the page that was shown to that operator."""
    token, principal = await _operator(request)
    if not same_origin(request):
        raise _cross_origin()
    form = await _read_form(request)
    if not csrf_matches(token, form.pop(CSRF_FIELD, None)):
        raise _csrf_refused()
    return token, principal, form


def _csrf_refused() -> ConsoleRefusal:
    detail = "the form's CSRF token is missing or not this session's: reload the page"
    return ConsoleRefusal(403, "csrf-token-invalid", "Forbidden", detail)


def _bad_filter(detail: str) -> ConsoleRefusal:
    return ConsoleRefusal(400, "invalid-filter", "Bad Request", detail)


def _bad_form(detail: str) -> ConsoleRefusal:
    return ConsoleRefusal(400, "invalid-form", "Bad Request", detail)


def _cross_origin() -> ConsoleRefusal:
    return ConsoleRefusal(403, "cross-origin-post", "Forbidden", "this form came from another site")


def _id(value: str, what: str) -> str:
    if not ISSUED_ID.fullmatch(value):
        raise ConsoleRefusal(404, "not-found", "Not Found", f"no {what} {value!r}")
    return value


def _filter_text(value: str | None, what: str, longest: int) -> str | None:
    if value is None or not value.strip():
        return None
    value = value.strip()
    if len(value) > longest or not value.isprintable():
        raise _bad_filter(f"{what} is 1-{longest} printable characters")
    return value


# -- sign-in ----------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    # Only a console path: never an open redirect to another site.
    if target and target.startswith(f"{PREFIX}/") and not target.startswith("//"):
        return target
    return f"{PREFIX}/queue"


@router.get("")
@router.get("/")
async def home() -> RedirectResponse:
    return _redirect(f"{PREFIX}/queue")


@router.get("/sign-in")
async def sign_in_page(request: Request, next: str | None = None) -> HTMLResponse:
    return _page(
        request, "sign_in.html", {"operator": None, "next": _safe_next(next), "error": None}
    )


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    if not same_origin(request):
        raise _cross_origin()
    form = await _read_form(request)
    token = form.get("token", "").strip()
    target = _safe_next(form.get("next"))
    key = await key_of(request, token) if token else None
    if key is None or not key.is_operator:
        refused = (
            (401, "unknown or revoked token")
            if key is None
            else (403, "this key does not have the operator role")
        )
        context = {"operator": None, "next": target, "error": refused[1]}
        return _page(request, "sign_in.html", context, status=refused[0])
    response = _redirect(target)
    await begin(request, response, key)
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    """Ends the session (when it is still open, only from its own pages) and
    always forgets the cookie."""
    session = await signed_in(request)
    if session is not None:
        session_id, _principal = session
        form = await _read_form(request)
        if not same_origin(request) or not csrf_matches(session_id, form.get(CSRF_FIELD)):
            raise _csrf_refused()
    response = _redirect(f"{PREFIX}/sign-in")
    await end(request, response)
    return response


# -- the work queue -----------------------------------------------------------------


def _queue_filter(
    state: str | None, provider: str | None, actor: str | None, older_than: str | None
) -> QueueFilter:
    chosen_state = None
    if state:
        try:
            chosen_state = State(state)
        except ValueError as exc:
            raise _bad_filter(f"no state {state!r}") from exc
    age = None
    if older_than and older_than.strip():
        try:
            age = parse_duration(older_than)
        except ValueError as exc:
            raise _bad_filter(str(exc)) from exc
        if age > LONGEST_AGE_FILTER:
            raise _bad_filter(f"older_than is at most {LONGEST_AGE_FILTER.days} days")
    return QueueFilter(
        state=chosen_state,
        provider=_filter_text(provider, "provider", 32),
        actor=_filter_text(actor, "actor", ACTOR_LENGTH),
        older_than=age,
    )


@router.get("/queue")
async def queue_page(
    request: Request,
    state: str | None = None,
    provider: str | None = None,
    actor: str | None = None,
    older_than: str | None = None,
    after: str | None = None,
) -> HTMLResponse:
    token, principal = await _operator(request)
    chosen = _queue_filter(state, provider, actor, older_than)
    cursor = None
    if after:
        try:
            cursor = Cursor.decode(after)
        except ValueError as exc:
            raise _bad_filter("not a queue position") from exc
    now = request.app.state.clock()
    threshold: timedelta = request.app.state.console_waiting_threshold
    page, providers = await queries.queue(
        request.app.state.engine, now, threshold, chosen, cursor, PAGE_SIZE
    )
    rows = [
        {
            "row": row,
            "age_seconds": (now - row.created_at).total_seconds(),
            "needs": needs(
                QueueFacts(
                    State(row.state),
                    NextAction(row.next_action),
                    bool(row.duplicate_detected),
                    bool(row.outcome_contradicted),
                    row.created_at,
                    row.watch,
                ),
                now,
                threshold,
            ),
        }
        for row in page.rows
    ]
    kept = {
        "state": state or "",
        "provider": provider or "",
        "actor": actor or "",
        "older_than": older_than or "",
    }
    next_link = None
    if page.next_cursor is not None:
        next_link = "?" + urlencode(
            {**{k: v for k, v in kept.items() if v}, "after": page.next_cursor.encode()}
        )
    return _page(
        request,
        "queue.html",
        _context(
            token,
            principal,
            rows=rows,
            counts=page.counts,
            total=page.total,
            needs=Need,
            states=list(State),
            providers=providers,
            chosen=kept,
            next_link=next_link,
            threshold_seconds=threshold.total_seconds(),
            paged=cursor is not None,
        ),
    )


# -- an operation's whole story -------------------------------------------------------


def available_actions(document: Mapping[str, Any], attempted: bool) -> list[str]:
    """What a person may do now (domain/operator_rules.py; the engine checks again)."""
    return list(operator_rules.available_actions(action_facts(document, attempted)))


def duplicate_charges(document: Mapping[str, Any]) -> list[str]:
    return operator_rules.duplicate_charges(
        document["executed_references"], document["provider_reference"]
    )


async def _operation_story(request: Request, operation_id: str) -> dict[str, Any]:
    try:
        shown = await operator.show(request.app.state.engine, operation_id)
    except operator.OperationNotFound as exc:
        raise ConsoleRefusal(404, "operation-not-found", "Not Found", exc.detail) from exc
    record = shown["operation"]
    document = operation_document(
        record, shown["attempts"], shown["submit_results"], shown["refunds"]
    )
    around = await queries.surroundings(request.app.state.engine, record)
    mandate, card = around.mandate, around.card
    timeline = event_documents(shown["events"])
    return {
        "record": record,
        "document": document,
        "timeline": timeline,
        "lookups": [e for e in timeline if e["type"] == "observation" and "lookup" in e["kind"]],
        "refunds": [operation_document(refund) for refund in shown["refunds"]],
        "merchant_events": _announced(around.merchant_events),
        "mandate": mandate_document(mandate) if mandate is not None else None,
        "card": card_document(card) if card is not None else None,
        "actions": available_actions(document, bool(shown["attempts"])),
    }


def _announced(events: Sequence[MerchantEventRecord]) -> list[dict[str, Any]]:
    return [
        {"type": event.type, "at": json_value(event.created_at), "id": event.event_id}
        for event in events
    ]


@router.get("/operations/{operation_id}")
async def operation_page(request: Request, operation_id: str) -> HTMLResponse:
    token, principal = await _operator(request)
    story = await _operation_story(request, _id(operation_id, "operation"))
    verb, _, result = request.cookies.get(FLASH_COOKIE, "").partition(":")
    flash = None
    if result in FLASH_NOTES and verb in ACTION_BODIES:
        flash = f"{verb.replace('-', ' ').capitalize()}: {FLASH_NOTES[result]}"
    response = _page(request, "operation.html", _context(token, principal, flash=flash, **story))
    if flash is not None:
        response.delete_cookie(FLASH_COOKIE, path=PREFIX)
    return response


# -- actions: a form, a confirmation, then the action ------------------------------------


def _verb(verb: str) -> str:
    if verb not in ACTION_BODIES:
        raise ConsoleRefusal(404, "not-found", "Not Found", f"no action {verb!r}")
    return verb


async def _key_review(
    request: Request, verb: str, story: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What approving a new-key request weighs: the last key's age against the
    provider's documented retention."""
    attempts = story["document"]["attempts"]
    if verb != "approve-resubmission" or not attempts:
        return None
    last = attempts[-1]
    record = story["record"]
    first_use = await queries.first_use_of_key(
        request.app.state.engine, record.operation_id, last["provider_idempotency_key"]
    )
    try:
        policy = request.app.state.policy_for(record.provider)
    except KeyError as exc:
        detail = f"no retention policy is known for provider {record.provider!r}"
        raise ConsoleRefusal(409, "provider-unknown", "Not possible here", detail) from exc
    age = request.app.state.clock() - first_use
    return {
        "key": last["provider_idempotency_key"],
        "first_used_at": json_value(first_use),
        "age_seconds": age.total_seconds(),
        "minimum_seconds": policy.minimum.total_seconds(),
        "retention_passed": age >= policy.minimum,
        "note": policy.note,
        "next_key": attempt_key(record.operation_id, last["number"] + 1),
    }


@router.get("/operations/{operation_id}/{verb}")
async def action_form(request: Request, operation_id: str, verb: str) -> HTMLResponse:
    token, principal = await _operator(request)
    story = await _operation_story(request, _id(operation_id, "operation"))
    verb = _verb(verb)
    return _page(
        request,
        "action.html",
        _context(
            token,
            principal,
            verb=verb,
            key_review=await _key_review(request, verb, story),
            charges=duplicate_charges(story["document"]),
            values={},
            error=None,
            **story,
        ),
    )


def _checked_body(verb: str, form: Mapping[str, str]) -> BaseModel:
    fields = {name: value for name, value in form.items() if name in _field_names(verb)}
    try:
        return ACTION_BODIES[verb].model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'form'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConsoleRefusal(422, "invalid-request", "Unprocessable Content", problems) from exc


def _field_names(verb: str) -> frozenset[str]:
    return frozenset(ACTION_BODIES[verb].model_fields)


@router.post("/operations/{operation_id}/{verb}/review")
async def action_review(request: Request, operation_id: str, verb: str) -> HTMLResponse:
    """The confirmation step: what will be done, and a key for doing it once."""
    token, principal, form = await _checked_post(request)
    story = await _operation_story(request, _id(operation_id, "operation"))
    verb = _verb(verb)
    body = _checked_body(verb, form)
    return _page(
        request,
        "confirm.html",
        _context(
            token,
            principal,
            verb=verb,
            values=body.model_dump(),
            idempotency_key=f"console-{secrets.token_urlsafe(18)}",
            version=story["record"].version,
            key_review=await _key_review(request, verb, story),
            **story,
        ),
    )


@router.post("/operations/{operation_id}/{verb}")
async def action_perform(request: Request, operation_id: str, verb: str) -> Response:
    """The confirmed action: done once under the page's key, and only while the
    operation is as the confirmation page showed it (its version): a stale page
    — another operator acted, the worker moved it on — is refused, not obeyed."""
    _session, principal, form = await _checked_post(request)
    operation_id = _id(operation_id, "operation")
    verb = _verb(verb)
    try:
        key = valid_idempotency_key(form.get("idempotency_key"))
    except Problem as exc:
        raise ConsoleRefusal(exc.status, exc.slug, exc.title, exc.detail) from exc
    reviewed = form.get("version", "")
    if not key.startswith("console-") or not reviewed.isdecimal() or len(reviewed) > 9:
        detail = "confirm the action from its review page"
        raise ConsoleRefusal(400, "confirmation-invalid", "Bad Request", detail)
    body = _checked_body(verb, form)
    try:
        _done, replayed = await perform_operator_action(
            request, principal, operation_id, verb, body, key, expected_version=int(reviewed)
        )
    except Refusal as exc:
        raise ConsoleRefusal(exc.status, exc.slug, "Not done", exc.detail) from exc
    except Problem as exc:
        raise ConsoleRefusal(exc.status, exc.slug, exc.title, exc.detail) from exc
    response = _redirect(f"{PREFIX}/operations/{operation_id}")
    note = f"{verb}:{'replayed' if replayed else 'done'}"
    response.set_cookie(
        FLASH_COOKIE, note, max_age=60, path=PREFIX, httponly=True, samesite="strict"
    )
    return response


# -- mandates and cards -----------------------------------------------------------------


@router.get("/mandates")
async def mandates_page(
    request: Request, status: str | None = None, actor: str | None = None, after: str | None = None
) -> HTMLResponse:
    token, principal = await _operator(request)
    if status and status not in tuple(MandateStatus):
        raise _bad_filter(f"no mandate status {status!r}")
    chosen_actor = _filter_text(actor, "actor", ACTOR_LENGTH)
    start = _id(after, "mandate") if after else None
    rows = await queries.mandates(
        request.app.state.engine, status or None, chosen_actor, start, PAGE_SIZE + 1
    )
    return _page(
        request,
        "mandates.html",
        _context(
            token,
            principal,
            mandates=[{**mandate_document(row), "actor": row.actor} for row in rows[:PAGE_SIZE]],
            chosen={"status": status or "", "actor": actor or ""},
            next_after=rows[PAGE_SIZE - 1].mandate_id if len(rows) > PAGE_SIZE else None,
        ),
    )


@router.get("/mandates/{mandate_id}")
async def mandate_page(request: Request, mandate_id: str) -> HTMLResponse:
    token, principal = await _operator(request)
    mandate_id = _id(mandate_id, "mandate")
    view = await queries.mandate_view(request.app.state.engine, mandate_id, PAGE_SIZE)
    if view is None:
        raise ConsoleRefusal(404, "mandate-not-found", "Not Found", f"no mandate {mandate_id!r}")
    return _page(
        request,
        "mandate.html",
        _context(
            token,
            principal,
            mandate={**mandate_document(view.mandate), "actor": view.mandate.actor},
            open_operations=view.open_operations,
            merchant_events=_announced(view.merchant_events),
        ),
    )


@router.get("/cards")
async def cards_page(
    request: Request,
    indeterminate: str | None = None,
    actor: str | None = None,
    after: str | None = None,
) -> HTMLResponse:
    token, principal = await _operator(request)
    if indeterminate not in (None, "", "yes", "no"):
        raise _bad_filter("indeterminate is yes or no")
    flag = None if not indeterminate else indeterminate == "yes"
    chosen_actor = _filter_text(actor, "actor", ACTOR_LENGTH)
    start = _id(after, "card") if after else None
    rows = await queries.cards(request.app.state.engine, flag, chosen_actor, start, PAGE_SIZE + 1)
    return _page(
        request,
        "cards.html",
        _context(
            token,
            principal,
            cards=[{**card_document(row), "actor": row.actor} for row in rows[:PAGE_SIZE]],
            chosen={"indeterminate": indeterminate or "", "actor": actor or ""},
            next_after=rows[PAGE_SIZE - 1].card_id if len(rows) > PAGE_SIZE else None,
        ),
    )


@router.get("/cards/{card_id}")
async def card_page(request: Request, card_id: str) -> HTMLResponse:
    token, principal = await _operator(request)
    card_id = _id(card_id, "card")
    view = await queries.card_view(request.app.state.engine, card_id)
    if view is None:
        raise ConsoleRefusal(404, "card-not-found", "Not Found", f"no card {card_id!r}")
    return _page(
        request,
        "card.html",
        _context(
            token,
            principal,
            card={**card_document(view.card), "actor": view.card.actor},
            merchant_events=_announced(view.merchant_events),
        ),
    )
