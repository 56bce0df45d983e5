"""Parsing and formatting of the quantities a plan is made of: durations, counts, sizes, bandwidths, money.

Accepted forms (whitespace between number and unit is allowed):

- durations: ``7s``, ``500ms``, ``5min``, ``1.5h``, ``72h``, ``3d``, ``2w``, ``1y`` (365 days), compounds like
  ``1h30min``. ``m`` means minutes. Text needs a unit (``72`` is refused: hours or seconds?), except ``0``;
  a Python int or float is seconds.
- counts: ``70B`` (billion), ``1.5T``, ``350M``, ``8k``, ``7e10``; ``G`` is accepted for billion too.
- sizes: ``140GB`` (SI, 10^9 bytes), ``1.5TiB`` (binary, 2^40 bytes), ``800Mb`` (bits: an upper-case prefix
  and a lower-case ``b``), ``12 bytes``, ``96 bits``. Text needs a unit; a Python number is bytes.
- bandwidths: a size per second, ``20GB/s``, ``2.5GiB/s``, ``100Gb/s`` (bits), ``100Gbps`` (``bps`` is always
  bits per second, ``Bps`` bytes). Text needs a unit; a Python number is bytes per second.
- money: ``$2.50``, ``2.5``, ``$2.50/h``, ``2.50 USD``, ``$1,200``, ``$1.84M``.

An all-lower-case size unit (``20gb/s``, ``mb``, ``b``) is refused as ambiguous: the message gives both
readings (bytes and bits) and how to write each.

Every parser raises :class:`~trainguard.errors.ConfigError` with a message that names the bad text and shows
a valid example. The formatters produce text the parsers read back (to 4 significant digits by default).
"""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

_NUMBER = r"[+-]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_NUM_RE = re.compile(rf"\s*({_NUMBER})\s*")
_DURATION_PART_RE = re.compile(r"((?:\d[\d_]*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")

DURATION_UNITS_S: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "w": 7 * 86400.0,
    "wk": 7 * 86400.0,
    "week": 7 * 86400.0,
    "weeks": 7 * 86400.0,
    "y": 365 * 86400.0,
    "yr": 365 * 86400.0,
    "year": 365 * 86400.0,
    "years": 365 * 86400.0,
}

COUNT_SUFFIXES: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}

_SI_PREFIX: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}
_BIN_PREFIX: dict[str, float] = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50}
_SIZE_RE = re.compile(r"^(?P<prefix>[kKmMgGtTpPeE]i?)?(?P<unit>B|b|bytes?|bits?)$")


def _split_number(text: str, what: str, example: str) -> tuple[float, str]:
    """Return the leading number of ``text`` and the rest (stripped)."""
    if not isinstance(text, str):
        text = str(text)
    m = _NUM_RE.match(text)
    if m is None:
        raise ConfigError(f"cannot read {what} {text!r}: expected a number, e.g. {example}")
    value = float(m.group(1).replace("_", ""))
    if not math.isfinite(value):
        raise ConfigError(f"{what} {text!r} is not a finite number; give e.g. {example}")
    return value, text[m.end() :].strip()


def _check_sign(value: float, text: str, what: str, example: str, *, allow_zero: bool) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what} must be {need}, got {text!r}; give e.g. {example}")


