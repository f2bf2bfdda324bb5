"""IBAN validation: ISO 13616 shape and the mod-97 check digits."""

from __future__ import annotations

import re

_SHAPE = re.compile(r"[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}")


def normalise_iban(text: str) -> str:
    """Upper-case, spaces removed; ValueError naming the value if it is no IBAN."""
    compact = text.replace(" ", "").upper()
    if not compact.isascii() or not _SHAPE.fullmatch(compact):
        raise ValueError(f"{text!r} is not an IBAN (country, 2 check digits, 11-30 letters/digits)")
    rearranged = compact[4:] + compact[:4]
    digits = "".join(str(int(char, 36)) for char in rearranged)
    if int(digits) % 97 != 1:
        raise ValueError(f"{text!r} fails the IBAN check digits")
    return compact
