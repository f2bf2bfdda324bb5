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
    for group, deliveries in ((2, "0"), (5, "20")):
        done = run(
            *("--database-url", database_url, "--group", str(group), "--rounds", "2"),
            *("--deliveries", deliveries),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        figures[group] = json.loads(done.stdout.strip().splitlines()[-1])
    for group, measured in figures.items():
        assert measured["group"] == group and measured["rounds"] == 2
        assert [p["endpoints"] for p in measured["passes"]] == ["none", "one", "none", "one"]
        assert all(p["wall_ms_per_group"] > 0 for p in measured["passes"])
        assert all(p["claim_and_presubmit_cpu_ms_per_payment"] > 0 for p in measured["passes"])

    def news(group: int) -> float:
        passes = figures[group]["passes"]
        return float(passes[1]["statements_per_group"] - passes[0]["statements_per_group"])

    # The group record's news: one read of the endpoints is there either way;
    # the announced operations' four reads, and their events and deliveries in
    # one statement (two on SQLite), whatever the group.
    assert news(2) == news(5) == (5 if backend == "postgresql" else 6)
    if backend == "postgresql":
        # The settlement's one statement and the read of the endpoints: the
        # group is planned from its pre-submits' records, with no read.
        assert figures[5]["passes"][0]["statements_per_group"] == 2
    # The sender delivered every event to the stand-in, each with a few statements.
    assert "sender" not in figures[2]
    sender = figures[5]["sender"]
    assert sender["deliveries"] == 20 and sender["deliveries_per_s"] > 0
    assert 0 < sender["sender_statements_per_delivery"] < 10
    assert sender["sender_cpu_ms_per_delivery"] > 0


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (("--group", "0"), "--group must be 1-64"),
        (("--group", "65"), "--group must be 1-64"),
        (("--deliveries", "-1"), "--deliveries must be 0 or more"),
    ],
)
def test_what_it_cannot_measure_is_refused(args: tuple[str, str], refusal: str) -> None:
    done = run("--database-url", "sqlite:///unused.db", *args)
    assert done.returncode == 2
    assert refusal in done.stderr
