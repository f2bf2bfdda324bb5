"""The real OS processes a bench phase runs, and what /proc says about them.

Every process is started from the bench's main thread with a parent-death
signal, logs to a file in the bench's work directory, and is stopped
(SIGTERM, then SIGKILL) when its `Fleet` closes, whatever happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

_PR_SET_PDEATHSIG = 1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _die_with_parent() -> None:
    # If the bench itself is killed, its servers and workers must not linger.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ProcessFailed(RuntimeError):
    pass


class Proc:
    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                list(argv),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Started from the main thread only: the death signal follows the thread.
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise ProcessFailed(
                f"{self.name} exited with {self.popen.returncode}:\n{self.output_tail()}"
            )

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ProcessFailed(f"{self.name}: {url} did not answer 200 within {timeout}s")
            time.sleep(0.1)

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output_tail(1_000_000):
            self.check_alive()
            if time.monotonic() > deadline:
                raise ProcessFailed(f"{self.name} did not print {text!r} within {timeout}s")
            time.sleep(0.05)

    def stop(self, grace: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


class Fleet:
    """The processes of one phase; closing it stops every one of them."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: list[Proc] = []

    def start(self, name: str, module: str, args: Sequence[str], **env: str) -> Proc:
        argv = [sys.executable, "-m", module, *args]
        proc = Proc(name, argv, {**self.env, **env}, self.workdir / f"{name}.log")
        self.procs.append(proc)
        return proc

    def intentledger(self, name: str, args: Sequence[str], **env: str) -> Proc:
        return self.start(name, "intentledger.cli", args, **env)

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.terminate()
        for proc in self.procs:
            proc.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.close()


# -- /proc ------------------------------------------------------------------------------------


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak resident set size so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ProcessFailed(f"no VmHWM for pid {pid}")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After "pid (comm)": state is field 3, so field N is at index N - 3.
    return stat.rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """User plus system CPU time the process has used; with `reaped_children`, plus
    that of every child it has waited for (a postmaster's exited backends)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _CLOCK_TICKS


def on_cpu_seconds(pid: int) -> float:
    """Time the process has run on a core, to the nanosecond (/proc/PID/schedstat):
    `cpu_seconds` counts clock ticks of 10 ms, too coarse for a fraction of a
    millisecond per call over a few thousand calls."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def runqueue_wait_seconds(pid: int) -> float:
    """Time the process was ready to run but waited for a core (/proc/PID/schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _children(pid: int) -> list[tuple[int, bool]]:
    """(pid, is a zombie) of each child of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append((int(entry.name), fields[0] == "Z"))
    return found


def process_tree_cpu_seconds(pid: int, settle: float = 2.0) -> float:
    """CPU time of a process, its live children and the children it has reaped:
    for a postmaster, the whole PostgreSQL server's CPU time.

    An exited child that is not yet reaped shows no CPU time anywhere, so this
    waits (up to `settle` seconds) until no child is a zombie.
    """
    deadline = time.monotonic() + settle
    while True:
        own = cpu_seconds(pid, reaped_children=True)
        children = _children(pid)
        if not any(zombie for _, zombie in children) or time.monotonic() > deadline:
            return own + sum(cpu_seconds(child) for child, _ in children)
        time.sleep(0.02)


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def machine_busy_seconds() -> float:
    """CPU-seconds all cores spent not idle since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / _CLOCK_TICKS
