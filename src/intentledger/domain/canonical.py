"""One byte sequence per JSON value, so that equal requests hash equally.

The idempotency contract compares a replayed request with the first by hash: two
bodies that differ only in key order, whitespace or ``1`` versus ``1.0`` must be the
same request, and any other difference must not be. The form follows RFC 8785
(JSON Canonicalization Scheme, JCS) closely:

- object members sorted by key, compared as UTF-16 code units (RFC 8785 §3.2.3),
  which differs from code-point order only for keys mixing characters above
  U+FFFF with ones in U+E000..U+FFFF;
- no whitespace between tokens (§3.2.1);
- strings in UTF-8 (§3.2.4), escaping only what JSON requires (§3.2.2.2): ``"``,
  ``\\``, and U+0000..U+001F, as ``\\b \\t \\n \\f \\r`` or ``\\u00xx`` (lower-case hex);
- one form per number: an ``int``, or a ``float`` that is integral and within
  ±2**53 (where every integer is exact), is written as an integer; ``-0.0`` as
  ``0``; any other float in Python's shortest round-trip ``repr``.

Where it departs from JCS, deliberately: JCS writes every number as an IEEE 754
double in ECMAScript form, so it would round integers beyond 2**53 (amounts in
minor units must never be rounded: here they are written exactly) and would
write ``1e+16`` as ``10000000000000000`` and ``1e-07`` as ``1e-7`` (here ``repr``).
A float outside ±2**53 is therefore not the same value as the equal ``int``.
Strings must be valid Unicode (no lone surrogates, as I-JSON, RFC 7493 §2.1, says).
"""

from __future__ import annotations

import hashlib
import math

import orjson

__all__ = ["canonical_json", "request_hash"]

_EXACT_FLOAT_LIMIT = 2**53  # every integer of this size or less is an exact double

# RFC 8785 §3.2.2.2: the two-character escapes where JSON has one, else \u00xx.
_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_ESCAPES: dict[int, str] = {
    **{code: _SHORT_ESCAPES.get(chr(code), f"\\u{code:04x}") for code in range(0x20)},
    ord('"'): '\\"',
    ord("\\"): "\\\\",
}


def canonical_json(value: object) -> bytes:
    """Serialise ``value`` to its canonical JSON bytes (UTF-8, RFC 8785 §3.2).

    Accepts only ``dict`` (with ``str`` keys), ``list``, ``str``, ``int``, ``float``,
    ``bool`` and ``None``; anything else raises ``TypeError``. NaN, infinities, lone
    surrogates, circular references and integers beyond Python's int-to-str digit
    limit (4300 digits by default) raise ``ValueError``.
    """
    if _orjson_writes_it_canonically(value):
        try:
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:
            pass  # a lone surrogate: the writer below says so as ValueError
    return _written(value)


def _written(value: object) -> bytes:
    """`canonical_json` by this module's own writer, for every value."""
    parts: list[str] = []
    _write(value, parts, set())
    try:
        return "".join(parts).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode: found a lone surrogate") from None


# Deeper than this, orjson refuses a value (and a circular one never ends): such
# values take the writer below, which says what is wrong with them.
_ORJSON_DEPTH = 254


