"""The bench's library floor (bench/library_floor.py, issue 39): its reading of a
pgbench script as pgbench reads it, and real replays and calls by its process
against a real PostgreSQL server and the real provider stand-in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from intentledger.store.database import libpq_url
from intentledger_tools.bench.library_floor import (
    READY,
    Pipeline,
    ScriptError,
    Statement,
    bind,
    parse_script,
    result_of,
    script_batch,
)
from tests.conftest import BACKENDS, Databases
from tests.test_bench_stand_in import running_stand_in

MODULE = "intentledger_tools.bench.library_floor"

# A dispatch-shaped script: a claim handing on two rows as `id_1`/`id_2`, then a
# transaction with a pipeline and the rows marked done.
CLAIM = (
    "WITH claimed AS (UPDATE outbox SET due_at = now() + interval '1 hour' WHERE id IN ("
    "SELECT id FROM outbox WHERE done_at IS NULL AND due_at <= now() ORDER BY due_at, id "
    "LIMIT 2 FOR UPDATE SKIP LOCKED) RETURNING id) "
    "SELECT c.ids[1] AS id_1, c.ids[2] AS id_2 "
    "FROM (SELECT array_agg(id ORDER BY id) AS ids FROM claimed) AS c"
)
NOTE = (
    "INSERT INTO notes (outbox_id, note) "
    "VALUES (:{0}, '100% of ' || :{0}::text || ' at 12:30 :later');"
)
SCRIPT = (
    "\n".join(
        [
            "BEGIN;",
            CLAIM + " \\gset",
            "COMMIT;",
            "BEGIN;",
            "\\startpipeline",
            NOTE.format("id_1"),
            NOTE.format("id_2"),
            "\\endpipeline",
            "UPDATE outbox SET done_at = now() WHERE id IN (:id_1, :id_2);",
            "COMMIT;",
        ]
    )
    + "\n"
)


def test_the_script_reads_as_blocks_with_the_claim_and_the_pipeline() -> None:
    claim, record = parse_script(SCRIPT)
    assert len(claim.steps) == 1
    first = claim.steps[0]
    assert isinstance(first, Statement) and first.gset
    assert first.text.endswith("FROM claimed) AS c")
    pipeline, done = record.steps
    assert isinstance(pipeline, Pipeline) and len(pipeline.statements) == 2
    assert isinstance(done, Statement) and not done.gset
    assert script_batch([claim, record]) == 2


def test_only_known_variables_become_parameters_and_casts_and_percents_survive() -> None:
    text = "SELECT :id_1::text, ':op_1', '50%', :id_1, :unknown, now()::date, x::json"
    query, names = bind(text, {"id_1", "op_1"})
    # A quoted `:op_1` is still a variable to pgbench (the bench's scripts escape
    # such colons); an unknown name and `::casts` stay as written.
    assert query == (
        "SELECT %(id_1)s::text, '%(op_1)s', '50%%', %(id_1)s, :unknown, now()::date, x::json"
    )
    assert names == ("id_1", "op_1")
    # Nothing known yet (the claim itself): the text as it was, but `%`.
    assert bind("SELECT :id_1, '%'", set()) == ("SELECT :id_1, '%%'", ())


@pytest.mark.parametrize(
    ("script", "complaint"),
    [
        ("BEGIN;\n\\set n 1\nCOMMIT;\n", "meta-command \\set"),
        ("SELECT 1;\n", "outside BEGIN"),
        ("BEGIN;\n\\startpipeline\nSELECT 1 \\gset\n\\endpipeline\nCOMMIT;\n", "inside a pipeline"),
        ("BEGIN;\nSELECT 1;\n", "ends inside"),
        ("BEGIN;\n\\endpipeline\nCOMMIT;\n", "without \\startpipeline"),
        ("", "no BEGIN"),
    ],
)
def test_a_script_the_replay_cannot_run_as_pgbench_would_is_refused(
    script: str, complaint: str
) -> None:
    with pytest.raises(ScriptError, match=complaint.replace("\\", "\\\\")):
        parse_script(script)


needs_postgres = pytest.mark.skipif(
    "postgresql" not in BACKENDS, reason="the replay runs on PostgreSQL"
)


def floor_database(databases: Databases, due: int) -> str:
    """A throwaway database whose `outbox` is the script's small one, `due` rows due."""
    url = databases.create("postgresql")
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("DROP TABLE outbox CASCADE")
        conn.execute(
            "CREATE TABLE outbox (id bigserial PRIMARY KEY, due_at timestamptz NOT NULL,"
            " done_at timestamptz)"
        )
        conn.execute("CREATE TABLE notes (outbox_id bigint NOT NULL, note text NOT NULL)")
        conn.execute(
            "INSERT INTO outbox (due_at) SELECT now() - interval '1 minute' "
            "FROM generate_series(1, %s)",
            (due,),
        )
    return url


