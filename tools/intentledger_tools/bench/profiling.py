"""Optional py-spy sampling of one API process and one worker during the measured runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def start(pid: int, out: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    """Record collapsed stacks (speedscope and flamegraph.pl read them) for `seconds`."""
    py_spy = find_py_spy()
    if py_spy is None:
        print("bench: --profile given but py-spy is not installed; skipping", file=sys.stderr)
        return None
    cmd = [
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(seconds))),
        "--format",
        "raw",
        "--nonblocking",
        # Four times py-spy's default: a phase's measured seconds at 100 a second
        # gave about a hundred samples of a worker, too few to rank its pieces.
        "--rate",
        "400",
        # Only samples of a thread holding the GIL: where the CPU goes. Wall time
        # would also count a process waiting for one of the shared cores.
        "--gil",
        "-o",
        str(out),
    ]
    log = out.with_suffix(".log").open("wb")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def finish(proc: subprocess.Popen[bytes] | None, out: Path, top: int = 40) -> None:
    """Wait for py-spy, then write OUT.summary.txt: the top functions by self and total time."""
    if proc is None:
        return
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not out.exists():
        return
    out.with_suffix(".summary.txt").write_text(summarise(out.read_text(), top))


def _parts(frame: str) -> tuple[str, str]:
    """'name (pkg/mod.py:123)' -> ('name (mod.py)', 'pkg')."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0].rstrip(")")
    package = path.split("/", 1)[0] if "/" in path else path
    file = path.rsplit("/", 1)[-1]
    return (f"{name} ({file})" if file else name), package


def summarise(collapsed: str, top: int = 40) -> str:
    """Self time by function and by package, and total time of intentledger's functions."""
    own: Counter[str] = Counter()
    own_package: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        samples += count
        leaf, package = _parts(frames[-1])
        own[leaf] += count
        own_package[package] += count
        for name in {_parts(f)[0] for f in frames if "(intentledger/" in f}:
            ours[name] += count
    if not samples:
        return "no samples\n"

    def block(title: str, counter: Counter[str], n: int) -> list[str]:
        rows = [f"  {100 * k / samples:5.1f}%  {name}" for name, k in counter.most_common(n)]
        return ["", title, *rows]

    lines = [f"{samples} samples of a thread holding the GIL (py-spy --gil: Python CPU time)"]
    lines += block("self time by package:", own_package, 15)
    lines += block("self time by function:", own, top)
    lines += block("total time of intentledger functions:", ours, 25)
    return "\n".join(lines) + "\n"
