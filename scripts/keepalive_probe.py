"""Probe the stale keep-alive race against a running sandbox (docs/benchmarks.md).

40 clients of 8 connections each call the sandbox, leave their connections idle
for 4.97-5.03 s (around uvicorn's 5 s keep-alive) and call again, ten times;
prints the answers and errors seen. An optional second argument overrides the
client's idle-connection lifetime (httpx's default is 5.0).

    intentledger sandbox --port 18999 &
    .venv/bin/python scripts/keepalive_probe.py http://127.0.0.1:18999/_sandbox [SECONDS]
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
import time

import httpx
import uvloop

from intentledger.providers import http


async def probe(url: str, seen: collections.Counter[str]) -> None:
    client = http.ShardedClient(8, url, httpx.Timeout(10.0))

    async def call() -> None:
        started = time.monotonic()
        try:
            answer = await client.request("GET", "/charges", params={"reference": "x"})
            seen[str(answer.status_code)] += 1
        except httpx.HTTPError as error:
            seen[f"{type(error).__name__} after {time.monotonic() - started:.1f} s"] += 1

    try:
        for _ in range(10):
            await asyncio.gather(*(call() for _ in range(8)))
            await asyncio.sleep(random.uniform(4.97, 5.03))
    finally:
        await client.aclose()


async def main() -> None:
    if len(sys.argv) > 2:
        http.IDLE_CONNECTION_SECONDS = float(sys.argv[2])
    seen: collections.Counter[str] = collections.Counter()
    await asyncio.gather(*(probe(sys.argv[1], seen) for _ in range(40)))
    print(dict(seen))


uvloop.run(main())
