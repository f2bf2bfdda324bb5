"""Finding the adapter named by INTENTLEDGER_PROVIDER.

Adapters are plug-ins: each is a `ProviderPlugin` published under the
entry-point group `intentledger.providers` (this package publishes `sandbox`,
`stripe` and `adyen` in pyproject.toml), so a third party adds one by installing a
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

from pydantic import SecretStr

from intentledger.domain.retention import RetentionPolicy, policy_for_provider
from intentledger.providers.base import (
    KINDS,
    LookupConsistency,
    Provider,
    Webhooks,
)

ENTRY_POINT_GROUP = "intentledger.providers"
DEFAULT_CONNECTIONS = 200


class ProviderNotConfigured(ValueError):
    pass


@dataclass(frozen=True)
class ProviderConfig:
    """The configuration adapters read: plain values the composition root
    (service.provider_config) copies from the service's settings, so no adapter
    depends on how the service is configured."""

    provider: str
    provider_url: str | None
    submit_timeout: timedelta
    worker_concurrency: int
    sandbox_key_retention: timedelta
    sandbox_webhook_secret: str | None
    stripe_api_key: SecretStr | None
    stripe_api_base: str
    stripe_search_lag: timedelta
    stripe_webhook_secret: SecretStr | None
    adyen_api_key: SecretStr | None = None
    adyen_merchant_account: str | None = None
    adyen_api_base: str = "https://checkout-test.adyen.com"
    # Comma-separated hex keys (several while rotating), for the notification reader.
    adyen_hmac_keys: SecretStr | None = None


@dataclass(frozen=True)
class BuildArguments:
    """What the service hands an adapter's factory."""

    config: ProviderConfig
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
    retention: Callable[[ProviderConfig], RetentionPolicy]
    consistency: Callable[[ProviderConfig], LookupConsistency]
    build: Callable[[BuildArguments], Provider]
    # What is wrong with the configuration for this adapter (empty: nothing).
    problems: Callable[[ProviderConfig], list[str]] = lambda _config: []
    # How its webhooks are verified and read (None: it sends none we take).
    webhooks: Callable[[ProviderConfig], Webhooks | None] = lambda _config: None

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


def check_provider(config: ProviderConfig) -> ProviderPlugin:
    """The configured adapter, or a refusal naming every problem (start-up)."""
    plugin = plugin_for(config.provider)
    problems = plugin.problems(config)
    if problems:
        raise ProviderNotConfigured(f"provider {plugin.name}: " + "; ".join(problems))
    return plugin


def build_provider(
    config: ProviderConfig, default_url: str | None = None, timeout: timedelta | None = None
) -> Provider:
    """The configured adapter; `timeout` overrides the submit timeout (the
    request path's synchronous writes use INTENTLEDGER_SYNC_TIMEOUT)."""
    plugin = check_provider(config)
    # Enough connections for every delivery in flight: a call queued for a
    # connection would spend its deadline waiting and end as "no response".
    connections = max(DEFAULT_CONNECTIONS, config.worker_concurrency)
    return plugin.build(
        BuildArguments(config, default_url, timeout or config.submit_timeout, connections)
    )


def retention_policy_for(config: ProviderConfig) -> Callable[[str], RetentionPolicy]:
    """The key-retention policy of each provider an operation may name: the
    installed adapter's declaration, else the documented registry's entry."""

    def policy_for(provider: str) -> RetentionPolicy:
        plugin = plugins().get(provider)
        if plugin is not None:
            return plugin.retention(config)
        return policy_for_provider(provider, config.sandbox_key_retention)

    return policy_for
