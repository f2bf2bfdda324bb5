"""Reading request bodies: the edge (api/edge.py) has already read and parsed them."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from intentledger.api.edge import JSON_STATE, NO_BODY
from intentledger.web.problems import Problem


async def read_json_body(request: Request) -> Any:
    """The body's JSON value, as the edge parsed it under its strict rules."""
    # A JSON `null` body parses to None: absence is told by the key, not the value.
    state = request.scope.get("state", {})
    assert JSON_STATE in state, "every /v1 route with a body sits behind the edge"
    parsed = state[JSON_STATE]
    if parsed is NO_BODY:
        raise Problem(400, "malformed-json", "Bad Request", "the body is empty: send a JSON object")
    return parsed


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await read_json_body(request)
    if not isinstance(raw, dict):
        raise Problem(
            422, "invalid-request", "Unprocessable Content", "the body must be a JSON object"
        )
    return raw
