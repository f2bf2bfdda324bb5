"""Per-provider safety rules from TOML."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest

from intentledger.domain.safety import SafetyRules
from intentledger.safety_config import SafetyConfigError, load_safety_rules


def test_no_file_means_the_documented_defaults() -> None:
    rules = load_safety_rules(None)("sandbox")
    assert rules == SafetyRules()
    assert (rules.margin, rules.max_checks, rules.allow_new_request) == (0.10, 10, False)


def test_defaults_and_per_provider_overrides(tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(
        '[default]\nmargin = 0.2\nmax_age = "2d"\n\n'
        '[provider.sandbox]\nallow_new_request = true\nnew_request_min_spread = "30m"\n'
    )
    rules_for = load_safety_rules(str(path))
    sandbox, stripe = rules_for("sandbox"), rules_for("stripe")
    assert (sandbox.margin, sandbox.max_age, sandbox.allow_new_request) == (
        0.2,
        timedelta(days=2),
        True,
    )
    assert sandbox.new_request_min_spread == timedelta(minutes=30)
    assert (stripe.margin, stripe.allow_new_request) == (0.2, False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[default]\nmargn = 0.1\n", "unknown setting 'margn'"),
        ("[default]\nmargin = 1.5\n", "margin must be more than 0 and less than 1"),
        ("[default]\nmargin = 0\n", "margin must be more than 0 and less than 1"),
        ("[default]\nallow_new_request = 'yes'\n", "must be true or false"),
        ("[default]\nmax_checks = 'ten'\n", "must be a number"),
        ("[default]\nmax_age = 'a week'\n", "a week"),
        ("[default\n", "cannot read safety rules"),
    ],
)
def test_bad_rules_are_refused_with_a_clear_message(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises((SafetyConfigError, ValueError), match=re.escape(message)):
        load_safety_rules(str(path))
