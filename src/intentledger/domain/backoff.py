"""When to check an UNKNOWN operation again: capped exponential backoff and Retry-After.

Both are *timing* only. A timer makes a check due; it never creates evidence and
never makes a resubmission safe. The domain draws no random numbers: the caller
passes ``jitter`` in, so every delay is reproducible from the recorded inputs.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from fractions import Fraction

from intentledger.domain.retry_after import DEFAULT_CEILING, RetryAfter, require_utc

__all__ = ["next_check_at", "recheck_delay"]

_MICROSECOND = timedelta(microseconds=1)


def recheck_delay(
    check_number: int,
    base: timedelta,
    cap: timedelta = DEFAULT_CEILING,
    jitter: float = 0.0,
) -> timedelta:
    """Delay before re-check number ``check_number`` (1 for the first re-check).

    With ``d = min(cap, base * 2**(check_number - 1))`` counted in whole
    microseconds, the result is::

        d - floor(d * jitter / 2)

    an "equal jitter" spread: the upper half of ``d`` is fixed and the lower half
    shrinks by a caller-drawn ``jitter`` in ``[0, 1)``, so the result lies in
    ``(d/2, d]``, always in ``(0, cap]``. ``jitter=0`` gives exactly ``d``. For a
    fixed ``jitter`` the result never decreases as ``check_number`` grows: the
    arithmetic is exact (integers and ``Fraction``), so no float rounding can
    break that. Spreading re-checks keeps many operations that failed together
    (one provider outage) from all being looked up in the same instant.

    Raises ``ValueError`` when ``check_number < 1``, ``base`` or ``cap`` is not
    positive, or ``jitter`` is outside ``[0, 1)``.
    """
    _check_arguments(check_number, base, cap, jitter)
    delay_us = _capped_exponential_us(check_number, base // _MICROSECOND, cap // _MICROSECOND)
    spread_us = Fraction(delay_us) * Fraction(jitter) / 2
    return (delay_us - int(spread_us)) * _MICROSECOND  # int() floors a non-negative value


def next_check_at(
    observed_at: datetime,
    retry_after: RetryAfter | None,
    backoff: timedelta,
) -> datetime:
    """When the next check of an operation becomes due.

    Without usable ``Retry-After`` guidance (absent, or ignored as invalid) it is
    ``observed_at + backoff``. With both, the later time wins
    (docs/design.md#retry-after-is-timing-only): a provider's ``Retry-After`` may
    delay our check but never hasten it, and our backoff never overrides a
    provider's request to wait (RFC 9110 §10.2.3).
    """
    observed_at = require_utc(observed_at, "observed_at")
    if backoff < timedelta(0):
        raise ValueError(f"backoff must be >= 0, got {backoff!r}")
    by_backoff = observed_at + backoff
    if retry_after is None or retry_after.at is None:
        return by_backoff
    return max(by_backoff, retry_after.at)


def _capped_exponential_us(check_number: int, base_us: int, cap_us: int) -> int:
    # base_us >= 1, so once 2**(n-1) alone exceeds the cap the product does too;
    # deciding that first keeps a huge check_number from building a huge integer.
    if check_number - 1 >= cap_us.bit_length():
        return cap_us
    return min(cap_us, base_us << (check_number - 1))


def _check_arguments(check_number: int, base: timedelta, cap: timedelta, jitter: float) -> None:
    if check_number < 1:
        raise ValueError(f"check_number counts from 1, got {check_number}")
    if base < _MICROSECOND:
        raise ValueError(f"base must be at least 1 microsecond, got {base!r}")
    if cap < _MICROSECOND:
        raise ValueError(f"cap must be at least 1 microsecond, got {cap!r}")
    # Written so that NaN fails too: every comparison with NaN is False.
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
