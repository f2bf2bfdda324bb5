"""intentledger's workshop: the benchmarks (bench/), the fault harness (chaos.py,
blind_retry.py) and the demo (demo.py). Installed only by the dev and bench
setups, never part of the service's wheel."""
