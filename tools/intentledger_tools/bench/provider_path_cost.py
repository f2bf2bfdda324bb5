"""What our provider path costs a call beyond aiohttp's own (issue 39).

python -m intentledger_tools.bench.provider_path_cost [--calls 20000] [--concurrency 128]
                                                     [--passes 3]

The libraries' floor (bench/library_floor.py) counts aiohttp's CPU for a
charge call to the bench's stand-in with none of our code. A worker's call
goes through more: the provider as `intentledger worker` builds it
(`service.instrumented_provider` over the sandbox adapter), that is the
call's metrics, the adapter's request and its reading of the answer,
`observe`'s deadline, our client's whole read, the body's parse and its
redaction. This runs both against one stand-in (a process of its own,
answering at once), in one process, alternated `--passes` times: the
floor's calls (`library_floor`'s own, its session built as our client's)
and the same calls through our provider, `--calls` of each a pass from
`--concurrency` callers, after a warm-up. CPU per call is the process's
(`time.process_time()`) over the measured calls.

Every answer through our provider must be a 200 that the adapter maps as a
success, or the run fails: a path that stopped calling would otherwise
measure nothing. The last line is the figures as one JSON object: each
pass's CPU per call, the medians of both and their difference
(`ours_over_floor_ms`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from intentledger import eventloop
from intentledger.domain.transport import Verdict, classify
from intentledger.ports import free_port
from intentledger.providers.base import ProviderRequest
from intentledger.service import SANDBOX_MOUNT, instrumented_provider
from intentledger.settings import Settings
from intentledger_tools.bench.library_floor import CHARGE_BODY, http_floor
from intentledger_tools.bench.stand_in import until_answering

WARMUP_CALLS = 300


async def through_our_provider(url: str, calls: int, concurrency: int, first: int) -> float:
    """CPU seconds for `calls` charges through our provider, after a warm-up."""
    settings = Settings(provider="sandbox", provider_url=url, worker_concurrency=concurrency)
    provider = instrumented_provider(settings, None)

    async def run(numbers: range) -> None:
        pending = iter(numbers)

        async def caller() -> None:
            for number in pending:
                reference = f"op_path_{number}"
                answer = await provider.submit(
                    ProviderRequest("payment", reference, f"{reference}:1", dict(CHARGE_BODY))
                )
                if answer.status != 200 or classify(answer).verdict is not Verdict.SUCCEEDED:
                    raise RuntimeError(f"the stand-in's answer was not a success: {answer}")

        await asyncio.gather(*(caller() for _ in range(concurrency)))

    try:
        await run(range(first, first + WARMUP_CALLS))
        cpu = time.process_time()
        await run(range(first + WARMUP_CALLS, first + WARMUP_CALLS + calls))
        return time.process_time() - cpu
    finally:
        await provider.aclose()


async def measure(calls: int, concurrency: int, passes: int) -> dict[str, Any]:
    port = free_port()
    stand_in = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "intentledger_tools.bench.stand_in", "--port", str(port)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}{SANDBOX_MOUNT}"
    floor_ms: list[float] = []
    ours_ms: list[float] = []
    try:
        await until_answering(port)
        for number in range(passes):
            floor = await http_floor(
                argparse.Namespace(
                    url=url,
                    calls=calls,
                    concurrency=concurrency,
                    warmup=WARMUP_CALLS,
                    signalled=False,
                )
            )
            floor_ms.append(round(floor["cpu_seconds"] / calls * 1000, 4))
            # Each pass's references are new: the stand-in answers a key it
            # has seen from its memory, a path the floor never takes.
            first = number * (calls + WARMUP_CALLS)
            ours_ms.append(
                round(await through_our_provider(url, calls, concurrency, first) / calls * 1000, 4)
            )
            print(
                f"pass {number + 1}: aiohttp's floor {floor_ms[-1]} ms of CPU a call, "
                f"through our provider {ours_ms[-1]} ms",
                flush=True,
            )
    finally:
        stand_in.kill()
        await stand_in.wait()
    floor_median, ours_median = statistics.median(floor_ms), statistics.median(ours_ms)
    return {
        "calls": calls,
        "concurrency": concurrency,
        "passes": passes,
        "floor_cpu_ms_per_call": floor_ms,
        "ours_cpu_ms_per_call": ours_ms,
        "floor_median_ms": floor_median,
        "ours_median_ms": ours_median,
        "ours_over_floor_ms": round(ours_median - floor_median, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m intentledger_tools.bench.provider_path_cost",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--calls", type=int, default=20_000, help="measured calls a pass")
    parser.add_argument("--concurrency", type=int, default=128, help="callers at once")
    parser.add_argument("--passes", type=int, default=3, help="passes of each, alternated")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.concurrency < 1 or args.passes < 1:
        parser.error("--calls, --concurrency and --passes must be at least 1")
    figures = eventloop.run(measure(args.calls, args.concurrency, args.passes))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
