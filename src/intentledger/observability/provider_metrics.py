"""The Provider port, timed: every adapter's calls pass through `InstrumentedProvider`
(the composition root's service.instrumented_provider wraps what a plug-in
builds), so no adapter or engine module keeps a timer of its own."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Histogram

from intentledger.domain.transport import LookupAnswer, ProviderAnswer, classify, judge_lookup
from intentledger.observability.metrics import CLASSIFICATIONS, LOOKUPS, PROVIDER_CALL_SECONDS
from intentledger.providers.base import Provider, ProviderLookup, ProviderRequest


class InstrumentedProvider:
    """A Provider that records each call's latency and what its answer showed."""

    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.name = inner.name
        # Each submit's two series, found once per label set: `labels()` checks
        # and looks them up anew, a dozen Python calls on every payment.
        self._submit_series: dict[tuple[str, str, str], tuple[Histogram, Counter]] = {}

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        started = time.perf_counter()
        answer = await self.inner.submit(request)
        elapsed = time.perf_counter() - started
        # The same classification the dispatcher records (classify is pure).
        verdict = classify(answer).verdict
        labels = (request.kind, answer.transport, verdict)
        series = self._submit_series.get(labels)
        if series is None:
            series = self._submit_series[labels] = (
                PROVIDER_CALL_SECONDS.labels(self.name, "submit", request.kind, verdict),
                CLASSIFICATIONS.labels(self.name, request.kind, answer.transport, verdict),
            )
        seconds, classified = series
        seconds.observe(elapsed)
        classified.inc()
        return answer

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        started = time.perf_counter()
        answer = await self.inner.lookup(query)
        elapsed = time.perf_counter() - started
        # Without the last attempt's time: what the lookup showed, before any
        # allowance for its lag (the reconciler's judgement adds that).
        verdict = judge_lookup(answer).verdict
        PROVIDER_CALL_SECONDS.labels(self.name, "lookup", query.kind, verdict).observe(elapsed)
        LOOKUPS.labels(self.name, query.kind, verdict).inc()
        return answer

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        # Anything else an adapter offers (its settings, its clients) is its own.
        return getattr(self.inner, name)
