"""Reading and writing sizes and rates as people type them (flags, config, ``meshd status``).

Conventions (the Kubernetes/IEC ones, stated once here so every flag agrees):

* Sizes are bytes. ``k``/``K``, ``M``, ``G``, ``T``, ``P`` (optionally followed by ``B``) are
  powers of 1000; ``Ki``, ``Mi``, ``Gi``, ``Ti``, ``Pi`` (optionally ``B``) are powers of 1024.
  Unit letters are case-insensitive for sizes, so ``16g`` is 16 GB, ``512k`` is 512 kB and
  ``1.5GiB`` is 1.5 x 2**30. A bare number is bytes. Fractions round to the nearest byte.
* Rates are returned in bytes per second. The unit is ``B`` (bytes) or ``b``/``bit`` (bits),
  followed by ``/s`` or ``ps``: ``800GB/s``, ``1Gbit/s``, ``100Mbps``. Here case matters
  for B versus b, as it does on every network spec sheet. A bare number is bytes/s.
* Formatting writes sizes in binary units (memory is sized in powers of two) and rates in
  decimal units (bandwidth is specified in powers of ten).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY_PREFIXES = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_NUMBER = r"(?P<number>\d+(?:\.\d*)?|\.\d+)"
_SIZE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>(?:[kmgtp]i?)?)(?P<byte>b?)\s*$", re.IGNORECASE)
_RATE = re.compile(
    rf"^\s*{_NUMBER}\s*(?P<prefix>(?:[kKmMgGtTpP]i?)?)(?P<unit>B|b|bit|Bit)?(?P<per>/s|ps)?\s*$"
)
_SIZE_EXAMPLES = "e.g. '300MB', '1.5GiB', '16G', '512k' or a number of bytes"
_RATE_EXAMPLES = "e.g. '800GB/s', '1Gbit/s', '100Mbps' or a number of bytes per second"
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL_UNITS = ("", "k", "M", "G", "T", "P")


def parse_size(text: str | int) -> int:
    """Bytes from '300MB' (300 x 10**6), '1.5GiB' (1.5 x 2**30), '16G', '512k' or an int.

    Raises ValueError naming the text and the accepted forms.
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"a size must be text or an int of bytes, got {text!r}")
    if isinstance(text, int):
        return _non_negative(text, text)
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a size: use {_SIZE_EXAMPLES}")
    factor = _prefix_factor(match["prefix"].lower())
    return _non_negative(round(Fraction(match["number"]) * factor), text)


def parse_rate(text: str | float) -> float:
    """Bytes per second from '800GB/s', '1Gbit/s' (1.25e8 B/s), '100Mbps' or a number."""
    if isinstance(text, bool) or not isinstance(text, int | float | str):
        raise ValueError(f"a rate must be text or a number of bytes/s, got {text!r}")
    if not isinstance(text, str):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"a rate must be a finite number >= 0, got {text!r}")
        return float(text)
    match = _RATE.match(text)
    if match is None or (match["prefix"] and not match["unit"]):
        raise ValueError(f"cannot read {text!r} as a rate: use {_RATE_EXAMPLES}")
    if match["unit"] and not match["per"]:
        raise ValueError(f"cannot read {text!r} as a rate: add '/s' (per second)")
    factor = _prefix_factor(match["prefix"].lower())
    per_byte = Fraction(1, 8) if match["unit"] in {"b", "bit", "Bit"} else Fraction(1)
    return float(Fraction(match["number"]) * factor * per_byte)


def format_size(size: int) -> str:
    """'512 B', '1.5 GiB', '17.75 GiB': binary units, at most two decimals."""
    value = float(size)
    for unit in _BINARY_UNITS:
        if abs(round(value, 2)) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{_trim(value)} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit always returns")


def format_rate(bytes_per_second: float, *, bits: bool = False) -> str:
    """'24.2 GB/s', or with bits=True '1 Gbit/s': decimal units, for bandwidths."""
    value = bytes_per_second * (8 if bits else 1)
    unit = "bit/s" if bits else "B/s"
    return f"{_decimal(value)}{unit}"


def format_flops(flops: float) -> str:
    """'465 GFLOP/s': decimal units, for measured compute."""
    return f"{_decimal(flops)}FLOP/s"


def _prefix_factor(prefix: str) -> int:
    return _BINARY_PREFIXES[prefix] if prefix.endswith("i") else _PREFIXES[prefix]


def _non_negative(size: int, text: str | int) -> int:
    if size < 0:
        raise ValueError(f"a size cannot be negative, got {text!r}")
    return size


def _decimal(value: float) -> str:
    """Scale by powers of 1000 and keep three significant digits: '24.2 G', '465 G', '1 k'."""
    for prefix in _DECIMAL_UNITS:
        rounded = round(value, max(0, 2 - _magnitude(value)))
        if abs(rounded) < 1000 or prefix == _DECIMAL_UNITS[-1]:
            return f"{_trim(rounded)} {prefix}"
        value /= 1000
    raise AssertionError("unreachable: the last prefix always returns")


def _magnitude(value: float) -> int:
    return math.floor(math.log10(abs(value))) if value else 0


def _trim(value: float) -> str:
    """At most two decimals, without trailing zeros: 1.5, 300, 17.75."""
    return f"{value:.2f}".rstrip("0").rstrip(".")
