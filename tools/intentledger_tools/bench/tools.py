"""The external programs the bench drives: pgbench (the baseline) and wrk (the load)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psycopg

from intentledger.store.database import libpq_url


class ToolMissing(RuntimeError):
    pass


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path))


def find_pgbench() -> str:
    """pgbench beside the newest server's initdb, else on PATH."""
    beside = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), key=_version_key)
    found = beside[-1] if beside else shutil.which("pgbench")
    if not found:
        raise ToolMissing(
            "pgbench not found beside initdb (/usr/lib/postgresql/*/bin) or on PATH; "
            "it ships with the PostgreSQL server packages"
        )
    return found


def find_wrk() -> str:
    """wrk on PATH; as root, install Debian's package when it is missing."""
    return shutil.which("wrk") or apt_install("wrk", lambda: shutil.which("wrk"))


def apt_install(package: str, find: Callable[[], str | None]) -> str:
    """Install Debian's `package` (as root only) and return what `find` then finds."""
    if os.geteuid() != 0:
        raise ToolMissing(
            f"{package} is not installed: run `apt-get install -y {package}` as root, then retry"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", package]
    install = subprocess.run(command, env=env, capture_output=True, text=True)
    if install.returncode != 0:
        # The package lists may be missing on a fresh machine.
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        install = subprocess.run(command, env=env, capture_output=True, text=True)
    found = find()
    if install.returncode != 0 or not found:
        raise ToolMissing(f"could not install {package} with apt-get:\n{install.stderr[-2000:]}")
    return found


# -- pgbench ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PgbenchResult:
    tps: float
    transactions: int
    failed: int
    clients: int
    latency_ms: float | None


class PgbenchTimedOut(RuntimeError):
    pass


_TPS = re.compile(r"^tps = ([\d.]+) \(without initial connection time\)", re.M)
_PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
_FAILED = re.compile(r"number of failed transactions: (\d+)")
_LATENCY = re.compile(r"latency average = ([\d.]+) ms")


def run_pgbench(
    pgbench: str,
    url: str,
    script: Path,
    *,
    clients: int,
    threads: int,
    seconds: float | None = None,
    transactions_per_client: int | None = None,
    define: dict[str, str] | None = None,
    timeout: float = 1800,
    protocol: Literal["prepared", "extended"] = "prepared",
) -> PgbenchResult:
    """Run one custom script with prepared statements, as psycopg ends up using
    them (`protocol="extended"`: unnamed statements, as psycopg sends them
    behind a pooler). Past `timeout` seconds pgbench is killed and
    PgbenchTimedOut raised (its server sessions may still be running: the
    caller ends them)."""
    cmd = [pgbench, "-n", "-M", protocol, "-c", str(clients), "-j", str(threads)]
    if seconds is not None:
        cmd += ["-T", str(max(1, round(seconds)))]
    if transactions_per_client is not None:
        cmd += ["-t", str(transactions_per_client)]
    for name, value in (define or {}).items():
        cmd += ["-D", f"{name}={value}"]
    cmd += ["-f", str(script), libpq_url(url)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise PgbenchTimedOut(f"pgbench on {script.name} ran past {timeout:.0f} s") from exc
    tps = _TPS.search(done.stdout)
    if done.returncode != 0 or tps is None:
        raise RuntimeError(
            f"pgbench failed (exit {done.returncode}) on {script.name}:\n"
            f"{done.stderr[-3000:]}\n{done.stdout[-2000:]}"
        )
    processed = _PROCESSED.search(done.stdout)
    failed = _FAILED.search(done.stdout)
    latency = _LATENCY.search(done.stdout)
    return PgbenchResult(
        tps=float(tps.group(1)),
        transactions=int(processed.group(1)) if processed else 0,
        failed=int(failed.group(1)) if failed else 0,
        clients=clients,
        latency_ms=float(latency.group(1)) if latency else None,
    )


def end_pgbench_sessions(url: str, within: float = 60.0) -> None:
    """End the server sessions a killed pgbench left running in this database
    (pgbench names its sessions `pgbench`), and wait until none is left."""
    deadline = time.monotonic() + within
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'pgbench' AND datname = current_database()"
                " AND pid <> pg_backend_pid()"
            ).fetchone()
            if not row or not row[0]:
                return
            time.sleep(0.2)
    raise RuntimeError(f"pgbench's server sessions did not end within {within:.0f} s")


# -- wrk --------------------------------------------------------------------------------------

# Each thread numbers its own requests, so every request carries a fresh key.
WRK_SCRIPT = r"""
local counter = 0
local prefix = "k"
local token = ""
local body = ""
local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("thread_no", thread_count)
end

function init(args)
  prefix = args[1] .. "-" .. tostring(thread_no) .. "-"
  token = args[2]
  body = args[3]
end

function request()
  counter = counter + 1
  local headers = {}
  headers["Authorization"] = "Bearer " .. token
  headers["Content-Type"] = "application/json"
  headers["Idempotency-Key"] = prefix .. counter
  return wrk.format("POST", "/v1/payments", headers, body)
end

function done(summary, latency, requests)
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "status_errors": %d, "connect_errors": %d, '
    .. '"read_errors": %d, "write_errors": %d, "timeouts": %d, "p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, summary.errors.status, summary.errors.connect,
    summary.errors.read, summary.errors.write, summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def start_wrk(
    wrk: str,
    script: Path,
    base_url: str,
    *,
    connections: int,
    seconds: float,
    key_prefix: str,
    token: str,
    body: str,
) -> subprocess.Popen[str]:
    cmd = [
        wrk,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        base_url,
        "--",
        key_prefix,
        token,
        body,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
    )


def wrk_result(proc: subprocess.Popen[str], timeout: float) -> WrkResult:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError("wrk did not finish in time") from None
    line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {proc.returncode}):\n{out[-3000:]}")
    data = json.loads(line.removeprefix("WRKJSON "))
    errors = sum(
        data[k]
        for k in ("status_errors", "connect_errors", "read_errors", "write_errors", "timeouts")
    )
    return WrkResult(
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        errors=errors,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
    )