def parse_duration_s(text: str | float, *, what: str = "duration", allow_zero: bool = True) -> float:
    """Parse a duration such as ``72h``, ``5min``, ``1h30min`` or ``300`` (seconds).

    Args:
        text: the text to parse; a number is taken as seconds.
        what: the name of the quantity, used in error messages (e.g. ``"MTBF"``).
        allow_zero: whether 0 is accepted (negative durations never are).

    Returns:
        The duration in seconds.

    Raises:
        ConfigError: if the text is not a duration, has an unknown unit, or is negative (or zero when not
            allowed).
    """
    example = "72h, 5min, 30s or 1h30min"
    if isinstance(text, (int, float)):
        value = float(text)
        _check_sign(value, str(text), what, example, allow_zero=allow_zero)
        return value
    s = text.strip()
    if not s:
        raise ConfigError(f"{what} is empty; give e.g. {example}")
    sign = 1.0
    if s[0] in "+-":
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:].lstrip()
    if _NUM_RE.fullmatch(s) is not None and float(s.replace("_", "")) != 0:
        raise ConfigError(
            f"{what} {text!r} has no unit; durations need one: {s}d, {s}h, {s}min or {s}s (e.g. {example})"
        )
    parts = list(_DURATION_PART_RE.finditer(s))
    if (
        not parts
        or parts[0].start() != 0
        or any(a.end() != b.start() for a, b in zip(parts, parts[1:], strict=False))
        or (parts[-1].end() != len(s))
    ):
        raise ConfigError(f"cannot read {what} {text!r}: expected a number with a unit, e.g. {example}")
    if len(parts) > 1 and any(not p.group(2) for p in parts):
        raise ConfigError(f"{what} {text!r}: every part of a compound duration needs a unit, e.g. 1h30min")
    total = 0.0
    for part in parts:
        value = float(part.group(1).replace("_", ""))
        unit = part.group(2)
        factor = DURATION_UNITS_S.get(unit.lower()) if unit else 1.0
        if factor is None:
            known = "ms, s, min (or m), h, d, w, y"
            raise ConfigError(
                f"unknown unit {unit!r} in {what} {text!r}; use one of {known} (e.g. {example})"
            )
        total += value * factor
    total *= sign
    if not math.isfinite(total):
        raise ConfigError(f"{what} {text!r} is not a finite duration; give e.g. {example}")
    _check_sign(total, text, what, example, allow_zero=allow_zero)
    return total


def parse_count(text: str | float, *, what: str = "count") -> float:
    """Parse a count such as ``70B`` (7e10), ``1.5T``, ``350M``, ``8k`` or ``7e10``.

    Args:
        text: the text to parse.
        what: the name of the quantity for error messages (e.g. ``"parameters"``).

    Returns:
        The count as a float (> 0).

    Raises:
        ConfigError: on an unknown suffix or a value <= 0.
    """
    example = "70B, 1.5T, 350M or 7e10"
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        value, rest = _split_number(text, what, example)
        suffix = rest.lower()
        if suffix not in COUNT_SUFFIXES:
            raise ConfigError(
                f"unknown suffix {rest!r} in {what} {text!r}; use k, M, B (or G) or T (e.g. {example})"
            )
        value *= COUNT_SUFFIXES[suffix]
    _check_sign(value, str(text), what, example, allow_zero=False)
    return value


_PREFIX_NAMES = {"": "", "k": "kilo", "m": "mega", "g": "giga", "t": "tera", "p": "peta", "e": "exa"}
_BIN_NAMES = {"ki": "kibi", "mi": "mebi", "gi": "gibi", "ti": "tebi", "pi": "pebi"}


def _plain(x: float) -> str:
    """``20,000,000,000`` rather than ``2e+10``: a reader compares the two readings digit by digit."""
    return f"{x:,.0f}" if x >= 1 and float(x).is_integer() and x < 1e21 else f"{x:,.4g}"


def _check_ambiguous(value: float, unit: str, text: str, what: str, per: str) -> None:
    """Refuse an all-lower-case ``b`` unit (``gb``, ``mb``, ``b``): bytes or bits cannot be told apart."""
    m = _SIZE_RE.match(unit)
    if m is None or m.group("unit") != "b" or (m.group("prefix") or "") != (m.group("prefix") or "").lower():
        return
    prefix = m.group("prefix") or ""
    if prefix and prefix != prefix.lower():
        return
    p = prefix.lower()
    name = _BIN_NAMES[p] if p.endswith("i") else _PREFIX_NAMES[p]
    up = p[:1].upper() + p[1:] if p else ""
    factor = _BIN_PREFIX[p] if p.endswith("i") else _SI_PREFIX[p]
    n = f"{value:g}"
    raise ConfigError(
        f"{what} {text!r} is ambiguous: {unit!r} may mean {name}bytes ({n}{up}B{per} = {_plain(value * factor)} "
        f"bytes{per}) or {name}bits ({n}{up}b{per} = {_plain(value * factor / 8)} bytes{per}); write {n}{up}B{per} "
        f"for bytes or {n}{up}b{per} for bits"
    )


