"""What a database error says about the database, for the entry points.

The API and the console read through the engine, never the store
(docs/architecture.md); how a failed statement is told apart from a lost
connection (a restart, a failover, a node that came back as a standby) is
the store's to know, since its engines count the same SQLSTATEs as
disconnects. This is where the entry points ask it.
"""

from __future__ import annotations

from intentledger.store.database import lost_connection

__all__ = ["lost_connection"]
