"""Quantities as people type and read them: sizes, rates, FLOP/s and durations, both ways.

The one place that reads "16GB" or "10Gbit/s" and writes "1.5 GiB": flags and the config file
(`--memory-budget 12GiB`), mesh files for `meshd plan`, refusals ("need 40 GiB, have 16 GiB"),
`meshd status` and the status app. It lives in the partitioner because the partitioner's own
messages need it and the partitioner imports nothing of meshd; meshd imports it from here.
Pure: no I/O.

Conventions (the Kubernetes/IEC ones, stated once here so every input agrees):

* Sizes are bytes. ``k``/``K``, ``M``, ``G``, ``T``, ``P`` (optionally followed by ``B``) are
  powers of 1000; ``Ki``, ``Mi``, ``Gi``, ``Ti``, ``Pi`` (optionally ``B``) are powers of 1024.
  Unit letters are case-insensitive for sizes, so ``16g`` is 16 GB, ``512k`` is 512 kB and
  ``1.5GiB`` is 1.5 x 2**30. A bare number is bytes. Fractions round to the nearest byte.
* Rates are returned in bytes per second. The unit is ``B`` (bytes) or ``b``/``bit`` (bits),
  followed by ``/s`` or ``ps``: ``800GB/s``, ``1Gbit/s``, ``100Mbps``. Here case matters
  for B versus b, as it does on every network spec sheet. A bare number is bytes/s.
* FLOP/s: ``25TFLOPS``, ``25 TFLOP/s``, ``900GFLOPS`` (decimal prefixes) or a number.
* Durations are seconds: ``300us`` (or ``µs``), ``0.3ms``, ``2s``, ``5ns`` or a number.
* Fractions: ``10%`` or ``0.1``, from 0 to 1.
* Formatting writes sizes in binary units (memory is sized in powers of two) and rates and
  FLOP/s in decimal units (bandwidth and compute are specified in powers of ten).
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
_FLOPS = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kmgtp]?)(?P<unit>flop(?:s|/s)?)?\s*$", re.I)
_DURATION = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>s|ms|us|µs|ns)?\s*$")
_DURATION_UNITS = {
    None: Fraction(1),
    "s": Fraction(1),
    "ms": Fraction(1, 10**3),
    "us": Fraction(1, 10**6),
    "µs": Fraction(1, 10**6),
    "ns": Fraction(1, 10**9),
}
_SIZE_EXAMPLES = "e.g. '300MB', '1.5GiB', '16G', '512k' or a number of bytes"
_RATE_EXAMPLES = "e.g. '800GB/s', '1Gbit/s', '100Mbps' or a number of bytes per second"
_FLOPS_EXAMPLES = "e.g. '25TFLOPS', '900 GFLOP/s' or a number of FLOP/s"
_DURATION_EXAMPLES = "e.g. '300us', '0.3ms', '2s' or a number of seconds"
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
    if not isinstance(text, str):
        return _finite_number(text, "a rate", "bytes/s")
    match = _RATE.match(text)
    if match is None or (match["prefix"] and not match["unit"]):
        raise ValueError(f"cannot read {text!r} as a rate: use {_RATE_EXAMPLES}")
    if match["unit"] and not match["per"]:
        raise ValueError(f"cannot read {text!r} as a rate: add '/s' (per second)")
    factor = _prefix_factor(match["prefix"].lower())
    per_byte = Fraction(1, 8) if match["unit"] in {"b", "bit", "Bit"} else Fraction(1)
    return float(Fraction(match["number"]) * factor * per_byte)


def parse_flops(text: str | float) -> float:
    """FLOP/s from '25TFLOPS', '25 TFLOP/s', '900GFLOPS' or a number."""
    if not isinstance(text, str):
        return _finite_number(text, "a compute speed", "FLOP/s")
    match = _FLOPS.match(text)
    if match is None or (match["prefix"] and not match["unit"]):
        raise ValueError(f"cannot read {text!r} as FLOP/s: use {_FLOPS_EXAMPLES}")
    return float(Fraction(match["number"]) * _PREFIXES[match["prefix"].lower()])


def parse_duration(text: str | float) -> float:
    """Seconds from '300us', '0.3ms', '2s', '5ns' or a number of seconds."""
    if not isinstance(text, str):
        return _finite_number(text, "a duration", "seconds")
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a duration: use {_DURATION_EXAMPLES}")
    return float(Fraction(match["number"]) * _DURATION_UNITS[match["unit"]])


def parse_fraction(text: str | float) -> float:
    """A fraction from '10%', '0.1' or a number (10 % is 0.1); from 0 to 1."""
    raw = text.strip() if isinstance(text, str) else text
    try:
        if isinstance(raw, str) and raw.endswith("%"):
            value = float(Fraction(raw[:-1].strip()) / 100)
        else:
            value = _finite_number(float(raw) if isinstance(raw, str) else raw, "a fraction", "")
    except (ValueError, ZeroDivisionError) as error:
        raise ValueError(f"cannot read {text!r} as a fraction: use '10%' or 0.1") from error
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{text!r} is not a fraction from 0 to 1: use e.g. '10%' or 0.1")
    return value


def format_bytes(size: int | float) -> str:
    """'512 B', '1.5 GiB', '17.75 GiB', '-2 MiB': binary units, at most two decimals."""
    sign = "-" if size < 0 else ""
    value = abs(float(size))
    for unit in _BINARY_UNITS:
        if round(value, 2) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{sign}{_trim(value)} {unit}"
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


def format_seconds(seconds: float) -> str:
    """0.0123 -> '12.3 ms'; microseconds below 1 ms, seconds above 10 s."""
    if seconds != seconds or seconds == float("inf"):
        return "inf"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 10:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.1f} s"


def format_wait(seconds: float) -> str:
    """A wait as a person reads it: '45 ms' below 0.1 s, else seconds with two significant
    decimals: '0.57 s', '5.7 s', '57 s' (a time to first token, never '56791 ms')."""
    if seconds != seconds or seconds == float("inf"):
        return "inf"
    if seconds < 0.1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
    return f"{seconds:.0f} s"


def format_token_rate(tokens_per_s: float) -> str:
    """'6.5 tokens/s', '123 tokens/s' (one decimal below 100)."""
    if tokens_per_s < 100:
        return f"{tokens_per_s:.1f} tokens/s"
    return f"{tokens_per_s:.0f} tokens/s"


def _prefix_factor(prefix: str) -> int:
    return _BINARY_PREFIXES[prefix] if prefix.endswith("i") else _PREFIXES[prefix]


def _non_negative(size: int, text: str | int) -> int:
    if size < 0:
        raise ValueError(f"a size cannot be negative, got {text!r}")
    return size


def _finite_number(value: object, what: str, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be text or a number of {unit}, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


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
