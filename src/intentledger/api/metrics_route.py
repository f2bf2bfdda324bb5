"""`GET /metrics`: the process's own metrics, and the ledger's state read at scrape.

Outside /v1, so the edge's bearer check does not apply: Prometheus scrapes it
without a token, as it does every exporter. Nothing in it names an operation, an
actor, a key or a URL (observability/metrics.py), so the answer is safe to
expose to whatever network may reach the API port; restrict it there if even
the volume of payments is not for that network.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from intentledger.observability.ledger_gauges import LedgerCollector, LedgerState, read_ledger_state

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    try:
        reading = await read_ledger_state(request.app.state.engine, request.app.state.clock())
    except (SQLAlchemyError, OSError) as exc:
        # The process's own counters still answer while the database does not.
        log.warning("metrics: the ledger's state could not be read: %s", type(exc).__name__)
        reading = LedgerState(readable=False)
    # A registry per scrape for the ledger's gauges: the counters live in the
    # default one, shared by every app in this process.
    ledger = CollectorRegistry(auto_describe=False)
    ledger.register(LedgerCollector(reading))
    body = generate_latest(REGISTRY) + generate_latest(ledger)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
