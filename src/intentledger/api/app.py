"""The HTTP API: intake, the ledger record and its timeline, health.

`create_api` builds the API's app; the composition root (intentledger/app.py)
mounts the operator console beside it."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from intentledger.api.bodies import read_json_object
from intentledger.api.edge import DEFAULT_BODY_TIMEOUT, EdgeGuard, admit, refusal
from intentledger.api.mandate_routes import router as mandate_router
from intentledger.api.metrics_route import router as metrics_router
from intentledger.api.openapi import install_openapi
from intentledger.api.operator_routes import router as operator_router
from intentledger.api.refund_routes import router as refund_router
from intentledger.api.resource_routes import router as resource_router
from intentledger.api.schemas import PaymentRequest, payment_body
from intentledger.api.webhook_endpoint_routes import router as webhook_endpoint_router
from intentledger.api.webhook_routes import router as webhook_router
from intentledger.documents import event_documents, new_payment_document, operation_document
from intentledger.domain.canonical import request_hash
from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW
from intentledger.domain.retention import (
    DEFAULT_SANDBOX_RETENTION,
    RetentionPolicy,
    policy_for_provider,
)
from intentledger.engine import queries
from intentledger.engine.api_keys import Principal
from intentledger.engine.clock import Clock
from intentledger.engine.group_intake import IntakeGroups
from intentledger.engine.intake import IntakeResult, Intent
from intentledger.engine.sync_writes import SyncWriter
from intentledger.providers.base import KINDS, Webhooks
from intentledger.web.auth import authenticate
from intentledger.web.problems import (
    Problem,
    install_problem_handlers,
    invalid_body_response,
)
from intentledger.web.validation import first_field, valid_idempotency_key

PAYMENTS_PATH = "/v1/payments"
PAYMENTS_ROUTE = "POST " + PAYMENTS_PATH

Authenticated = Annotated[Principal, Depends(authenticate)]


router = APIRouter()


@router.post(
    "/v1/payments",
    status_code=202,
    summary="Accept a payment intent (idempotent)",
    responses={
        200: {"description": "An equal retry: the original operation, replayed"},
        202: {"description": "Accepted: durable before any provider call"},
        409: {"description": "The key was used with a different request"},
    },
    openapi_extra={
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": True,
                "description": "1-255 visible ASCII characters; a retry sends the same one.",
                "schema": {"type": "string", "minLength": 1, "maxLength": 255},
            }
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": PaymentRequest.model_json_schema()}},
        },
    },
)
async def create_payment(request: Request) -> JSONResponse:
    """The intake hot path. `LedgerApp` serves it ahead of the middleware
    stack, so this documented route only feeds OpenAPI; the function reads its
    two headers itself instead of asking FastAPI's dependency solving, which
    cost about a seventh of an API process's CPU per intent (docs/benchmarks.md
    step 20)."""
    principal = await authenticate(request)
    key = valid_idempotency_key(first_field(request.scope["headers"], b"idempotency-key"))
    raw = await read_json_object(request)
    try:
        payment = PaymentRequest.model_validate(raw)
    except ValidationError as exc:
        return invalid_body_response(request.url.path, exc.errors())
    body = payment_body(payment)
    intent = Intent(
        actor=principal.actor,
        route=PAYMENTS_ROUTE,
        idempotency_key=key,
        request_hash=request_hash(principal.actor, PAYMENTS_ROUTE, body),
        body=body,
        provider=request.app.state.provider_name,
        replay_window=request.app.state.replay_window,
    )
    # Refusals (a reused key, a mandate's limits) become problem+json in one handler.
    groups: IntakeGroups = request.app.state.intake_groups
    result = await groups.accept(intent)
    if result.replayed:
        document = await _load_document(request.app.state.engine, result.operation.operation_id)  # type: ignore[union-attr]
        return JSONResponse(document, headers={"Idempotent-Replayed": "true"})
    return AcceptedIntent.of(result)


class AcceptedIntent(JSONResponse):
    """A new intent's document, 202, written by orjson: about a twelfth of the
    stdlib's CPU for the same bytes. It holds only the validated request and
    the values intake made (integers within 64 bits, strings, no floats); a
    replay's document, which can hold provider evidence, stays a JSONResponse.

    Its head is the one `Response.__init__` gives a JSON body with no headers
    of its own (tests/test_intake_json.py holds them equal), made without the
    general case of any status, media type and headers (docs/benchmarks.md,
    "CPU per intent, profiled")."""

    def __init__(self, content: Any) -> None:
        self._answer(self.render(content))

    @classmethod
    def of(cls, result: IntakeResult) -> AcceptedIntent:
        """The answer to the intent that made `result`'s operation. A payment's
        document is written from its values, its instants by orjson
        (`new_payment_document`): less than half the CPU of
        `operation_document` and then orjson."""
        operation = result.operation
        document = new_payment_document(operation) if isinstance(operation, dict) else None
        if document is None:
            return cls(operation_document(operation))
        answer = cls.__new__(cls)
        answer._answer(orjson.dumps(document, option=orjson.OPT_UTC_Z))
        return answer

    def _answer(self, body: bytes) -> None:
        self.status_code = 202
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-length", str(len(body)).encode("latin-1")),
            (b"content-type", b"application/json"),
        ]

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


async def _load_document(
    engine: AsyncEngine, operation_id: str, actor: str | None = None
) -> dict[str, Any]:
    view = await queries.operation_view(engine, operation_id)
    if view is None or (actor is not None and view.operation.actor != actor):
        raise _not_found(operation_id)
    return operation_document(view.operation, view.attempts, view.submit_results, view.refunds)


def _not_found(operation_id: str) -> Problem:
    # Another actor's operation is indistinguishable from a missing one.
    return Problem(404, "operation-not-found", "Not Found", f"no operation {operation_id!r}")


@router.get("/v1/operations/{operation_id}", summary="The ledger record of an operation")
async def get_operation(
    operation_id: str, request: Request, principal: Authenticated
) -> JSONResponse:
    document = await _load_document(request.app.state.engine, operation_id, principal.actor)
    return JSONResponse(document)


@router.get("/v1/operations/{operation_id}/events", summary="The operation's timeline")
async def get_operation_events(
    operation_id: str, request: Request, principal: Authenticated
) -> JSONResponse:
    found = await queries.operation_events(request.app.state.engine, operation_id)
    if found is None or found[0].actor != principal.actor:
        raise _not_found(operation_id)
    _operation, tagged = found
    return JSONResponse({"data": event_documents(tagged)})


@router.get("/healthz", summary="200 once the database answers")
async def healthz(request: Request) -> JSONResponse:
    try:
        await queries.check_database(request.app.state.engine)
    except Exception as exc:
        raise Problem(
            503,
            "database-unavailable",
            "Service Unavailable",
            f"the database does not answer: {type(exc).__name__}",
        ) from exc
    return JSONResponse({"status": "ok"})


class AppState(State):
    """Starlette's `State`, each value kept as an ordinary attribute of the
    instance. `State` keeps them in a dict of its own and reads each through
    `__getattr__`, a Python call on every read: about 0.45 µs, and intake
    reads four a request (docs/benchmarks.md, "The app's state read as
    attributes"). Writing, deleting, iterating and a missing name's
    AttributeError are State's own, on the instance's dict."""

    def __init__(self) -> None:
        # State's __init__ would store its dict as an attribute; the
        # instance's own dict is the store here.
        pass

    @property
    def _state(self) -> dict[str, Any]:  # type: ignore[override]
        return self.__dict__


class LedgerApp(FastAPI):
    """FastAPI, with `POST /v1/payments` served ahead of its middleware stack.

    Between uvicorn and the intake route sat nine layers (FastAPI's and
    Starlette's apps, the error, telemetry, body-limit and exception
    middleware, the exit stack, the router and the route): about a seventh of an
    API process's CPU per intent (docs/benchmarks.md step 23). This path runs
    what they did for it and nothing else: the edge's checks (`admit`, the
    same ones EdgeGuard runs for every other /v1 request), the route, and the
    app's own exception handlers, chosen by the exception's type as
    Starlette's ExceptionMiddleware chooses them. An unexpected exception is
    answered by the `Exception` handler and then raised again, as Starlette's
    ServerErrorMiddleware does, so the server logs it.
    """

    body_timeout: float = DEFAULT_BODY_TIMEOUT

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Matched exactly, never by prefix: `_take_intent` skips the path's check.
        if scope["type"] == "http" and scope["path"] == PAYMENTS_PATH and scope["method"] == "POST":
            scope["app"] = self
            await self._take_intent(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _take_intent(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # __call__ matched the path exactly: it needs no check of its ids.
            receive = await admit(scope, receive, self.body_timeout, path_checked=True)
        except Problem as problem:
            await refusal(problem, scope)(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await create_payment(request)
        except Exception as exc:
            handler_type, handler = self._handler_for(exc)
            await (await handler(request, exc))(scope, receive, send)
            if handler_type is Exception:
                raise
            return
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception) -> tuple[type, Callable[..., Any]]:
        for cls in type(exc).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                return cls, handler
        raise AssertionError("install_problem_handlers installs a handler for Exception")


def create_api(
    engine: AsyncEngine,
    clock: Clock,
    provider_name: str,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    sync_writer: SyncWriter | None = None,
    policy_for: Callable[[str], RetentionPolicy] | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    provider_kinds: frozenset[str] = frozenset(KINDS),
    webhook_readers: Mapping[str, Webhooks] | None = None,
    recheck_backoff: timedelta = timedelta(seconds=30),
    webhook_allow_private: bool = False,
    replay_window: timedelta = DEFAULT_REPLAY_WINDOW,
    intake_groups: IntakeGroups | None = None,
) -> FastAPI:
    app = LedgerApp(
        lifespan=lifespan,
        title="intentledger",
        version="0.1.0",
        description="Durable idempotent payment intents that stay honest when a "
        "provider's outcome is unknown.",
        # Metrics are Prometheus's (observability/). Left on, FastAPI asks
        # OpenTelemetry for its providers on every request, reading the
        # environment: 2 % of an API process's CPU (docs/benchmarks.md).
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state = AppState()
    app.state.engine = engine
    app.state.clock = clock
    app.state.provider_name = provider_name
    # The operation kinds the provider's adapter carries: others are refused at intake.
    app.state.provider_kinds = provider_kinds
    # Provider webhooks: each provider's verifier, and how many were refused.
    app.state.webhook_readers = dict(webhook_readers or {})
    app.state.webhook_rejections = Counter()
    app.state.recheck_backoff = recheck_backoff
    # Merchant webhook targets on loopback/private addresses (development only).
    app.state.webhook_allow_private = webhook_allow_private
    # Concurrent payment intents share a commit (engine/group_intake.py).
    app.state.intake_groups = intake_groups or IntakeGroups(engine, clock)
    # How long an equal retry replays; after it a reused key is 409 key-expired.
    app.state.replay_window = replay_window
    # Beneficiary and card writes call the provider in the request path.
    app.state.sync_writer = sync_writer
    # The key-retention policy operators weigh when they approve a new request.
    app.state.policy_for = policy_for or functools.partial(
        policy_for_provider, sandbox_retention=DEFAULT_SANDBOX_RETENTION
    )
    install_problem_handlers(app)
    # Headers, path ids, authentication and the body are checked before any route.
    app.add_middleware(EdgeGuard, body_timeout=body_timeout)
    # LedgerApp serves POST /v1/payments itself, under the same checks.
    app.body_timeout = body_timeout
    app.include_router(router)
    app.include_router(operator_router)
    app.include_router(mandate_router)
    app.include_router(resource_router)
    app.include_router(webhook_router)
    app.include_router(webhook_endpoint_router)
    app.include_router(refund_router)
    app.include_router(metrics_router)
    install_openapi(app)
    return app