def _size_factor(unit: str) -> float | None:
    """Bytes per unit for ``GB``, ``GiB``, ``Gb``, ``B``, ``bytes``, ...; None when unknown."""
    if unit == "":
        return 1.0
    m = _SIZE_RE.match(unit)
    if m is None:
        return None
    prefix = (m.group("prefix") or "").lower()
    scale = _BIN_PREFIX[prefix] if prefix.endswith("i") else _SI_PREFIX[prefix]
    bits = m.group("unit") == "b" or m.group("unit").startswith("bit")
    return scale / 8.0 if bits else scale


def parse_bytes(text: str | float, *, what: str = "size", allow_zero: bool = False) -> float:
    """Parse a size such as ``140GB`` (SI), ``1.5TiB`` (binary) or ``800Mb`` (bits).

    Args:
        text: the text to parse; a number is bytes.
        what: the name of the quantity for error messages.
        allow_zero: whether 0 is accepted.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: on an unknown unit or a negative (or zero) value.
    """
    example = "140GB, 1.5TiB or 512MB"
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        value, rest = _split_number(text, what, example)
        if not rest and value != 0:
            raise ConfigError(f"{what} {text!r} has no unit; give e.g. {value:g}GB or {value:g}B ({example})")
        _check_ambiguous(value, rest, text, what, "")
        factor = _size_factor(rest)
        if factor is None:
            raise ConfigError(
                f"unknown unit {rest!r} in {what} {text!r}; use B, kB, MB, GB, TB or KiB..TiB (e.g. {example})"
            )
        value *= factor
    _check_sign(value, str(text), what, example, allow_zero=allow_zero)
    return value


def parse_bandwidth_bytes_per_s(text: str | float, *, what: str = "bandwidth") -> float:
    """Parse a bandwidth such as ``20GB/s``, ``2.5GiB/s`` or ``100Gbps`` (bits).

    Args:
        text: the text to parse; a number is bytes per second.
        what: the name of the quantity for error messages (e.g. ``"write bandwidth"``).

    Returns:
        The bandwidth in bytes per second (> 0).

    Raises:
        ConfigError: on an unknown unit, a missing ``/s`` after a size unit, or a value <= 0.
    """
    example = "20GB/s, 2.5GiB/s or 100Gbps"
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        value, rest = _split_number(text, what, example)
        _check_sign(value, str(text), what, example, allow_zero=False)  # before any unit hint built on it
        m = re.match(r"^(?P<size>[A-Za-z]*)\s*(?P<per>/\s*s(?:ec)?|ps)?$", rest)
        if m is None:
            raise ConfigError(
                f"unknown unit {rest!r} in {what} {text!r}; use a size per second (e.g. {example})"
            )
        size, per = m.group("size"), m.group("per")
        if not size and per is None:
            raise ConfigError(
                f"{what} {text!r} has no unit; rates need one: {value:g}GB/s (bytes) or {value:g}Gb/s "
                f"(bits) (e.g. {example})"
            )
        if size.endswith("ps") and per is None:  # "GBps", "Gbps"
            size, per = size[:-2], "ps"
        if per != "ps":  # "bps" is bits per second whatever the prefix's case; "/s" after "gb" is not
            _check_ambiguous(value, size, text, what, "/s")
        factor = _size_factor(size)
        if factor is None:
            raise ConfigError(
                f"unknown unit {rest!r} in {what} {text!r}; use a size per second (e.g. {example})"
            )
        if size and per is None:
            raise ConfigError(f"{what} {text!r} is a size, not a rate; add '/s' (e.g. {example})")
        value *= factor
    _check_sign(value, str(text), what, example, allow_zero=False)
    return value


