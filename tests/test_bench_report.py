"""The bench judges its goals only on a durable server (issue 18): no PostgreSQL needed."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from intentledger_tools.bench.report import GOALS, table, with_goals
from intentledger_tools.bench.runner import drain_end


def figures(fsync: str = "on", synchronous_commit: str = "on") -> dict[str, Any]:
    # Every goal's figure far on the good side of its bound.
    met = {g.key: g.bound * 10 if g.at_least else g.bound / 10 for g in GOALS}
    return {
        **met,
        "quick": False,
        "nproc": 2,
        "postgresql_fsync": fsync,
        "postgresql_synchronous_commit": synchronous_commit,
    }


def test_a_durable_server_has_its_goals_judged() -> None:
    judged = with_goals(figures())
    assert judged["server_durable"] is True
    assert judged["goals_judged"] is True
    assert all(v["met"] is True for v in judged["goals"].values())
    assert all("durable_server" not in v for v in judged["goals"].values())


@pytest.mark.parametrize(
    ("fsync", "commit", "named"),
    [
        ("off", "on", "fsync=off"),
        ("on", "off", "synchronous_commit=off"),
        ("off", "off", "fsync=off, synchronous_commit=off"),
        ("?", "on", "fsync=?"),
    ],
)
def test_a_fast_server_has_its_goals_not_judged(fsync: str, commit: str, named: str) -> None:
    judged = with_goals(figures(fsync, commit))
    assert judged["server_durable"] is False
    assert judged["goals_judged"] is False
    assert judged["goals_note"].startswith("not judged")
    assert named in judged["goals_note"]
    assert all(v["met"] is None for v in judged["goals"].values())
    rendered = table(judged)
    assert rendered.caption is not None and named in str(rendered.caption)


def test_allow_fast_server_judges_but_marks_the_verdicts() -> None:
    judged = with_goals(figures("off"), allow_fast_server=True)
    assert judged["goals_judged"] is True
    assert "NON-DURABLE" in judged["goals_note"]
    for verdict in judged["goals"].values():
        assert verdict["met"] is True
        assert verdict["durable_server"] is False


def test_local_synchronous_commit_still_flushes_on_one_server() -> None:
    assert with_goals(figures("on", "local"))["goals_judged"] is True


def test_issue_18_goals() -> None:
    bounds = {g.key: (g.at_least, g.bound) for g in GOALS}
    assert bounds["intake_ratio"] == (True, 1.0)
    assert bounds["dispatch_ratio"] == (True, 1.0)
    assert bounds["latency_bound_per_s"] == (True, 1000)
    assert bounds["peer_ratio"] == (True, 3)
    assert bounds["growth_scan_ratio"] == (False, 1.3)
    assert bounds["pooler_ratio"] == (True, 0.9)
    # Within 1.3x of the empty ledger: a rate at least 1/1.3 of its.
    growth = next(g for g in GOALS if g.key == "growth_intake_ratio")
    assert growth.met(0.8) is True
    assert growth.met(0.75) is False


def test_issue_39_goals() -> None:
    bounds = {g.key: (g.at_least, g.bound) for g in GOALS}
    assert bounds["stand_in_cpu_ms_per_call"] == (False, 0.1)
    judged = with_goals({**figures(), "stand_in_cpu_ms_per_call": 0.12})
    assert judged["goals"]["stand_in_cpu_ms_per_call"]["met"] is False


def test_an_unmeasured_pooler_is_not_judged() -> None:
    judged = with_goals({**figures(), "pooler_ratio": None})
    assert judged["goals_judged"] is True
    assert judged["goals"]["pooler_ratio"]["met"] is None
    assert judged["goals"]["intake_ratio"]["met"] is True


def test_a_drain_ends_at_its_last_row_done_not_at_the_poll_that_saw_it() -> None:
    # Seeded at 100.0, the last row done at 104.87, the poll saw nothing left at 105.0.
    assert drain_end(100.0, 104.87, 105.0) == 104.87
    # Within the 50 ms allowed to two processes' clocks.
    assert drain_end(100.0, 105.04, 105.0) == 105.04


@pytest.mark.parametrize(
    "last_done",
    [0.0, 99.9, 100.0, 105.2],  # none recorded, before or at the seed, after the poll
)
def test_a_drain_end_the_clocks_cannot_place_falls_back_to_the_poll(last_done: float) -> None:
    assert drain_end(100.0, last_done, 105.0) == 105.0


def test_a_figure_just_under_its_bound_is_not_met_however_it_reads() -> None:
    # 5,531.2 through PgBouncer over 6,149.0 direct: 0.89953, which three decimals
    # would have made 0.9 (and, before, a met goal).
    judged = with_goals({**figures(), "pooler_ratio": 5531.2 / 6149.0})
    assert judged["goals"]["pooler_ratio"]["met"] is False
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table(judged))
    pooler = next(line for line in console.export_text().splitlines() if "PgBouncer" in line)
    assert "0.8995" in pooler and "not met" in pooler
