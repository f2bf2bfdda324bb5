"""`python -m intentledger.bench` runs `intentledger bench` before it is registered."""

from __future__ import annotations

import typer

from intentledger.bench.cli import bench_command


def main() -> None:
    typer.run(bench_command)


if __name__ == "__main__":
    main()
