"""Finding the adapter named by INTENTLEDGER_PROVIDER.

Adapters are plug-ins: each is a `ProviderPlugin` published under the
entry-point group `intentledger.providers` (this package publishes `sandbox`
and `stripe` in pyproject.toml), so a third party adds one by installing a
package, without forking this one. A plug-in declares what the ledger must know
before it sends anything: the operation kinds it carries, the provider's
documented key retention (weighed by the safety review), its lookup's
consistency, and what its configuration requires.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import entry_points

from intentledger.domain.retention import RetentionPolicy, policy_for_provider
from intentledger.observability.provider_metrics import InstrumentedProvider
from intentledger.providers.base import KINDS, LookupConsistency, Provider, WebhookReader
from intentledger.settings import Settings

ENTRY_POINT_GROUP = "intentledger.providers"
DEFAULT_CONNECTIONS = 200


class ProviderNotConfigured(ValueError):
    pass


@dataclass(frozen=True)
class BuildArguments:
    """What the service hands an adapter's factory."""

    settings: Settings
    # Where the provider answers when no URL is configured (the serving
    # process's own /_sandbox mount), if anywhere.
    default_url: str | None
    timeout: timedelta
    max_connections: int


@dataclass(frozen=True)
class ProviderPlugin:
    name: str
    summary: str
    kinds: frozenset[str]
    retention: Callable[[Settings], RetentionPolicy]
    consistency: Callable[[Settings], LookupConsistency]
    build: Callable[[BuildArguments], Provider]
    # What is wrong with the settings for this adapter (empty: nothing).
    problems: Callable[[Settings], list[str]] = lambda _settings: []
    # How its webhooks are verified and read (None: it sends none we take).
    webhooks: Callable[[Settings], WebhookReader | None] = lambda _settings: None

    def __post_init__(self) -> None:
        unknown = self.kinds - set(KINDS)
        if unknown:
            raise ValueError(f"provider {self.name!r} declares unknown kinds {sorted(unknown)}")


@functools.cache
def plugins() -> dict[str, ProviderPlugin]:
    """Every installed adapter, by name (loaded once per process)."""
    found: dict[str, ProviderPlugin] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        plugin = entry.load()
        if not isinstance(plugin, ProviderPlugin):
            raise TypeError(f"entry point {entry.value} is not a ProviderPlugin")
        if plugin.name != entry.name:
            raise ValueError(f"entry point {entry.name!r} publishes provider {plugin.name!r}")
        found[plugin.name] = plugin
    return dict(sorted(found.items()))


def plugin_for(name: str) -> ProviderPlugin:
    available = plugins()
    if name not in available:
        listed = ", ".join(available) or "none installed"
        raise ProviderNotConfigured(f"unknown provider {name!r}; available: {listed}")
    return available[name]


def check_provider(settings: Settings) -> ProviderPlugin:
    """The configured adapter, or a refusal naming every problem (start-up)."""
    plugin = plugin_for(settings.provider)
    problems = plugin.problems(settings)
    if problems:
        raise ProviderNotConfigured(f"provider {plugin.name}: " + "; ".join(problems))
    return plugin


def build_provider(
    settings: Settings, default_url: str | None = None, timeout: timedelta | None = None
) -> Provider:
    """The configured adapter; `timeout` overrides the submit timeout (the
    request path's synchronous writes use INTENTLEDGER_SYNC_TIMEOUT)."""
    plugin = check_provider(settings)
    # Enough connections for every delivery in flight: a call queued for a
    # connection would spend its deadline waiting and end as "no response".
    connections = max(DEFAULT_CONNECTIONS, settings.worker_concurrency)
    adapter = plugin.build(
        BuildArguments(settings, default_url, timeout or settings.submit_timeout, connections)
    )
    # Every call timed and counted in one place (observability/provider_metrics.py).
    return InstrumentedProvider(adapter)


def retention_policy_for(settings: Settings) -> Callable[[str], RetentionPolicy]:
    """The key-retention policy of each provider an operation may name: the
    installed adapter's declaration, else the documented registry's entry."""

    def policy_for(provider: str) -> RetentionPolicy:
        plugin = plugins().get(provider)
        if plugin is not None:
            return plugin.retention(settings)
        return policy_for_provider(provider, settings.sandbox_key_retention)

    return policy_for
