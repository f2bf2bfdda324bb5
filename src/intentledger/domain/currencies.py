"""ISO 4217 currency codes and their minor units (decimal exponents).

The set is every alphabetic code in ISO 4217 List One that names a currency or
fund with a minor unit: the list as published 2024-06-25, with the amendments in
force since then applied by hand —

- XCG (Caribbean guilder) replaced ANG in Curaçao and Sint Maarten on 2025-03-31;
- BGN was withdrawn when Bulgaria adopted the euro on 2026-01-01 (as HRK was for
  Croatia in 2023).

Left out on purpose, because no amount of money is ever denominated in them here:
the codes List One gives no minor unit ("N.A."): precious metals (XAU, XAG, XPD,
XPT), the SDR and other units of account (XDR, XBA-XBD, XSU, XUA), the testing code
XTS and "no currency" XXX. Fund codes with a minor unit (BOV, CHE, CHW, CLF, COU,
MXV, USN, UYI, UYW) are active List One codes and are kept.

When ISO publishes an amendment, edit the table below; nothing else reads the list.
"""

from __future__ import annotations

__all__ = ["ISO_4217_CODES", "MINOR_UNITS", "format_amount", "normalise_currency"]

# Codes grouped by their minor unit: the number of digits after the decimal point
# in an amount, which is what converting between major and minor units needs.
_CODES_BY_MINOR_UNIT: dict[int, str] = {
    0: "BIF CLP DJF GNF ISK JPY KMF KRW PYG RWF UGX UYI VND VUV XAF XOF XPF",
    2: (
        "AED AFN ALL AMD AOA ARS AUD AWG AZN BAM BBD BDT BMD BND BOB BOV BRL BSD BTN BWP BYN "
        "BZD CAD CDF CHE CHF CHW CNY COP COU CRC CUC CUP CVE CZK DKK DOP DZD EGP ERN ETB EUR "
        "FJD FKP GBP GEL GHS GIP GMD GTQ GYD HKD HNL HTG HUF IDR ILS INR IRR JMD KES KGS KHR "
        "KPW KYD KZT LAK LBP LKR LRD LSL MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MXV "
        "MYR MZN NAD NGN NIO NOK NPR NZD PAB PEN PGK PHP PKR PLN QAR RON RSD RUB SAR SBD SCR "
        "SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT TOP TRY TTD TWD TZS UAH "
        "USD USN UYU UZS VED VES WST XCD XCG YER ZAR ZMW ZWG"
    ),
    3: "BHD IQD JOD KWD LYD OMR TND",
    4: "CLF UYW",
}

MINOR_UNITS: dict[str, int] = {
    code: exponent for exponent, codes in _CODES_BY_MINOR_UNIT.items() for code in codes.split()
}

ISO_4217_CODES: frozenset[str] = frozenset(MINOR_UNITS)


def normalise_currency(text: str) -> str:
    """Return ``text`` upper-cased if it is an active ISO 4217 code, else raise ``ValueError``.

    Only ASCII letters are upper-cased: ``str.upper`` maps some non-ASCII letters
    onto ASCII ones (U+017F LATIN SMALL LETTER LONG S upper-cases to "S"), which
    would let a look-alike of "usd" pass as USD.
    """
    code = text.upper() if text.isascii() else text
    if code not in ISO_4217_CODES:
        raise ValueError(
            f"unknown currency {text!r}: expected an active ISO 4217 code such as USD or EUR"
        )
    return code


NO_AMOUNT = "—"


def format_amount(amount: int | None, currency: str | None) -> str:
    """An amount as every display shows it: major units in the currency's own
    exponent, then the minor units the API speaks, so a person can read it and
    copy the number a request carries: ``42.00 EUR (4200)``, ``4200 JPY (4200)``.

    A code outside the table (a row older than an ISO amendment) is shown in
    minor units only, rather than with a guessed exponent. An operation that
    moves no money (a beneficiary, a card) has no amount: a dash.
    """
    if amount is None:
        return NO_AMOUNT
    if currency is None:
        return f"{amount} (minor units)"
    exponent = MINOR_UNITS.get(currency)
    if exponent is None:
        return f"{amount} {currency} (minor units)"
    sign = "-" if amount < 0 else ""
    whole, fraction = divmod(abs(amount), 10**exponent)
    major = f"{whole}.{fraction:0{exponent}d}" if exponent else str(whole)
    return f"{sign}{major} {currency} ({amount})"