def _orjson_writes_it_canonically(value: object, depth: int = 0) -> bool:
    """Whether orjson with sorted keys writes exactly the bytes `_write` would:
    for values of only exact `dict`, `list`, `str`, `int` within 64 bits,
    `bool` and `None`, with ASCII keys. orjson escapes strings as this form does
    and writes such integers the same way; it sorts keys by code point, which
    is UTF-16 order for ASCII keys. Floats (other number forms), other key
    characters, subclasses and anything else take `_write`. This is the
    intake hot path's hash: orjson is C, `_write` about 11 µs an intent
    (docs/benchmarks.md); tests/domain/test_canonical.py holds the two equal."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return -(2**63) <= value < 2**63  # type: ignore[operator]
    if depth >= _ORJSON_DEPTH:
        return False
    # Loops, not all() over a generator, and strings told without a call:
    # these cost intake's hash a third of its instructions (docs/benchmarks.md step 38).
    if kind is dict:
        for key, item in value.items():  # type: ignore[attr-defined]
            if not (type(key) is str and key.isascii()):
                return False
            if type(item) is not str and not _orjson_writes_it_canonically(item, depth + 1):
                return False
        return True
    if kind is list:
        for item in value:  # type: ignore[attr-defined]
            if type(item) is not str and not _orjson_writes_it_canonically(item, depth + 1):
                return False
        return True
    return False


def request_hash(actor: str, route: str, body: object) -> str:
    """Lower-case hex SHA-256 of the canonical JSON of ``{actor, route, body}``.

    Actor and route are inside the hashed value, so the same body sent by another
    actor or to another route never collides with it.
    """
    envelope = {"actor": actor, "route": route, "body": body}
    return hashlib.sha256(canonical_json(envelope)).hexdigest()


def _write(value: object, parts: list[str], open_containers: set[int]) -> None:
    # bool before int: bool is a subclass of int, and True must not become 1.
    if value is None:
        parts.append("null")
    elif isinstance(value, bool):
        parts.append("true" if value else "false")
    elif isinstance(value, int):
        parts.append(str(int(value)))  # int(): an IntEnum's str() is not its number
    elif isinstance(value, float):
        parts.append(_number(value))
    elif isinstance(value, str):
        parts.append(_string(value))
    elif isinstance(value, list | dict):
        _write_container(value, parts, open_containers)
    else:
        raise TypeError(
            f"cannot canonicalise {type(value).__name__}: "
            "only dict, list, str, int, float, bool and None are JSON values"
        )


def _write_container(
    value: list[object] | dict[object, object], parts: list[str], open_containers: set[int]
) -> None:
    # A container inside itself has no finite JSON form; say so instead of recursing.
    if id(value) in open_containers:
        raise ValueError("cannot canonicalise a circular reference")
    open_containers.add(id(value))
    if isinstance(value, list):
        _write_array(value, parts, open_containers)
    else:
        _write_object(value, parts, open_containers)
    open_containers.discard(id(value))


def _write_array(items: list[object], parts: list[str], open_containers: set[int]) -> None:
    parts.append("[")
    for index, item in enumerate(items):
        if index:
            parts.append(",")
        _write(item, parts, open_containers)
    parts.append("]")


def _write_object(
    members: dict[object, object], parts: list[str], open_containers: set[int]
) -> None:
    keys: list[str] = []
    for key in members:
        if not isinstance(key, str):
            raise TypeError(f"object keys must be str, got {type(key).__name__} {key!r}")
        keys.append(key)
    parts.append("{")
    for index, key in enumerate(sorted(keys, key=_utf16_order)):
        if index:
            parts.append(",")
        parts.append(_string(key))
        parts.append(":")
        _write(members[key], parts, open_containers)
    parts.append("}")


def _utf16_order(key: str) -> bytes:
    # Big-endian UTF-16 bytes compare exactly as the code units do (RFC 8785 §3.2.3).
    # "surrogatepass" lets a lone surrogate sort; encoding to UTF-8 rejects it later.
    return key.encode("utf-16-be", "surrogatepass")


def _number(value: float) -> str:
    if not math.isfinite(value):
        raise ValueError(f"JSON has no form for {value!r} (RFC 8785 §3.2.2.3)")
    if value.is_integer() and abs(value) <= _EXACT_FLOAT_LIMIT:
        return str(int(value))  # 1.0 -> "1", -0.0 -> "0"
    return repr(float(value))


def _string(text: str) -> str:
    # str.translate, not text.translate: a str subclass must not change the output.
    return '"' + str.translate(text, _ESCAPES) + '"'
