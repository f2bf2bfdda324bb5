"""The sandbox payment provider: a real HTTP server with fault scenarios chosen by
`payment_method`, keeping its own truth of executed charges in a SQLite file."""

from intentledger.providers.sandbox.app import create_sandbox_app

__all__ = ["create_sandbox_app"]
