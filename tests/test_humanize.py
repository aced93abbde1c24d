"""partitioner.humanize: sizes, rates, FLOP/s and durations as people type them, and back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from partitioner.humanize import (
    format_bytes,
    format_flops,
    format_rate,
    format_seconds,
    parse_duration,
    parse_flops,
    parse_fraction,
    parse_rate,
    parse_size,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("300MB", 300 * 10**6),
        ("300 MB", 300 * 10**6),
        ("300mb", 300 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("16G", 16 * 10**9),
        ("16g", 16 * 10**9),
        ("512k", 512_000),
        ("512KiB", 512 * 1024),
        ("2Ti", 2 * 2**40),
        (".5KiB", 512),
        ("7B", 7),
        ("1024", 1024),
        (" 42 ", 42),
        (4096, 4096),
        ("0", 0),
        ("1.0000004", 1),  # rounds to the nearest byte
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "MB", "-5MB", "5XB", "1,5GB", "1e9", "1 G B", "300MB/s", "nan", "inf"]
)
def test_parse_size_rejects_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match=rf"cannot read {text!r} as a size: use e\.g\. '300MB'"):
        parse_size(text)


@pytest.mark.parametrize("value", [-1, True, 1.5, None])
def test_parse_size_rejects_non_sizes(value: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("800GB/s", 800e9),
        ("800 GB/s", 800e9),
        ("1Gbit/s", 125e6),
        ("1 Gb/s", 125e6),
        ("100Mbps", 12.5e6),
        ("12.5MB/s", 12.5e6),
        ("2GiB/s", 2.0 * 2**30),
        ("800", 800.0),
        (1e9, 1e9),
    ],
)
def test_parse_rate(text: str | float, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["1G", "fast", "-1GB/s", "1GB", "1G/s", "1Gbit"])
def test_parse_rate_rejects_ambiguous_or_malformed(text: str) -> None:
    with pytest.raises(ValueError, match=f"cannot read {text!r} as a rate"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (3 * 2**29, "1.5 GiB"),
        (2**20 - 1, "1 MiB"),
        (-2 * 2**20, "-2 MiB"),
    ],
)
def test_format_bytes(size: int, text: str) -> None:
    assert format_bytes(size) == text


def test_format_rates_and_flops() -> None:
    assert format_rate(24.2e9) == "24.2 GB/s"
    assert format_rate(125e6, bits=True) == "1 Gbit/s"
    assert format_rate(999.7e3) == "1 MB/s"
    assert format_flops(465.3e9) == "465 GFLOP/s"


@given(st.integers(min_value=0, max_value=2**55))
def test_formatted_sizes_parse_back_within_half_a_percent(size: int) -> None:
    assert parse_size(format_bytes(size).replace(" ", "")) == pytest.approx(size, rel=5e-3, abs=1)


@given(st.floats(min_value=1.0, max_value=1e15, allow_nan=False))
def test_formatted_rates_parse_back_within_a_percent(rate: float) -> None:
    assert parse_rate(format_rate(rate)) == pytest.approx(rate, rel=1e-2)
    assert parse_rate(format_rate(rate, bits=True)) == pytest.approx(rate, rel=1e-2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("25TFLOPS", 25e12), ("25 TFLOP/s", 25e12), ("900gflops", 900e9), ("1e3", None), (7, 7.0)],
)
def test_parse_flops(text: str | float, expected: float | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="as FLOP/s"):
            parse_flops(text)
    else:
        assert parse_flops(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("300us", 300e-6), ("300µs", 300e-6), ("0.3ms", 3e-4), ("2s", 2.0), ("5ns", 5e-9), (1.5, 1.5)],
)
def test_parse_duration(text: str | float, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("value", ["3 parsecs", "-1ms", float("nan"), -1, True])
def test_parse_duration_refuses_what_is_not_a_duration(value: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)  # type: ignore[arg-type]


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (12e-6, 0.0123, 42.0)] == ["12 us", "12.3 ms", "42.0 s"]


def test_fractions_as_percent_or_number() -> None:
    assert parse_fraction("10%") == pytest.approx(0.1)
    assert parse_fraction(" 2.5 % ") == pytest.approx(0.025)
    assert parse_fraction("0.1") == pytest.approx(0.1)
    assert parse_fraction(0) == 0.0
    for bad in ("150%", "-1", "ten", 2):
        with pytest.raises(ValueError, match="fraction"):
            parse_fraction(bad)
