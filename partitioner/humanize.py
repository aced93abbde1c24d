"""Human-readable numbers for messages and tables (pure formatting, no I/O)."""

from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(count: int | float) -> str:
    """1536 -> '1.5 KiB'; binary units, because memory budgets are powers of two."""
    value = float(count)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _BINARY_UNITS:
        if value < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """0.0123 -> '12.3 ms'; microseconds below 1 ms, seconds above 10 s."""
    if seconds != seconds or seconds == float("inf"):
        return "inf"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 10:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.1f} s"
