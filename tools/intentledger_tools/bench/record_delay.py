"""What the record-delay phase needs beyond the other phases (issue 39 item 6): a
histogram's quantiles from its buckets, the workers' record-delay buckets read
from their /metrics, percentiles of the ledger's own timeline, and payments
sent through intake at a steady pace.

The quantiles are computed from bucket counts as Prometheus's
`histogram_quantile` computes them, so a figure here reads as the same
query over the workers' scrapes would: the rank's bucket found, and the value
interpolated linearly inside it (from 0 for the first bucket); a rank in the
`+Inf` bucket reads as the highest finite bound.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

RECORD_DELAY_METRIC = "intentledger_record_delay_seconds"

# Cumulative bucket counts of one histogram: (upper bound, observations at or under it),
# by ascending bound, the last one +Inf.
Buckets = list[tuple[float, float]]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The `q`-quantile (0 to 1) of a histogram's cumulative `buckets`, as Prometheus's
    histogram_quantile estimates it; None when nothing was observed."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is from 0 to 1, not {q}")
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        raise ValueError("a histogram needs a finite bucket and the +Inf one")
    total = ordered[-1][1]
    if total <= 0:
        return None
    rank = q * total
    start, below = 0.0, 0.0
    for n, (bound, count) in enumerate(ordered):
        if count >= rank:
            if math.isinf(bound):
                return ordered[n - 1][0]
            if n == 0 and bound <= 0:
                return bound
            inside = count - below
            if inside <= 0:
                return start
            return start + (bound - start) * (rank - below) / inside
        start, below = bound, count
    return ordered[-2][0]  # unreachable: the +Inf bucket holds every observation


def summed_buckets(
    scrapes: Iterable[str], metric: str, labels: dict[str, str]
) -> tuple[Buckets, float]:
    """The cumulative buckets of `metric`'s series with `labels`, added up bound by
    bound across several processes' /metrics texts, and the sum of the observations."""
    counts: dict[float, float] = {}
    observed_sum = 0.0
    for text in scrapes:
        for family in text_string_to_metric_families(text):
            if family.name != metric:
                continue
            for sample in family.samples:
                if any(sample.labels.get(k) != v for k, v in labels.items()):
                    continue
                if sample.name == f"{metric}_bucket":
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
                elif sample.name == f"{metric}_sum":
                    observed_sum += sample.value
    return sorted(counts.items()), observed_sum


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-quantile (0 to 1) of some samples, interpolated between the two closest
    ranks (numpy's default); None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def paced_payments(
    urls: Sequence[str],
    token: str,
    body: dict[str, Any],
    count: int,
    per_second: float,
    key_prefix: str,
) -> tuple[int, list[str]]:
    """POST `count` payments to `urls` (API processes, in turn) at `per_second`, each
    with a fresh idempotency key, each sent on schedule whether or not the earlier
    ones have been answered (an open loop: a slow answer does not slow the arrivals).
    Returns the answers that were 2xx, and what the others were."""

    async def send_all() -> tuple[int, list[str]]:
        headers = {"Authorization": f"Bearer {token}"}
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=30)
        failures: list[str] = []
        ok = 0
        async with aiohttp.ClientSession(
            headers=headers, connector=connector, timeout=timeout
        ) as session:

            async def send(n: int, at: float) -> None:
                nonlocal ok
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                try:
                    async with session.post(
                        f"{urls[n % len(urls)]}/v1/payments",
                        json=body,
                        headers={"Idempotency-Key": f"{key_prefix}{n}"},
                    ) as answer:
                        await answer.read()
                        if 200 <= answer.status < 300:
                            ok += 1
                        else:
                            failures.append(f"HTTP {answer.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")

            started = time.monotonic()
            await asyncio.gather(*(send(n, started + n / per_second) for n in range(count)))
        return ok, failures

    return asyncio.run(send_all())
