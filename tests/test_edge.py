"""The hardened HTTP edge (issue 13, defects 1-5), over real HTTP on both databases.

Every case is sent to a real `intentledger serve --no-workers` and must get a
clean problem+json answer and write nothing — on PostgreSQL, which refuses
what SQLite would store (NUL, over-long ids), as on SQLite.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from intentledger.ports import free_port
from tests.conftest import BACKENDS, Databases
from tests.support import Process
from tests.test_intake_http import PAYMENT, Service, assert_problem, create_key, serving

JSON = "application/json"


@pytest.fixture(scope="module", params=BACKENDS)
def edge(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """A service with two actors, an operator and a 200-character actor name."""
    database_url = databases.create(str(request.param))
    tokens = {actor: create_key(database_url, actor) for actor in ("alice", "bob")}
    tokens["olive"] = create_key(database_url, "olive", operator=True)
    tokens["long"] = create_key(database_url, "a" * 200)
    with serving(database_url, tmp_path_factory.mktemp("edge")) as url:
        yield Service(url, database_url, tokens)


def _nested(depth: int) -> bytes:
    return json.dumps({**PAYMENT, "metadata": {}}).encode()[:-1] + (
        b', "description": ' + b"[" * depth + b"]" * depth + b"}"
    )


BODIES: list[tuple[str, bytes, dict[str, str], int]] = [
    # (case, raw body, header changes, status). A header set to "" is removed.
    ("NUL in description", json.dumps({**PAYMENT, "description": "a\u0000b"}).encode(), {}, 400),
    (
        "NUL in payment_method",
        json.dumps({**PAYMENT, "payment_method": "pm\u0000"}).encode(),
        {},
        400,
    ),
    (
        "NUL in a metadata key",
        json.dumps({**PAYMENT, "metadata": {"k\u0000": "v"}}).encode(),
        {},
        400,
    ),
    ("nested 1,000 deep", _nested(1000), {}, 400),
    ("nested 40 deep", _nested(40), {}, 400),
    (
        "a 4,400-digit integer",
        b'{"amount": ' + b"9" * 4400 + b', "currency": "EUR", "payment_method": "pm_ok"}',
        {},
        400,
    ),
    (
        "a 41-digit integer",
        b'{"amount": 1' + b"0" * 40 + b', "currency": "EUR", "payment_method": "pm_ok"}',
        {},
        400,
    ),
    (
        "duplicate keys",
        b'{"amount": 100, "amount": 999999, "currency": "EUR", "payment_method": "pm_ok"}',
        {},
        400,
    ),
    ("NaN", b'{"amount": NaN, "currency": "EUR", "payment_method": "pm_ok"}', {}, 400),
    (
        "an infinite float",
        b'{"amount": 1e999, "currency": "EUR", "payment_method": "pm_ok"}',
        {},
        400,
    ),
    # Past what a decimal holds: the exact reading of whole numbers must not be a 500.
    (
        "an exponent past any decimal",
        b'{"amount": 1e999999999999999999999, "currency": "EUR", "payment_method": "pm_ok"}',
        {},
        400,
    ),
    (
        "a negative exponent past any decimal",
        b'{"amount": 1.5e-9999999999999999999, "currency": "EUR", "payment_method": "pm_ok"}',
        {},
        400,
    ),
    ("text/plain", json.dumps(PAYMENT).encode(), {"Content-Type": "text/plain"}, 415),
    ("no Content-Type", json.dumps(PAYMENT).encode(), {"Content-Type": ""}, 415),
    ("application/xml", json.dumps(PAYMENT).encode(), {"Content-Type": "application/xml"}, 415),
    (
        "form-encoded",
        b"amount=1250&currency=EUR",
        {"Content-Type": "application/x-www-form-urlencoded"},
        415,
    ),
    (
        "charset latin-1",
        json.dumps(PAYMENT).encode(),
        {"Content-Type": "application/json; charset=latin-1"},
        415,
    ),
    (
        "charset utf-16",
        json.dumps(PAYMENT).encode("utf-16"),
        {"Content-Type": "application/json; charset=utf-16"},
        415,
    ),
    ("a UTF-8 byte-order mark", b"\xef\xbb\xbf" + json.dumps(PAYMENT).encode(), {}, 400),
    ("UTF-16 without a charset", json.dumps(PAYMENT).encode("utf-16"), {}, 400),
    ("Content-Encoding br", json.dumps(PAYMENT).encode(), {"Content-Encoding": "br"}, 415),
    ("Content-Encoding gzip", json.dumps(PAYMENT).encode(), {"Content-Encoding": "gzip"}, 415),
]


@pytest.mark.parametrize(
    ("case", "body", "changes", "status"), BODIES, ids=[case for case, *_ in BODIES]
)
def test_bad_bodies_get_a_problem_and_write_nothing(
    edge: Service, case: str, body: bytes, changes: dict[str, str], status: int
) -> None:
    headers = {**edge.headers(key="edge-" + case.replace(" ", "-")), "Content-Type": JSON}
    for name, value in changes.items():
        if value:
            headers[name] = value
        else:
            headers.pop(name)
    before = edge.snapshot()
    response = httpx.post(f"{edge.url}/v1/payments", content=body, headers=headers)
    assert_problem(response, status)
    assert edge.snapshot() == before


def test_a_json_body_with_charset_utf8_is_accepted(edge: Service) -> None:
    headers = {
        **edge.headers(key="edge-charset"),
        "Content-Type": "application/json; charset=UTF-8",
    }
    response = httpx.post(f"{edge.url}/v1/payments", content=json.dumps(PAYMENT), headers=headers)
    assert response.status_code == 202, response.text


def _raw_request(url: str, lines: list[str], body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly these header lines (repeats included) and `body`; return the
    status and the whole answer. Only what is given is sent: a declared length
    with no body tests that the server answers without waiting for it."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        head = "\r\n".join([*lines, f"Host: {parts.hostname}", "Connection: close", "", ""])
        sock.sendall(head.encode("latin-1") + body)
        received = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            received += chunk
    status_line = received.split(b"\r\n", 1)[0]
    return int(status_line.split()[1]), received


@pytest.mark.parametrize("header", ["Idempotency-Key", "Authorization"])
def test_a_repeated_singleton_header_is_refused(edge: Service, header: str) -> None:
    body = json.dumps(PAYMENT).encode()
    values = {
        "Idempotency-Key": ["Idempotency-Key: first", "Idempotency-Key: second"],
        "Authorization": [
            f"Authorization: Bearer {edge.tokens['alice']}",
            f"Authorization: Bearer {edge.tokens['bob']}",
        ],
    }
    lines = [
        "POST /v1/payments HTTP/1.1",
        f"Content-Type: {JSON}",
        f"Content-Length: {len(body)}",
        *values[header],
    ]
    if header != "Authorization":
        lines.append(f"Authorization: Bearer {edge.tokens['alice']}")
    if header != "Idempotency-Key":
        lines.append("Idempotency-Key: edge-repeated")
    before = edge.snapshot()
    status, raw = _raw_request(edge.url, lines, body)
    assert status == 400, raw
    assert b"application/problem+json" in raw
    assert f"{header} was sent more than once".encode() in raw
    assert edge.snapshot() == before


def test_no_body_is_read_before_authentication_or_past_the_limit(edge: Service) -> None:
    """A request declaring 50 MB gets its answer without sending a byte of it:
    401 without a token, 413 with one — on an operator route as on payments."""
    path = "/v1/ops/operations/op_x/resolve"
    declared = [f"POST {path} HTTP/1.1", f"Content-Type: {JSON}", "Content-Length: 50000000"]
    status, _ = _raw_request(edge.url, declared)
    assert status == 401
    with_token = [*declared, f"Authorization: Bearer {edge.tokens['olive']}"]
    status, _ = _raw_request(edge.url, with_token)
    assert status == 413
    big = json.dumps({"outcome": "failed", "evidence": "x" * 5_000_000})
    response = httpx.post(
        f"{edge.url}{path}",
        content=big,
        headers={**edge.headers("olive", key="edge-big"), "Content-Type": JSON},
    )
    assert_problem(response, 413)


BAD_PATHS: list[tuple[str, str]] = [
    ("GET", "/v1/operations/op_%00"),
    ("GET", "/v1/operations/" + "o" * 41),
    ("GET", "/v1/operations/op_%C3%A9"),
    ("POST", "/v1/mandates/" + "m" * 41 + "/suspend"),
    ("POST", "/v1/mandates/md_%00/revoke"),
    ("POST", "/v1/ops/operations/" + "o" * 41 + "/escalate"),
    ("POST", "/v1/ops/operations/op_%00/escalate"),
    ("POST", "/v1/cards/" + "c" * 41 + "/freeze"),
]


@pytest.mark.parametrize(("method", "path"), BAD_PATHS, ids=[p for _, p in BAD_PATHS])
def test_ids_that_name_nothing_are_404_and_write_nothing(
    edge: Service, method: str, path: str
) -> None:
    actor = "olive" if "/ops/" in path else "alice"
    headers = edge.headers(actor, key="edge-path-" + str(abs(hash(path))))
    body: dict[str, Any] | None = {"reason": "a look"} if "/ops/" in path else None
    before = edge.snapshot()
    response = httpx.request(method, f"{edge.url}{path}", headers=headers, json=body)
    assert_problem(response, 404)
    assert edge.snapshot() == before


def test_a_long_actor_name_pays_like_any_other(edge: Service) -> None:
    response = httpx.post(
        f"{edge.url}/v1/payments", json=PAYMENT, headers=edge.headers("long", key="edge-long")
    )
    assert response.status_code == 202, response.text
    assert response.json()["actor"] == "a" * 200


def test_a_quoted_key_and_a_bare_key_are_the_same_key(edge: Service) -> None:
    """The draft's structured-field form ("abc") and the bare form (abc) name one key."""
    quoted = httpx.post(
        f"{edge.url}/v1/payments", json=PAYMENT, headers=edge.headers(key='"edge-sf-1"')
    )
    bare = httpx.post(
        f"{edge.url}/v1/payments", json=PAYMENT, headers=edge.headers(key="edge-sf-1")
    )
    assert (quoted.status_code, bare.status_code) == (202, 200)
    assert bare.json()["id"] == quoted.json()["id"]
    assert quoted.json()["idempotency_key"] == "edge-sf-1"


