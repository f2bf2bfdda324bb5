"""The bench's Procrastinate peer retries a call whose connection the sandbox
reset, as the DBOS peer does and as a team would (the idempotency key makes it
safe); anything else still fails the job."""

from __future__ import annotations

import httpx
from procrastinate.jobs import Job  # type: ignore[import-not-found,unused-ignore]

from intentledger_tools.bench import peer


def _job(attempts: int) -> Job:
    return Job(
        id=1, queue="default", lock=None, queueing_lock=None, task_name=peer.TASK, attempts=attempts
    )


def test_the_procrastinate_peer_retries_a_reset_connection_a_few_times() -> None:
    # The app never connects: the URL only configures its connector.
    strategy = peer.make_app("postgresql://bench@127.0.0.1:1/bench").tasks[peer.TASK].retry_strategy
    assert strategy is not None
    reset = httpx.ReadError("connection reset by peer")
    # `attempts`: the runs that failed before this one; five runs in all.
    assert strategy.get_retry_decision(exception=reset, job=_job(0)) is not None
    assert strategy.get_retry_decision(exception=reset, job=_job(3)) is not None
    assert strategy.get_retry_decision(exception=reset, job=_job(4)) is None
    assert strategy.get_retry_decision(exception=KeyError("bug"), job=_job(0)) is None
