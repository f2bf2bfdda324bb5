"""Bearer authentication: the principal a request's token names, cached per app."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from starlette.types import Scope

from intentledger.engine.api_keys import Principal, hash_token, principal_of_hash
from intentledger.web.problems import Problem, database_unavailable, unavailable_problem
from intentledger.web.validation import first_field

# A known key is looked up in the database at most once per this many seconds
# per API process. There is no key revocation today, but a key removed from
# `api_keys` (by hand, or by a revocation added later) must stop working
# without a restart: the TTL bounds how long a stale entry can authenticate.
AUTH_CACHE_TTL_SECONDS = 60.0
# Only keys found in the database are cached, so this bounds memory against
# many real keys in use at once, not against made-up tokens.
AUTH_CACHE_MAX_ENTRIES = 4096


class PrincipalCache:
    """Token hash -> Principal of keys the database knew, each for `ttl` seconds.

    Unknown tokens are never cached: every one of them goes to the database,
    so nobody can fill the cache by sending tokens that do not exist.
    """

    def __init__(
        self,
        ttl: float = AUTH_CACHE_TTL_SECONDS,
        max_entries: int = AUTH_CACHE_MAX_ENTRIES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._monotonic = monotonic
        # Insertion order is expiry order (every entry lives `ttl`): oldest first.
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, token_hash: str) -> Principal | None:
        entry = self._entries.get(token_hash)
        if entry is None:
            return None
        expires_at, principal = entry
        if self._monotonic() >= expires_at:
            del self._entries[token_hash]
            return None
        return principal

    def put(self, token_hash: str, principal: Principal) -> None:
        self._entries.pop(token_hash, None)
        self._entries[token_hash] = (self._monotonic() + self.ttl, principal)
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]


def _principal_cache(app: Any) -> PrincipalCache:
    """The app's own cache (per app, so separate apps never share entries)."""
    state = app.state
    cache: PrincipalCache | None = getattr(state, "principal_cache", None)
    if cache is None:
        cache = state.principal_cache = PrincipalCache()
    return cache


def _unauthorized(detail: str) -> Problem:
    return Problem(
        401,
        "unauthorized",
        "Unauthorized",
        detail,
        headers={"WWW-Authenticate": 'Bearer realm="intentledger"'},
    )


PRINCIPAL_STATE = "principal"


async def authenticate(request: Request) -> Principal:
    """The request's principal. The API's edge (api/edge.py) authenticates every /v1
    request before its body is read and keeps the answer in the request's
    state; a route asking again gets that answer."""
    return await authenticate_scope(request.scope)


async def authenticate_scope(scope: Scope) -> Principal:
    """`authenticate` for a request not yet wrapped in a `Request`: the edge's
    and intake's way, which read the head as uvicorn hands it over."""
    state = scope.setdefault("state", {})
    known: Principal | None = state.get(PRINCIPAL_STATE)
    if known is not None:
        return known
    principal = await _look_up(scope["app"], first_field(scope["headers"], b"authorization"))
    state[PRINCIPAL_STATE] = principal
    return principal


async def _look_up(app: Any, header: str | None) -> Principal:
    if header is None:
        raise _unauthorized("missing Authorization: Bearer <token> header")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("the Authorization header must be 'Bearer <token>'")
    principal = await _principal_of_token(app, token.strip())
    if principal is None:
        raise _unauthorized("unknown or revoked token")
    return principal


async def _principal_of_token(app: Any, token: str) -> Principal | None:
    """The key's principal, or None for a token no key has (or a revoked one)."""
    token_hash = hash_token(token)
    cache = _principal_cache(app)
    principal = cache.get(token_hash)
    if principal is not None:
        return principal
    try:
        principal = await principal_of_hash(app.state.engine, token_hash)
    except Exception as exc:
        # Raised before any route runs (the edge, and intake's own path,
        # authenticate first): answered here as the routes' handlers would,
        # 503 with Retry-After, not left to the server's plain 500.
        if database_unavailable(exc):
            raise unavailable_problem(exc) from exc
        raise
    if principal is None:
        return None
    cache.put(token_hash, principal)
    return principal
