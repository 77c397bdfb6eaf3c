"""stageplan.units: sizes and bandwidths parsed from text."""

from __future__ import annotations

import pytest

from stageplan import StageplanError
from stageplan.units import parse_bandwidth, parse_bytes


def test_units() -> None:
    assert (
        parse_bytes("40GiB") == 40 * 2**30
        and parse_bytes("40GB") == 40e9
        and parse_bytes("512MiB") == 512 * 2**20
    )
    assert parse_bandwidth("25GB/s") == 25e9 and parse_bandwidth(1e9) == 1e9
    with pytest.raises(StageplanError,
                       match=r"cannot read memory limit '40 gigs'; use a number with a unit such as 40GiB"):
        parse_bytes("40 gigs")
    assert parse_bandwidth("400MiB/s") == 400 * 2**20 and parse_bandwidth("1e9") == 1e9
    for bad in ("0GB/s", "0Gb/s", -1):  # the text as given, and a rate as the example (was '0GB' and 40GiB)
        with pytest.raises(StageplanError, match=rf"bandwidth must be a positive rate, got {bad!r}; use a "
                                                 r"number with a unit such as 25GB/s"):
            parse_bandwidth(bad)  # type: ignore[arg-type]
    for bad in ("fast", "/s", "-5GB/s"):
        with pytest.raises(StageplanError, match=rf"cannot read bandwidth {bad!r}; use a number with a unit "
                                                 r"such as 25GB/s or 400MiB/s \(bytes\), 100Gb/s"):
            parse_bandwidth(bad)
    # B is a byte and b a bit, as links are sold: 25Gb/s had
    # read as 25 GB/s, 8x the link; 25Gbit/s was refused
    assert parse_bandwidth("400Gb/s") == parse_bandwidth("400Gbit/s") == parse_bandwidth("400Gbps") == 50e9
    assert (
        parse_bandwidth("100Mbps") == 12.5e6
        and parse_bandwidth("25GBps") == 25e9
        and parse_bandwidth("8Kib/s") == 1024
    )
    # whatever the prefix's case: 25gbps had read as 25 GB/s,
    # and 25gb/s stayed bytes while 25kb/s read as bits
    assert parse_bandwidth("25gbps") == parse_bandwidth("25gb/s") == parse_bandwidth("25Gb/s") == 25e9 / 8
    assert (
        parse_bandwidth("25kb/s") == 25e3 / 8
        and parse_bandwidth("25GB/S") == parse_bandwidth("25 GB/s") == 25e9
    )
    with pytest.raises(StageplanError,
                       match=r"cannot read the unit of bandwidth '25G'; use 25GB/s or 400MiB/s"):
        parse_bandwidth("25G")
