"""The console's sign-in: an operator's API token in a cookie, and CSRF tokens.

The cookie holds the token itself (`HttpOnly`: no script reads it;
`SameSite=Strict`: no other site's page sends it; `Secure` over https), so a
key revoked with `intentledger keys revoke` signs the console out as soon as
the API stops accepting it — there is no second credential to revoke.

Every form that changes something carries a CSRF token derived from the
signed-in token (an HMAC of a fixed label under the token): only a page this
service rendered for that operator can know it, and it needs no storage.
Posts must also come from this origin when the browser says where from.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

from starlette.requests import Request
from starlette.responses import Response

from intentledger.api.auth import Principal, principal_of

COOKIE = "intentledger_console"
COOKIE_PATH = "/console"
# A signed-in browser stays signed in for one working shift.
SESSION_LENGTH = timedelta(hours=12)
CSRF_FIELD = "csrf_token"
_CSRF_LABEL = b"intentledger console csrf v1"


def csrf_token(token: str) -> str:
    return hmac.new(token.encode("utf-8"), _CSRF_LABEL, hashlib.sha256).hexdigest()


def csrf_matches(token: str, sent: str | None) -> bool:
    return sent is not None and hmac.compare_digest(csrf_token(token), sent)


def signed_in_token(request: Request) -> str | None:
    token = request.cookies.get(COOKIE)
    return token if token else None


async def signed_in(request: Request) -> tuple[str, Principal] | None:
    """The cookie's token and its principal; None when absent, unknown or revoked."""
    token = signed_in_token(request)
    if token is None:
        return None
    principal = await principal_of(request, token)
    return None if principal is None else (token, principal)


def is_https(request: Request) -> bool:
    return request.url.scheme == "https"


def keep_signed_in(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        COOKIE,
        token,
        max_age=int(SESSION_LENGTH.total_seconds()),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=is_https(request),
    )


def sign_out(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict", secure=is_https(request)
    )


def same_origin(request: Request) -> bool:
    """A post's Origin (sent by every current browser on a form post) is this
    service's own; a post without one (a script, curl) is judged by its token."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host")
    return host is not None and origin in (f"http://{host}", f"https://{host}")
