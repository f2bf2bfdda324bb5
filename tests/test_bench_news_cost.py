"""The news-cost measurement (bench/news_cost.py, issue 39) runs the real group
record on a fresh database of each backend and reports what a listening
endpoint adds, and refuses a group larger than a group record takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MODULE = "intentledger_tools.bench.news_cost"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=300
    )


def test_it_measures_both_merchants_twice_and_the_news_costs_a_fixed_few_statements(
    database_url: str, backend: str
) -> None:
    figures = {}
    for group in (2, 5):
        done = run("--database-url", database_url, "--group", str(group), "--rounds", "2")
        assert done.returncode == 0, done.stderr[-3000:]
        figures[group] = json.loads(done.stdout.strip().splitlines()[-1])
    for group, measured in figures.items():
        assert measured["group"] == group and measured["rounds"] == 2
        assert [p["endpoints"] for p in measured["passes"]] == ["none", "one", "none", "one"]
        assert all(p["wall_ms_per_group"] > 0 for p in measured["passes"])

    def news(group: int) -> float:
        passes = figures[group]["passes"]
        return float(passes[1]["statements_per_group"] - passes[0]["statements_per_group"])

    # The group record's news: one read of the endpoints is there either way;
    # the announced operations' four reads, and their events and deliveries in
    # one statement (two on SQLite), whatever the group.
    assert news(2) == news(5) == (5 if backend == "postgresql" else 6)
    if backend == "postgresql":
        assert figures[5]["passes"][0]["statements_per_group"] == 3


@pytest.mark.parametrize("group", ["0", "65"])
def test_a_group_no_group_record_takes_is_refused(group: str) -> None:
    done = run("--database-url", "sqlite:///unused.db", "--group", group)
    assert done.returncode == 2
    assert "--group must be 1-64" in done.stderr
