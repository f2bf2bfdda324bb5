"""How long an Idempotency-Key replays (docs/decisions/0018).

Inside the window an equal retry gets the original answer. After it the key is
refused whatever the body: a retry that late is a client's bug or a replayed
message, and neither a months-old answer nor a second payment is the right
reply to it. The key's record is kept, so the refusal lasts for ever.
"""

from __future__ import annotations

from datetime import datetime, timedelta

DEFAULT_REPLAY_WINDOW = timedelta(days=30)
SHORTEST_REPLAY_WINDOW = timedelta(hours=1)


def replay_window_passed(first_used_at: datetime, now: datetime, window: timedelta) -> bool:
    """The key was first used longer ago than the window: it replays no more."""
    return now - first_used_at > window
