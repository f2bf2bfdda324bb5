"""Where merchant webhooks may go: https on public addresses, unless allowed otherwise."""

from __future__ import annotations

import pytest

from intentledger.domain.webhook_targets import (
    MAX_URL_LENGTH,
    TargetRefused,
    literal_address,
    parse_target,
    refuse_private,
)


@pytest.mark.parametrize(
    "url",
    [
        "http://hooks.example.com/in",  # plain http
        "ftp://hooks.example.com/in",
        "hooks.example.com/in",
        "https:///in",  # no host
        "https://user:pw@hooks.example.com/in",
        "https://hooks.example.com/in#frag",
        "https://hooks.example.com:0/in",
        "https://hooks.example.com:99999/in",
        "https://hooks.exa mple.com/in",
        "https://hooks.example.com/\x00",
        "https://hööks.example.com/in",
        "https://hooks.example.com/" + "a" * MAX_URL_LENGTH,
        "https://hooks.example.com/\x7f",
        "https://a..example.com/",
        "https://-a.example.com/",
        "https://" + "a" * 64 + ".example.com/",
    ],
)
def test_malformed_or_plain_targets_are_refused(url: str) -> None:
    with pytest.raises(TargetRefused):
        parse_target(url, allow_private=False)


def test_private_targets_allow_plain_http_but_not_other_schemes() -> None:
    assert parse_target("http://127.0.0.1:8080/hooks", allow_private=True).port == 8080
    with pytest.raises(TargetRefused):
        parse_target("ftp://127.0.0.1/hooks", allow_private=True)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.9",
        "192.168.1.1",
        "169.254.169.254",  # the cloud metadata service
        "100.64.0.1",  # carrier-grade NAT
        "0.0.0.0",
        "::1",
        "fe80::1%eth0",
        "fc00::1",
        "::ffff:127.0.0.1",  # IPv4-mapped loopback
        "203.0.113.7",  # documentation range
        "64:ff9b::a00:5",  # NAT64 to 10.0.0.5
        "64:ff9b:1::808:808",  # local-use NAT64: whatever the network holds
        "2002:a9fe:a9fe::",  # 6to4 around 169.254.169.254
        "::a9fe:a9fe",  # IPv4-compatible 169.254.169.254
    ],
)
def test_private_and_special_addresses_are_refused(address: str) -> None:
    with pytest.raises(TargetRefused, match="not public"):
        refuse_private("hooks.example.com", [address])


def test_one_private_address_among_public_ones_is_enough_to_refuse() -> None:
    refuse_private("hooks.example.com", ["8.8.8.8", "2001:4860:4860::8888"])
    # NAT64 and 6to4 around a public IPv4 address are public.
    refuse_private("hooks.example.com", ["64:ff9b::808:808", "2002:808:808::1"])
    with pytest.raises(TargetRefused):
        refuse_private("hooks.example.com", ["8.8.8.8", "10.0.0.1"])
    with pytest.raises(TargetRefused, match="no address"):
        refuse_private("hooks.example.com", [])


def test_literal_addresses_are_recognised() -> None:
    assert str(literal_address("8.8.8.8")) == "8.8.8.8"
    assert str(literal_address("2001:db8::1")) == "2001:db8::1"
    assert literal_address("hooks.example.com") is None
