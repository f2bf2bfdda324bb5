"""`intentledger bench`: the benchmarks of docs/benchmarks.md, side by side with pgbench and a peer.

The `intentledger.commands` entry point of tools/pyproject.toml registers the command.
"""

from __future__ import annotations

from intentledger_tools.bench.cli import bench_command

__all__ = ["bench_command"]
