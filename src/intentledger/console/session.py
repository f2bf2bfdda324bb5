"""The console's sign-in: a server-side session opened with an operator's key,
and the CSRF token of its forms.

The browser holds only a random session id (`HttpOnly`: no script reads it;
`SameSite=Strict`: no other site's page sends it; `Secure` except over plain
http to this machine's loopback). The key itself never leaves the sign-in
form: the session row names it, and every request checks on the server that
the session is open, unexpired and its key not revoked (store/console_sessions.py),
so signing out, the session's expiry and `intentledger keys revoke` end it at once.

Every form that changes something carries a CSRF token derived from the
session id (an HMAC of a fixed label under it): only a page this service
rendered for that session can know it, and it needs no storage. Posts must
also come from this origin when the browser says where from.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from datetime import timedelta
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from intentledger.engine import console_sessions
from intentledger.engine.api_keys import Principal
from intentledger.engine.console_sessions import ConsoleKey, ConsoleSession

COOKIE = "intentledger_console"
COOKIE_PATH = "/console"
# A signed-in browser stays signed in for one working shift at most.
SESSION_LENGTH = timedelta(hours=12)
CSRF_FIELD = "csrf_token"
_CSRF_LABEL = b"intentledger console csrf v1"


def csrf_token(session_id: str) -> str:
    return hmac.new(session_id.encode("utf-8"), _CSRF_LABEL, hashlib.sha256).hexdigest()


def csrf_matches(session_id: str, sent: str | None) -> bool:
    return sent is not None and hmac.compare_digest(csrf_token(session_id), sent)


async def signed_in(request: Request) -> tuple[str, Principal] | None:
    """The open session's id and its key's principal; None when there is none."""
    session_id = request.cookies.get(COOKIE)
    if not session_id or len(session_id) > 100:
        return None
    session = await console_sessions.find_open(
        request.app.state.engine, session_id, request.app.state.clock()
    )
    if session is None:
        return None
    return session.session_id, Principal(session.actor, session.is_operator)


async def key_of(request: Request, token: str) -> ConsoleKey | None:
    return await console_sessions.key_of(request.app.state.engine, token)


async def begin(request: Request, response: Response, key: ConsoleKey) -> ConsoleSession:
    session = await console_sessions.sign_in(
        request.app.state.engine, key, request.app.state.clock(), SESSION_LENGTH
    )
    response.set_cookie(
        COOKIE,
        session.session_id,
        max_age=int(SESSION_LENGTH.total_seconds()),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=not _plain_http_to_loopback(request),
    )
    return session


async def end(request: Request, response: Response) -> None:
    session_id = request.cookies.get(COOKIE)
    if session_id and len(session_id) <= 100:
        await console_sessions.sign_out(request.app.state.engine, session_id)
    response.delete_cookie(
        COOKIE,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=not _plain_http_to_loopback(request),
    )


def _loopback(host: str) -> bool:
    """Whether a Host header (`name`, `name:port`, `[v6]:port`) names this
    machine's loopback; urlsplit knows where an IPv6 literal's brackets end.
    A Host is a name and a port and nothing else: credentials, a path, a query
    or a fragment would make urlsplit read past what the browser sent."""
    if any(mark in host for mark in "@/?#\\"):
        return False
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:  # unbalanced brackets: names nothing
        return False
    if name is None:
        return False
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _plain_http_to_loopback(request: Request) -> bool:
    """Development on this machine: a `Secure` cookie would not come back over
    plain http. Anywhere else the console is served over https (behind a TLS
    proxy this process may see http, but the browser sees https)."""
    host = request.headers.get("host", "")
    return request.url.scheme == "http" and _loopback(host)


def same_origin(request: Request) -> bool:
    """A post's Origin (every current browser sends one on a form post) is this
    service: https at its host, or plain http only on loopback. A post without
    an Origin (a script, curl) is judged by its CSRF token alone."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host")
    if host is None:
        return False
    return origin == f"https://{host}" or (origin == f"http://{host}" and _loopback(host))
