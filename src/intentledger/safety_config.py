"""Safety rules per provider, from an optional TOML file (INTENTLEDGER_SAFETY_RULES).

[default]                      # every provider
margin = 0.10                  # replays stop 10 % short of the retention minimum
max_checks = 10                # lookups before a person decides
max_age = "7d"                 # or this long unresolved

[provider.sandbox]             # overrides for one provider
allow_new_request = true       # a deliberate new-key request after not-found lookups
new_request_min_not_found = 3
new_request_min_spread = "1h"
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from intentledger.domain.durations import parse_duration
from intentledger.domain.safety import SafetyRules

_FIELDS = {f.name: f for f in fields(SafetyRules)}


class SafetyConfigError(ValueError):
    pass


def _rules(base: SafetyRules, table: Mapping[str, Any], where: str) -> SafetyRules:
    changes: dict[str, Any] = {}
    for name, value in table.items():
        if name not in _FIELDS:
            raise SafetyConfigError(
                f"{where}: unknown setting {name!r}; known: {', '.join(_FIELDS)}"
            )
        current = getattr(base, name)
        if isinstance(current, timedelta):
            value = parse_duration(str(value))
        elif isinstance(current, bool) and not isinstance(value, bool):
            raise SafetyConfigError(f"{where}.{name} must be true or false")
        elif isinstance(current, int | float) and not isinstance(value, int | float):
            raise SafetyConfigError(f"{where}.{name} must be a number")
        changes[name] = value
    rules = replace(base, **changes)
    # A margin of 0 would replay up to the very instant the provider may prune
    # the key, with no room for a backlog or a clock that runs behind.
    if not 0 < rules.margin < 1:
        raise SafetyConfigError(f"{where}.margin must be more than 0 and less than 1")
    return rules


def load_safety_rules(path: str | None) -> Callable[[str], SafetyRules]:
    """Return provider name -> rules; the built-in defaults when `path` is None."""
    if path is None:
        return lambda _provider: SafetyRules()
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SafetyConfigError(f"cannot read safety rules {path}: {exc}") from exc
    default = _rules(SafetyRules(), document.get("default", {}), "default")
    per_provider = {
        name: _rules(default, table, f"provider.{name}")
        for name, table in document.get("provider", {}).items()
    }
    return lambda provider: per_provider.get(provider, default)