def test_the_sandbox_is_mounted_only_where_it_is_the_provider(
    databases: Databases, tmp_path: Path
) -> None:
    database_url = databases.create("sqlite")
    own, elsewhere = free_port(), free_port()
    base = ["serve", "--no-workers", "--database-url", database_url]
    plain = Process([*base, "--port", str(own)], {}, tmp_path / "own.log")
    pointed = Process(
        [*base, "--port", str(elsewhere), "--provider-url", f"http://127.0.0.1:{own}/_sandbox"],
        {},
        tmp_path / "elsewhere.log",
    )
    try:
        plain.wait_healthy(f"http://127.0.0.1:{own}/healthz")
        pointed.wait_healthy(f"http://127.0.0.1:{elsewhere}/healthz")
        assert httpx.get(f"http://127.0.0.1:{own}/_sandbox/charges").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{elsewhere}/_sandbox/charges").status_code == 404
        assert "test provider with no authentication" in plain.output()
        assert "test provider" not in pointed.output()
    finally:
        plain.stop()
        pointed.stop()


def test_slow_clients_are_cut_off_and_health_stays_responsive(
    databases: Databases, tmp_path: Path
) -> None:
    database_url = databases.create("sqlite")
    token = create_key(database_url, "sam")
    port = free_port()
    api = Process(
        [
            "serve",
            "--no-workers",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--header-timeout",
            "2s",
            "--body-timeout",
            "2s",
        ],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    heads: list[socket.socket] = []
    bodies: list[socket.socket] = []
    try:
        api.wait_healthy(url + "/healthz")
        for _ in range(100):  # a request head that never ends
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /v1/payments HTTP/1.1\r\nHost: x\r\n")
            heads.append(sock)
        head = (
            f"POST /v1/payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Idempotency-Key: slow\r\nContent-Type: {JSON}\r\nContent-Length: 1000\r\n\r\n"
        )
        for _ in range(50):  # a body that never ends
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head.encode() + b'{"amount": ')
            bodies.append(sock)
        with httpx.Client(timeout=1.0) as client:
            assert client.get(url + "/healthz").status_code == 200
        for sock in heads:  # closed by the server after the header timeout
            sock.settimeout(10)
            assert sock.recv(1024) == b""
        for sock in bodies:  # answered 408 after the body timeout
            sock.settimeout(10)
            assert sock.recv(1024).startswith(b"HTTP/1.1 408")
    finally:
        for sock in heads + bodies:
            sock.close()
        api.stop()


def test_a_json_null_body_is_a_clean_refusal(edge: Service) -> None:
    for path in ("/v1/payments", "/v1/cards", "/v1/mandates"):
        response = httpx.post(
            f"{edge.url}{path}",
            content=b"null",
            headers={**edge.headers(key="edge-null"), "Content-Type": JSON},
        )
        assert_problem(response, 422)
