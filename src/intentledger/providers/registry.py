"""Choosing the provider adapter named by INTENTLEDGER_PROVIDER."""

from __future__ import annotations

from datetime import timedelta

from intentledger.providers.base import Provider
from intentledger.providers.sandbox_client import SandboxProvider
from intentledger.settings import Settings

KNOWN_PROVIDERS = ("sandbox",)
DEFAULT_CONNECTIONS = 200


class ProviderNotConfigured(ValueError):
    pass


def build_provider(
    settings: Settings, default_url: str | None = None, timeout: timedelta | None = None
) -> Provider:
    """The configured adapter; `timeout` overrides the submit timeout (the
    request path's synchronous writes use INTENTLEDGER_SYNC_TIMEOUT)."""
    if settings.provider != "sandbox":
        raise ProviderNotConfigured(
            f"unknown provider {settings.provider!r}; available: {', '.join(KNOWN_PROVIDERS)}"
        )
    url = settings.provider_url or default_url
    if url is None:
        raise ProviderNotConfigured(
            "INTENTLEDGER_PROVIDER_URL is required when no sandbox runs in this process"
        )
    # Enough connections for every delivery in flight: a call queued for a
    # connection would spend its deadline waiting and end as "no response".
    connections = max(DEFAULT_CONNECTIONS, settings.worker_concurrency)
    return SandboxProvider(url, timeout or settings.submit_timeout, max_connections=connections)
