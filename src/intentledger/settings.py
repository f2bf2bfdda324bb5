"""Settings (docs/design.md#settings), read from INTENTLEDGER_* variables (each also a CLI flag)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from intentledger.domain.durations import format_duration, parse_duration
from intentledger.domain.reaping import DEFAULT_RECORD_RETENTION
from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW, SHORTEST_REPLAY_WINDOW
from intentledger.domain.retention import DEFAULT_SANDBOX_RETENTION
from intentledger.domain.work_queue import DEFAULT_WAITING_THRESHOLD
from intentledger.providers.http import call_deadline
from intentledger.store.database import Pooler, dialect_of

# Beyond this an answer would sit in memory for no gain: a group fills long before.
MAX_RECORD_WINDOW = timedelta(seconds=1)


def _duration(value: Any) -> Any:
    if isinstance(value, str):
        return parse_duration(value)
    return value


Duration = Annotated[timedelta, BeforeValidator(_duration)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INTENTLEDGER_", extra="ignore")

    database_url: str = "sqlite:///intentledger.db"
    # "pgbouncer": PostgreSQL is reached through a pooler in transaction mode
    # (store/database.py connect_args; docs/scaling.md).
    database_pooler: Pooler = "none"
    provider: str = "sandbox"
    # None: the serving process's own /_sandbox mount.
    provider_url: str | None = None
    submit_timeout: Duration = timedelta(seconds=10)
    # The provider timeout of a write in the request path (beneficiaries, cards):
    # how long a client may be held when the provider's answer is lost. Unset:
    # the submit timeout (10 s unless that is changed).
    sync_timeout: Duration | None = None
    lease: Duration = timedelta(minutes=5)
    recheck_backoff: Duration = timedelta(seconds=30)
    stale_submitting: Duration = timedelta(minutes=2)
    sandbox_key_retention: Duration = DEFAULT_SANDBOX_RETENTION
    # Set: the sandbox signs its webhooks (pm_webhook_late) with it and the
    # serving process verifies them. A test provider's, so also a flag.
    sandbox_webhook_secret: str | None = None
    # Beyond docs/design.md#settings (docs/departures.md): where the sandbox keeps its truth.
    sandbox_database: str = "intentledger-sandbox.db"
    # How many outbox deliveries one worker process runs at once.
    worker_concurrency: int = Field(default=16, ge=1, le=1024)
    # How many due rows the worker's claimer takes at a time (never more than
    # it has free slots): first attempts of a claim are pre-submitted in one
    # transaction, then each runs and is recorded on its own time.
    worker_batch: int = Field(default=8, ge=1, le=1024)
    # How long a provider's answer waits for others to share its record
    # transaction (engine/settlement_queue.py): a known outcome held in memory
    # is one a crash loses, so this stays milliseconds.
    record_window: Duration = timedelta(milliseconds=2)
    # Slow clients (http_server.py, api/edge.py): a request's head must arrive
    # within header_timeout and its body within body_timeout; one API process
    # holds at most max_connections connections and requests at once.
    header_timeout: Duration = timedelta(seconds=10)
    body_timeout: Duration = timedelta(seconds=30)
    max_connections: int = Field(default=1000, ge=1, le=100_000)
    poll_interval: Duration = timedelta(milliseconds=200)
    # How often a worker looks for stale SUBMITTING operations.
    sweep_interval: Duration = timedelta(seconds=15)
    # The Stripe adapter (providers/stripe.py, docs/providers.md). The secret
    # key is read from the environment only: a command line is visible to
    # every user of the machine (`ps`), and the key is never logged or stored.
    stripe_api_key: SecretStr | None = None
    stripe_api_base: str = "https://api.stripe.com"
    # How long Stripe's Search may not yet show a PaymentIntent (documented:
    # usually under a minute): "not found" inside it is inconclusive.
    stripe_search_lag: Duration = timedelta(minutes=1)
    # Verifies Stripe-Signature on /v1/provider-webhooks/stripe; several,
    # comma-separated, while a secret is rotated. Environment only, like the key.
    stripe_webhook_secret: SecretStr | None = None
    # The Adyen adapter (providers/adyen.py, docs/providers.md). The API key is
    # read from the environment only, like Stripe's, and never logged or stored.
    adyen_api_key: SecretStr | None = None
    adyen_merchant_account: str | None = None
    # The Checkout API's base without its version: the adapter adds the one it
    # speaks (/v71). Live: https://<prefix>-checkout-live.adyenpayments.com/checkout.
    adyen_api_base: str = "https://checkout-test.adyen.com"
    # Verifies each notification item's HMAC; several hex keys, comma-separated,
    # while a key is rotated. Environment only, like the API key.
    adyen_hmac_keys: SecretStr | None = None
    # Merchant webhooks (docs/webhooks.md). Private targets (loopback, private
    # networks, plain http) only for development and tests.
    webhook_allow_private: bool = False
    # One delivery attempt's bound: connect, send, and the endpoint's answer.
    webhook_timeout: Duration = timedelta(seconds=10)
    # Attempts in flight at once to one endpoint (across every worker process).
    webhook_in_flight: int = Field(default=4, ge=1, le=100)
    # Attempts in flight at once from one worker process, all endpoints together.
    webhook_concurrency: int = Field(default=16, ge=1, le=1024)
    # A failed attempt is tried again after webhook_retry_first, doubling up to
    # webhook_retry_longest, until webhook_retry_for after the event: then given up.
    webhook_retry_first: Duration = timedelta(seconds=10)
    webhook_retry_longest: Duration = timedelta(hours=6)
    webhook_retry_for: Duration = timedelta(days=3)
    # The operator console's work queue shows an UNKNOWN, RECONCILIATION_DUE or
    # SAFETY_REVIEW operation once it is this old (MANUAL_REVIEW, contradictions
    # and duplicates at once): until then the engine is still working on it.
    operator_queue_after: Duration = DEFAULT_WAITING_THRESHOLD
    # An equal retry replays inside this window from the key's first use; after
    # it the key is refused, 409 key-expired (docs/decisions/0018).
    replay_window: Duration = DEFAULT_REPLAY_WINDOW
    # Settled operations' bulky rows (provider answers, request bodies, done
    # outbox rows) are kept this long, then `reap` removes them (decision 0018).
    record_retention: Duration = DEFAULT_RECORD_RETENTION
    # How often each worker reaps what passed the retention.
    reap_interval: Duration = timedelta(hours=1)
    # Logs (observability/logs.py): `text`, or `json` for one object per line.
    log_format: Literal["text", "json"] = "text"
    # A worker process's own metrics server (prometheus_client's), at this port
    # on metrics_host (every interface unless narrowed); unset: none. `serve`
    # answers GET /metrics itself.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_host: str = "0.0.0.0"
    # Optional TOML file of per-provider safety rules (see safety_config.py).
    safety_rules: str | None = None
    # Clients retry for minutes to hours (restarts, queue redeliveries): a
    # shorter window would refuse ordinary retries as expired keys. A class
    # attribute, not a setting: nothing a deployment sets can lower it.
    shortest_replay_window: ClassVar[timedelta] = SHORTEST_REPLAY_WINDOW

    @property
    def request_path_timeout(self) -> timedelta:
        return self.sync_timeout if self.sync_timeout is not None else self.submit_timeout

    @model_validator(mode="after")
    def _sweeper_behind_every_call(self) -> Settings:
        # A call still running when the sweeper or a resumed delivery calls it
        # UNKNOWN could race a replay: every call must end first.
        # An answer may wait the record window before its commit: the call is
        # not over for the sweeper until then.
        longest_call = (
            call_deadline(max(self.submit_timeout, self.request_path_timeout)) + self.record_window
        )
        if longest_call >= self.stale_submitting:
            raise ValueError(f"stale_submitting must exceed the longest call ({longest_call})")
        if longest_call >= self.lease:
            raise ValueError(f"lease must exceed the longest call ({longest_call})")
        if not timedelta(0) <= self.record_window <= MAX_RECORD_WINDOW:
            longest = format_duration(MAX_RECORD_WINDOW)
            raise ValueError(f"record_window must be from 0 to {longest}")
        if not timedelta(0) < self.webhook_retry_first <= self.webhook_retry_longest:
            raise ValueError("webhook_retry_first must be more than 0 and at most the longest")
        if self.replay_window < self.shortest_replay_window:
            shortest = format_duration(self.shortest_replay_window)
            raise ValueError(f"replay_window must be at least {shortest}")
        if self.record_retention < self.replay_window:
            # A replay answers with the operation as it was accepted: its body
            # must still be there for as long as the key replays.
            raise ValueError("record_retention must be at least the replay_window")
        if self.reap_interval <= timedelta(0):
            raise ValueError("reap_interval must be more than 0")
        if self.database_pooler != "none" and dialect_of(self.database_url) != "postgresql":
            raise ValueError(f"database_pooler {self.database_pooler} needs a PostgreSQL database")
        if not timedelta(0) < self.webhook_timeout <= timedelta(minutes=1):
            raise ValueError("webhook_timeout must be more than 0 and at most 1m")
        return self
