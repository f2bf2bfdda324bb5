"""Reading request bodies: a size limit, then JSON, then an object."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from intentledger.api.problems import Problem

MAX_BODY_BYTES = 64 * 1024


async def read_json_body(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Problem(
            400, "malformed-json", "Bad Request", f"the body is not valid JSON: {exc}"
        ) from exc


def _too_large() -> Problem:
    return Problem(
        413, "body-too-large", "Content Too Large", f"the body exceeds {MAX_BODY_BYTES} bytes"
    )


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await read_json_body(request)
    if not isinstance(raw, dict):
        raise Problem(
            422, "invalid-request", "Unprocessable Content", "the body must be a JSON object"
        )
    return raw
