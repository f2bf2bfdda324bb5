"""RFC 9457 problem details: every error the API returns has this shape (the
console renders its own refusals as pages, from the same `Problem`)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from intentledger.engine.outages import lost_connection
from intentledger.engine.refusal import Refusal

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
PROBLEM_BASE = "https://intentledger.dev/problems/"


class Problem(Exception):
    def __init__(
        self,
        status: int,
        slug: str,
        title: str,
        detail: str,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.headers = headers
        self.extensions = extensions


def problem_response(
    status: int,
    slug: str | None,
    title: str,
    detail: str,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + slug if slug else "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    body.update(extensions)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return problem_response(
            exc.status,
            exc.slug,
            exc.title,
            exc.detail,
            instance=request.url.path,
            headers=exc.headers,
            **exc.extensions,
        )

    @app.exception_handler(Refusal)
    async def _refusal(request: Request, exc: Refusal) -> JSONResponse:
        # Every business refusal, whichever route raised it, answers the same way.
        wait = exc.retry_after_seconds
        return problem_response(
            exc.status,
            exc.slug,
            TITLES.get(exc.status, "Error"),
            exc.detail,
            instance=request.url.path,
            headers={"Retry-After": str(wait)} if wait is not None else None,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; a path
            # served by several routes (GET and DELETE) allows all their methods.
            headers["Allow"] = ", ".join(allowed_methods(request))
        return problem_response(
            exc.status_code,
            None,
            TITLES.get(exc.status_code, "Error"),
            str(exc.detail),
            instance=request.url.path,
            headers=headers or None,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if any(error.get("type") == "json_invalid" for error in exc.errors()):
            return problem_response(
                400,
                "malformed-json",
                "Bad Request",
                "the body is not valid JSON",
                instance=request.url.path,
            )
        return invalid_body_response(request.url.path, exc.errors())

    async def _database_error(request: Request, exc: Exception) -> JSONResponse:
        # Handled here, by type, rather than by the catch-all below: what
        # that one answers is raised again for the server to log, and the
        # server then closes the client's connection. A database restart or
        # failover is expected; it costs a line in the log, not a traceback
        # and a dropped connection per request.
        what = _described(exc)
        if not database_unavailable(exc):
            log.error("database error on %s: %s", request.url.path, what, exc_info=exc)
            return _internal(request)
        if lost_connection(exc):
            log.warning("database unavailable on %s: %s (answered 503)", request.url.path, what)
        else:
            # Answered 503 (a deadlock, a lock or statement timeout, a full
            # disk: retrying the same key may succeed), but not a switch:
            # logged whole, so it does not pass for one.
            log.error(
                "database error on %s: %s (answered 503)", request.url.path, what, exc_info=exc
            )
        return await _problem(request, unavailable_problem(exc))

    for database_error in (DBAPIError, PoolTimeout, ConnectionError):
        app.add_exception_handler(database_error, _database_error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if database_unavailable(exc):
            return await _problem(request, unavailable_problem(exc))
        return _internal(request)


def unavailable_problem(exc: BaseException) -> Problem:
    # Whether a write in flight committed is unknown to us too: the client
    # retries with the same Idempotency-Key, which replays or makes it,
    # exactly once either way.
    return Problem(
        503,
        "database-unavailable",
        "Service Unavailable",
        f"the database is not answering ({type(exc).__name__}); retry with the same "
        "Idempotency-Key",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER)},
    )


def _sqlstate(exc: BaseException) -> str:
    original = getattr(exc, "orig", exc)
    return str(getattr(original, "sqlstate", None) or "")


def _described(exc: BaseException) -> str:
    """The exception's type, SQLSTATE and first line: enough to tell a
    failover from a deadlock in a log line, never the statement's parameters."""
    original = getattr(exc, "orig", None) or exc
    first_line = (str(original).strip().splitlines() or [""])[0][:200]
    state = _sqlstate(exc)
    return f"{type(original).__name__}" + (f" [{state}]" if state else "") + f": {first_line}"


def _internal(request: Request) -> JSONResponse:
    return problem_response(
        500,
        "internal",
        "Internal Server Error",
        "an unexpected error occurred",
        instance=request.url.path,
    )


# Seconds a client is asked to wait while the database is unreachable.
DATABASE_RETRY_AFTER = 1


def database_unavailable(exc: BaseException) -> bool:
    """The database could not be reached or dropped the connection: a restart,
    a failover, a full pool. Not a bug, and not this request's fault."""
    if _sqlstate(exc).startswith("54"):
        # A program limit (a row or index entry too big, too many columns):
        # this request's, every time; retrying cannot help.
        return False
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeout):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, ConnectionError)


def invalid_body_response(instance: str, errors: Any) -> JSONResponse:
    cleaned = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in errors
    ]
    return problem_response(
        422,
        "invalid-request",
        "Unprocessable Content",
        "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in cleaned),
        instance=instance,
        errors=cleaned,
    )


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path. FastAPI keeps an
    included router's routes inside it (`app.router.routes` holds the
    included router, whose routes carry no methods of their own there), so
    the routes are walked as FastAPI's OpenAPI walks them."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root):  # as Starlette's routes match it
        path = path[len(root) :]
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.router.routes):
        pattern = getattr(route, "path_regex", None)  # a mount's matches its prefix only
        if pattern is not None and route.methods and pattern.match(path):
            methods |= route.methods
    return sorted(methods)
