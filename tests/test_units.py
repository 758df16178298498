"""Byte quantities as users write them (`memory_limit`, `device_memory`) and as plans show them."""

from __future__ import annotations

import math

import pytest

from autoshard._units import human, parse_bytes, table_unit

GiB = 2**30
MiB = 2**20


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1024, 1024),  # an int is a number of bytes
        (3 * GiB, 3 * GiB),
        (1.5e9, 1_500_000_000),  # a float too
        (2.5, 2),  # ... truncated to whole bytes
        ("20GiB", 20 * GiB),
        ("1.5 GB", 1_500_000_000),  # decimal unit, space between number and unit
        ("512MiB", 512 * MiB),
        ("64KiB", 64 * 2**10),
        ("2TiB", 2 * 2**40),
        ("7kb", 7_000),
        ("3 tb", 3 * 10**12),
        ("1024", 1024),  # a bare number in a string is bytes
        ("1024B", 1024),
        ("  8 GiB  ", 8 * GiB),  # surrounding whitespace is ignored
        ("1e3", 1_000),  # exponent notation
        ("0.5GiB", GiB // 2),
        (".5GiB", GiB // 2),
        # a single-letter unit is binary, as in Slurm's --mem and Docker's --memory
        ("20G", 20 * GiB),
        ("20 g", 20 * GiB),
        ("512M", 512 * MiB),
        ("64k", 64 * 2**10),
        ("1T", 2**40),
        ("20GB", 20 * 10**9),  # ... and a unit spelt with B is decimal
        ("20 gb", 20 * 10**9),
    ],
)
def test_parse_bytes_accepts(value: int | float | str, expected: int) -> None:
    assert parse_bytes(value) == expected
    assert isinstance(parse_bytes(value), int)


@pytest.mark.parametrize("spelling", ["20GiB", "20gib", "20GIB", "20Gib", "20 gIb"])
def test_parse_bytes_units_are_case_insensitive(spelling: str) -> None:
    assert parse_bytes(spelling) == 20 * GiB


@pytest.mark.parametrize("value", ["20 gigs", "", "GiB", "   ", "20 GiB GiB", "twenty", "1,5GB"])
def test_parse_bytes_rejects_unparseable_strings(value: str) -> None:
    with pytest.raises(ValueError, match="cannot be parsed") as info:
        parse_bytes(value)
    message = str(info.value)
    assert "memory_limit" in message  # names the argument
    assert "'20GiB'" in message  # and shows the fix
    # and states the one convention for the short units
    assert "K, M, G, T are binary (20G = 20GiB = 20 * 2**30 bytes)" in message
    assert "KB, MB, GB, TB decimal (20GB = 20 * 10**9 bytes)" in message


@pytest.mark.parametrize(
    "value",
    [
        0,
        0.0,
        -5,
        -1.5,
        "-5",  # a signed string parses: it is refused for its amount, not its spelling
        "0",
        "0GiB",
        0.5,  # less than one byte
        "0.5",
        math.nan,
        math.inf,
        -math.inf,
    ],
)
def test_parse_bytes_rejects_amounts_that_are_not_positive_and_finite(
    value: int | float | str,
) -> None:
    with pytest.raises(
        ValueError, match="must be a positive, finite amount of at least one byte"
    ) as info:
        parse_bytes(value)
    message = str(info.value)
    assert "memory_limit" in message  # names the argument
    assert "e.g. memory_limit='20GiB'" in message  # and shows a valid value


def test_parse_bytes_not_positive_message_gives_the_fix() -> None:
    # Like the unparseable and wrong-type messages, this one should show a valid value.
    for value in (0, -5, "-5", 0.5, math.nan):
        with pytest.raises(ValueError, match="memory_limit") as info:
            parse_bytes(value)
        assert "'20GiB'" in str(info.value), str(info.value)


@pytest.mark.parametrize("value", [True, False, None, [1], (1,), b"20GiB", {"GiB": 20}])
def test_parse_bytes_rejects_other_types(value: object) -> None:
    with pytest.raises(TypeError, match="memory_limit must be a number of bytes") as info:
        parse_bytes(value)  # type: ignore[arg-type]
    assert "'20GiB'" in str(info.value)


def test_parse_bytes_names_the_argument_it_parses() -> None:
    with pytest.raises(ValueError, match="device_memory='lots'"):
        parse_bytes("lots", what="device_memory")
    with pytest.raises(TypeError, match="device_memory must be"):
        parse_bytes(True, what="device_memory")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536 * MiB, "1.50 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (-2 * MiB, "-2.00 MiB"),
    ],
)
def test_human(n: int, expected: str) -> None:
    assert human(n) == expected


def test_table_unit_switches_to_gib_at_one_gib() -> None:
    assert table_unit(GiB - 1) == ("MiB", MiB)
    assert table_unit(GiB) == ("GiB", GiB)
    assert table_unit(0) == ("MiB", MiB)
