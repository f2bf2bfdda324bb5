"""Where merchant webhooks may be sent. Pure: addresses come resolved.

A webhook URL makes our workers open connections where a merchant says. Left
open, that lets anyone with a token probe or call what sits on our own network
(the cloud metadata service, the database, an admin port): server-side request
forgery. So by default a target must be `https` on a public address — every
address its name resolves to, because a name that resolves to one public and
one private address could be answered by the private one. For development and
tests, allowing private targets lifts both the address and the scheme rule.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import SplitResult, urlsplit

MAX_URL_LENGTH = 2048


class TargetRefused(ValueError):
    """Why a URL may not receive webhooks (safe to show to the merchant)."""


def parse_target(url: str, allow_private: bool) -> SplitResult:
    """The URL's parts if its form is acceptable; TargetRefused otherwise."""
    if len(url) > MAX_URL_LENGTH:
        raise TargetRefused(f"the URL is longer than {MAX_URL_LENGTH} characters")
    if not url.isascii() or any(ch.isspace() or ord(ch) < 0x20 for ch in url):
        raise TargetRefused("the URL must be ASCII with no spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"the URL does not parse: {exc}") from None
    allowed = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in allowed:
        raise TargetRefused(
            "the URL must use https"
            + ("" if allow_private else " (http only with private targets allowed)")
        )
    if not parts.hostname:
        raise TargetRefused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("the URL must not carry credentials; sign-in is by signature")
    if parts.fragment:
        raise TargetRefused("the URL must not have a fragment")
    if port == 0:
        raise TargetRefused("the URL's port must not be 0")
    return parts


def literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host names literally ("203.0.113.9", "[2001:db8::1]"'s
    inside), or None for a name that must be resolved."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def refuse_private(host: str, addresses: Iterable[str]) -> None:
    """TargetRefused unless `host` resolved to at least one address and all are public."""
    resolved = [ipaddress.ip_address(a.split("%", 1)[0]) for a in addresses]
    if not resolved:
        raise TargetRefused(f"{host} resolves to no address")
    for address in resolved:
        # An IPv4-mapped IPv6 address reaches the IPv4 one: judge that.
        mapped = getattr(address, "ipv4_mapped", None)
        if not (mapped or address).is_global:
            raise TargetRefused(
                f"{host} resolves to {address}, which is not a public address "
                "(INTENTLEDGER_WEBHOOK_ALLOW_PRIVATE=true allows it for development)"
            )