def parse_money_usd(text: str | float, *, what: str = "price", allow_zero: bool = True) -> float:
    """Parse an amount of money such as ``$2.50``, ``2.5``, ``$2.50/h`` or ``2.50 USD``.

    A trailing per-hour marker (``/h``, ``/hr``, ``/hour``, ``/gpu-h``, ``/gpu-hour``) is accepted and ignored:
    the caller knows what the amount is per.

    Args:
        text: the text to parse.
        what: the name of the quantity for error messages (e.g. ``"GPU-hour price"``).
        allow_zero: whether 0 is accepted.

    Returns:
        The amount in US dollars.

    Raises:
        ConfigError: on text that is not an amount or a negative value.
    """
    example = "$2.50 or 2.50"
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip()
        s = re.sub(r"(?i)\s*/\s*(?:gpu[-_ ]?|gpu\s*/\s*)?(?:h|hr|hour)$", "", s)
        s = re.sub(r"(?i)\s*usd$", "", s).strip()
        neg = s.startswith("-")
        if neg:
            s = s[1:].lstrip()
        s = s.removeprefix("$").replace(",", "")
        value, rest = _split_number(s, what, example)
        if rest.lower() not in COUNT_SUFFIXES:  # "$1.84M" as the formatter writes large amounts
            raise ConfigError(f"cannot read {what} {text!r}: unexpected {rest!r}; give e.g. {example}")
        value *= COUNT_SUFFIXES[rest.lower()]
        if neg:
            value = -value
    _check_sign(value, str(text), what, example, allow_zero=allow_zero)
    return value


def _g(value: float, digits: int) -> str:
    return f"{value:.{digits}g}"


def format_duration(seconds: float, *, digits: int = 4) -> str:
    """Format seconds with the largest unit that keeps the value >= 1: ``31.75 min``, ``72 h``, ``7 s``.

    The text parses back with :func:`parse_duration_s` to ``digits`` significant digits.
    """
    if not math.isfinite(seconds):
        return "inf" if seconds > 0 else str(seconds)
    a = abs(seconds)
    for unit, factor in (("y", 365 * 86400.0), ("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        # Years from 2 years up, days from 4 days (so "72 h" stays in hours), minutes up to 2 hours.
        limit = {"y": 2 * 365 * 86400.0, "d": 4 * 86400.0, "h": 2 * 3600.0, "min": 60.0, "s": 1.0}[unit]
        if a >= limit:
            return f"{_g(seconds / factor, digits)} {unit}"
    if a == 0:
        return "0 s"
    return f"{_g(seconds * 1e3, digits)} ms"


def format_bytes(n_bytes: float, *, digits: int = 4) -> str:
    """Format a size in SI units: ``140 GB``, ``980 GB``, ``1.96 TB``."""
    a = abs(n_bytes)
    for unit, factor in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if a >= factor:
            return f"{_g(n_bytes / factor, digits)} {unit}"
    return f"{_g(n_bytes, digits)} B"


def format_bandwidth(bytes_per_s: float, *, digits: int = 4) -> str:
    """Format a bandwidth in SI units: ``20 GB/s``."""
    return format_bytes(bytes_per_s, digits=digits) + "/s"


def format_count(n: float, *, digits: int = 4) -> str:
    """Format a count with k/M/B/T suffixes: ``70B``, ``1.5T``."""
    a = abs(n)
    for suffix, factor in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if a >= factor:
            return f"{_g(n / factor, digits)}{suffix}"
    return _g(n, digits)


def format_money_usd(amount: float) -> str:
    """Format dollars: ``$2.50``, ``$1,234``, ``$1.84M``."""
    a = abs(amount)
    sign = "-" if amount < 0 else ""
    if a >= 1e7:
        return f"{sign}${a / 1e6:,.2f}M"
    if a >= 1000:
        return f"{sign}${a:,.0f}"
    if a >= 0.01 or a == 0:
        return f"{sign}${a:,.2f}"
    return f"{sign}${a:.2g}"
