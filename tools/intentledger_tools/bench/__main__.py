"""`python -m intentledger_tools.bench`: `intentledger bench` without the `intentledger` command."""

from __future__ import annotations

import typer

from intentledger_tools.bench.cli import bench_command


def main() -> None:
    typer.run(bench_command)


if __name__ == "__main__":
    main()
