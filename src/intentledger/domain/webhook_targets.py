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
import re
from collections.abc import Iterable
from urllib.parse import SplitResult, urlsplit

MAX_URL_LENGTH = 2048
# What a refusal names, so that a developer on loopback knows what lifts it.
ALLOW_PRIVATE_SETTING = "INTENTLEDGER_WEBHOOK_ALLOW_PRIVATE=true (--webhook-allow-private)"


class TargetRefused(ValueError):
    """Why a URL may not receive webhooks (safe to show to the merchant)."""


def parse_target(url: str, allow_private: bool) -> SplitResult:
    """The URL's parts if its form is acceptable; TargetRefused otherwise."""
    if len(url) > MAX_URL_LENGTH:
        raise TargetRefused(f"the URL is longer than {MAX_URL_LENGTH} characters")
    # Visible ASCII only (0x21-0x7E): no spaces, controls or DEL, which an HTTP
    # client would refuse at every attempt.
    if not all(0x21 <= ord(ch) <= 0x7E for ch in url):
        raise TargetRefused("the URL must be visible ASCII: no spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"the URL does not parse: {exc}") from None
    allowed = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in allowed:
        raise TargetRefused(
            "the URL must use https"
            + (
                ""
                if allow_private
                else f" ({ALLOW_PRIVATE_SETTING} allows plain http, for development and tests only)"
            )
        )
    if not parts.hostname:
        raise TargetRefused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("the URL must not carry credentials; sign-in is by signature")
    if parts.fragment:
        raise TargetRefused("the URL must not have a fragment")
    if port == 0:
        raise TargetRefused("the URL's port must not be 0")
    if literal_address(parts.hostname) is None:
        _refuse_bad_name(parts.hostname)
    return parts


def _refuse_bad_name(host: str) -> None:
    """A DNS name: at most 253 characters, labels of 1-63 letters, digits or hyphens."""
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise TargetRefused("the URL's host is not a valid name")


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

IP = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes that carry an IPv4 address in their low 32 bits and reach it
# (NAT64's well-known prefix, the deprecated IPv4-compatible form): judged by it.
_EMBEDS_IPV4_LOW = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("::/96"))
# Local-use NAT64 (RFC 8215): translates to whatever the operator's network holds.
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")


def literal_address(host: str) -> IP | None:
    """The address a host names literally ("203.0.113.9", "[2001:db8::1]"'s
    inside), or None for a name that must be resolved."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_public(address: IP) -> bool:
    """Globally reachable, also through every IPv6 form that reaches an IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address in _LOCAL_NAT64:
            return False
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and any(address in net for net in _EMBEDS_IPV4_LOW):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return embedded.is_global
    return address.is_global


def refuse_private(host: str, addresses: Iterable[str]) -> list[IP]:
    """The addresses, if `host` resolved to at least one and all are public;
    TargetRefused otherwise (not naming the address: what our resolver sees
    of a name is not the merchant's business)."""
    resolved = [ipaddress.ip_address(a.split("%", 1)[0]) for a in addresses]
    if not resolved:
        raise TargetRefused(f"{host} resolves to no address")
    if not all(is_public(address) for address in resolved):
        raise TargetRefused(
            f"{host} is or resolves to an address that is not public "
            f"({ALLOW_PRIVATE_SETTING} allows it, for development and tests only)"
        )
    return resolved
