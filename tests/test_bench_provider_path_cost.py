"""What our provider path costs a call beyond aiohttp's (bench/provider_path_cost.py,
issue 39): both paths measured against a real stand-in, alternated, and a path
whose answers are not successes fails the run instead of measuring nothing."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys

import pytest

from intentledger.ports import free_port
from intentledger_tools.bench import provider_path_cost
from intentledger_tools.bench.stand_in import until_answering

MODULE = "intentledger_tools.bench.provider_path_cost"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=300
    )


def test_both_paths_are_measured_in_turn_and_compared_by_their_medians() -> None:
    done = run("--calls", "300", "--concurrency", "8", "--passes", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert (figures["calls"], figures["concurrency"], figures["passes"]) == (300, 8, 3)
    floor, ours = figures["floor_cpu_ms_per_call"], figures["ours_cpu_ms_per_call"]
    assert len(floor) == len(ours) == 3
    assert all(ms > 0 for ms in floor + ours)
    assert figures["floor_median_ms"] == statistics.median(floor)
    assert figures["ours_median_ms"] == statistics.median(ours)
    assert figures["ours_over_floor_ms"] == pytest.approx(
        statistics.median(ours) - statistics.median(floor), abs=1e-4
    )
    # Each pass said what it measured as it went.
    assert done.stdout.count("through our provider") == 3


def test_answers_that_are_not_successes_fail_the_run() -> None:
    async def through_a_wrong_path() -> None:
        port = free_port()
        stand_in = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "intentledger_tools.bench.stand_in", "--port", str(port)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await until_answering(port)
            # Not the sandbox's mount: the stand-in answers 404, no charge made.
            await provider_path_cost.through_our_provider(
                f"http://127.0.0.1:{port}/elsewhere", 10, 2, 0
            )
        finally:
            stand_in.kill()
            await stand_in.wait()

    with pytest.raises(RuntimeError, match="not a success"):
        asyncio.run(through_a_wrong_path())


@pytest.mark.parametrize("flag", ["--calls", "--concurrency", "--passes"])
def test_a_count_below_one_is_refused(flag: str) -> None:
    done = run(flag, "0")
    assert done.returncode == 2
    assert "must be at least 1" in done.stderr