def run_floor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=120
    )


def replay(
    script: Path, url: str, driver: str = "psycopg", clients: int = 2
) -> subprocess.CompletedProcess[str]:
    return run_floor(
        "sql",
        "--script",
        str(script),
        "--driver",
        driver,
        "--clients",
        str(clients),
        "--database-url",
        url,
    )


@needs_postgres
@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy"])
def test_the_replay_delivers_every_row_through_each_driver(
    databases: Databases, tmp_path: Path, driver: str
) -> None:
    url = floor_database(databases, 40)
    script = tmp_path / "floor.pgbench"
    script.write_text(SCRIPT)
    done = replay(script, url, driver, clients=3)
    assert done.returncode == 0, done.stderr
    result = result_of(done.stdout)
    assert result["payments"] == 40 and result["scripts"] == 20
    assert result["cpu_seconds"] > 0
    with psycopg.connect(libpq_url(url)) as conn:
        left = conn.execute("SELECT count(*) FROM outbox WHERE done_at IS NULL").fetchone()
        notes = conn.execute(
            "SELECT count(DISTINCT outbox_id), bool_and(note = '100% of ' || outbox_id || "
            "' at 12:30 :later'::text) FROM notes"
        ).fetchone()
    assert left == (0,)
    # Every row's note, with its `%`, its literal colons and its cast, as written.
    assert notes == (40, True)


@needs_postgres
@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy"])
def test_a_claim_short_of_rows_gives_them_back_and_they_are_claimed_whole(
    databases: Databases, tmp_path: Path, driver: str
) -> None:
    url = floor_database(databases, 4)
    script = tmp_path / "floor.pgbench"
    script.write_text(SCRIPT)
    with psycopg.connect(libpq_url(url)) as holder:
        # One row locked elsewhere: the claims skip it, so the last one finds one row.
        holder.execute("SELECT id FROM outbox WHERE id = 1 FOR UPDATE")
        replaying = subprocess.Popen(
            [
                *(sys.executable, "-m", MODULE, "sql", "--script", str(script)),
                *("--driver", driver, "--clients", "1", "--database-url", url),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert replaying.poll() is None  # waiting for the row held
    out, err = replaying.communicate(timeout=60)
    assert replaying.returncode == 0, err
    result = result_of(out)
    assert result["payments"] == 4 and result["partial_claims"] >= 1
    with psycopg.connect(libpq_url(url)) as conn:
        notes = conn.execute("SELECT count(DISTINCT outbox_id) FROM notes").fetchone()
    assert notes == (4,)  # row 4, claimed alone at first, was delivered once, whole


@needs_postgres
def test_a_replay_that_leaves_rows_undelivered_fails_loudly(
    databases: Databases, tmp_path: Path
) -> None:
    url = floor_database(databases, 4)
    script = tmp_path / "forgetful.pgbench"
    # The rows are claimed (and so no longer due) but never marked done.
    script.write_text(SCRIPT.replace("UPDATE outbox SET done_at = now()", "SELECT 1 FROM outbox"))
    done = replay(script, url)
    assert done.returncode == 1
    assert "left 4 of 4 outbox rows undelivered" in done.stderr
    assert "Traceback" not in done.stderr


@needs_postgres
def test_a_count_of_rows_the_claims_cannot_take_whole_is_refused(
    databases: Databases, tmp_path: Path
) -> None:
    url = floor_database(databases, 5)
    script = tmp_path / "floor.pgbench"
    script.write_text(SCRIPT)
    done = replay(script, url)
    assert done.returncode == 1
    assert "5 undelivered outbox rows" in done.stderr and "Traceback" not in done.stderr


# The claim also hands on each row's operation (`op_k`), which a worker calls with.
TOGETHER_SCRIPT = SCRIPT.replace(
    "SELECT c.ids[1] AS id_1, c.ids[2] AS id_2 ",
    "SELECT c.ids[1] AS id_1, c.ids[2] AS id_2, "
    "'op_' || c.ids[1] AS op_1, 'op_' || c.ids[2] AS op_2 ",
)


@needs_postgres
@pytest.mark.parametrize("domain", [False, True], ids=["libraries", "with-pure-work"])
def test_the_floor_together_calls_for_every_claimed_row_between_its_transactions(
    databases: Databases, tmp_path: Path, domain: bool
) -> None:
    url = floor_database(databases, 20)
    script = tmp_path / "together.pgbench"
    script.write_text(TOGETHER_SCRIPT)
    with running_stand_in(tmp_path) as provider:
        done = run_floor(
            *("together", "--script", str(script), "--clients", "2", "--url", provider),
            *("--concurrency", "3", "--warmup", "5", "--database-url", url),
            *(["--domain"] if domain else []),
        )
        assert done.returncode == 0, done.stderr
        result = result_of(done.stdout)
        assert result["mode"] == "together" and result["payments"] == 20
        # With --domain each claim's pure work settled every one of its payments,
        # its own CPU timed (and in the process's).
        assert result["domain"] is domain
        if domain:
            assert 0 < result["domain_cpu_seconds"] < result["cpu_seconds"]
        else:
            assert "domain_cpu_seconds" not in result
        assert result["cpu_seconds"] > 0
        # The warm-up's calls and one for each claimed row, by its operation.
        assert httpx.get(f"{provider}/stand-in/calls").json()["calls"] == 25
        for row in (1, 20):
            found = httpx.get(f"{provider}/v1/charges", params={"reference": f"op_{row}"})
            assert len(found.json()["data"]) == 1, found.text
    with psycopg.connect(libpq_url(url)) as conn:
        left = conn.execute("SELECT count(*) FROM outbox WHERE done_at IS NULL").fetchone()
        notes = conn.execute("SELECT count(DISTINCT outbox_id) FROM notes").fetchone()
    assert left == (0,) and notes == (20,)


@needs_postgres
def test_the_floor_together_refuses_a_claim_that_names_no_operations(
    databases: Databases, tmp_path: Path
) -> None:
    url = floor_database(databases, 4)
    script = tmp_path / "floor.pgbench"
    script.write_text(SCRIPT)
    with running_stand_in(tmp_path) as provider:
        done = run_floor(
            *("together", "--script", str(script), "--clients", "1", "--url", provider),
            *("--concurrency", "2", "--warmup", "0", "--database-url", url),
        )
    assert done.returncode == 1
    assert "must hand on op_1..op_2" in done.stderr and "Traceback" not in done.stderr


def test_the_http_floor_makes_its_calls_when_signalled_and_stays_to_be_watched(
    tmp_path: Path,
) -> None:
    with running_stand_in(tmp_path) as url:
        log = tmp_path / "floor.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", MODULE, "--signalled", "http", "--url", url),
                    *("--calls", "200", "--concurrency", "8", "--warmup", "20"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(log, READY, proc)
            assert "library_floor {" not in log.read_text()  # nothing measured before the signal
            os.kill(proc.pid, signal.SIGUSR1)
            wait_for(log, "library_floor {", proc)
            time.sleep(0.2)
            assert proc.poll() is None  # still there for its CPU to be read
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        result = result_of(log.read_text())
        assert result["calls"] == 200 and result["concurrency"] == 8
        assert result["cpu_seconds"] > 0
        # The warm-up's calls and the measured ones, each answered.
        assert httpx.get(f"{url}/stand-in/calls").json()["calls"] == 220


def wait_for(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no {text!r} in {log.read_text()!r}"
        time.sleep(0.05)
