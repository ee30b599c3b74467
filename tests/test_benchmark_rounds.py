"""The benchmark rounds' pure parts (``benchmarks/rounds.py``): rotated order, per-round ratios with their median
and range, the load guard's flags and refusal, ``/proc/stat`` arithmetic and the torch-build check. No process is
timed; well under a second."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "rounds.py"
_SPEC = importlib.util.spec_from_file_location("benchmark_rounds", _PATH)
assert _SPEC and _SPEC.loader
rounds = importlib.util.module_from_spec(_SPEC)
sys.modules["benchmark_rounds"] = rounds
_SPEC.loader.exec_module(rounds)


def _record(variant: str, r: int, cpu: float, flags: list[str] | None = None) -> dict[str, Any]:
    return {
        "variant": variant,
        "round": r,
        "cpu_s": 99.0,
        "wall_s": 1.0,
        "other_load": 0.0,
        "figures": {"cpu_s_per_step": cpu},
        "flags": flags or [],
    }


def test_schedule_rotates_the_order_every_round() -> None:
    assert [n for _, _, n in rounds.schedule(["dt", "trl"], 3)] == ["dt", "trl", "trl", "dt", "dt", "trl"]
    three = rounds.schedule(["a", "b", "c"], 4)
    assert [n for _, _, n in three] == [*"abc", *"bca", *"cab", *"abc"]
    assert three[4] == (1, 1, "c")  # round 1, second position
    with pytest.raises(ValueError, match="at least one round"):
        rounds.schedule(["a"], 0)


def test_ratio_is_taken_per_round_then_its_median_and_range() -> None:
    # Round ratios 0.5, 1.5, 0.9, 1.2: median 1.05; the ratio of medians (1.1 / 1.0 = 1.1) would differ.
    records = [
        _record("dt", 0, 0.5),
        _record("trl", 0, 1.0),
        _record("trl", 1, 1.0),
        _record("dt", 1, 1.5),
        _record("dt", 2, 0.9),
        _record("trl", 2, 1.0),
        _record("dt", 3, 1.2),
        _record("trl", 3, 1.0),
        _record("trl", 4, 2.0),  # a round without its partner is skipped
    ]
    got = rounds.ratio(records, "dt", "trl", "cpu_s_per_step")
    assert got["values"] == pytest.approx([0.5, 1.5, 0.9, 1.2])
    assert got["median"] == pytest.approx(1.05)
    assert (got["min"], got["max"]) == (0.5, 1.5)
    with pytest.raises(ValueError, match="no round has both"):
        rounds.ratio(records, "dt", "trl", "absent")


def test_summary_gives_each_variant_median_range_and_flagged_rounds() -> None:
    records = [
        _record("dt", 0, 0.30),
        _record("dt", 1, 0.10, ["load 3.00 > 1.5 at start"]),
        _record("dt", 2, 0.20),
    ]
    got = rounds.summary(records)["dt"]
    assert got["cpu_s_per_step"] == {"median": 0.2, "min": 0.1, "max": 0.3, "values": [0.3, 0.1, 0.2]}
    assert got["cpu_s"]["median"] == 99.0
    assert got["flagged_rounds"] == [1]


def test_guard_flags_and_refuses_above_its_limits() -> None:
    guard = rounds.Guard(max_load_before=1.5, max_other_load=0.5)
    assert guard.flags(1.4, 0.4) == []
    assert guard.flags(2.25, 0.75) == [
        "load 2.25 > 1.5 at start",
        "others kept 0.75 cores busy > 0.5",
    ]
    guard.admit(9.0)  # not strict: flagged later, not refused
    with pytest.raises(rounds.LoadTooHigh, match=r"load average 2\.00 exceeds --max-load 1\.5"):
        rounds.Guard(strict=True).admit(2.0)


def test_busy_seconds_counts_busy_fields_only() -> None:
    # user 100, nice 20, system 30, idle 5000, iowait 400, irq 4, softirq 6, steal 40 ticks: 200 busy.
    stat = "cpu  100 20 30 5000 400 4 6 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert rounds.busy_seconds(stat) == pytest.approx(200 / os.sysconf("SC_CLK_TCK"))


def test_measure_records_the_run_and_the_load_around_it() -> None:
    record = rounds.measure(rounds.Variant("noop", lambda r: {"tokens_per_s": 7.0 + r}), rounds.Guard(), 2)
    assert record["figures"] == {"tokens_per_s": 9.0}  # the round index reaches the variant
    assert set(record) >= {
        "cpu_s",
        "wall_s",
        "load_before",
        "load_after",
        "other_cpu_s",
        "other_load",
        "flags",
    }
    assert record["other_cpu_s"] >= 0


def test_same_torch_refuses_two_builds() -> None:
    one = {"version": "2.13.0+cpu", "file": "/env/lib/torch/__init__.py"}
    rounds.same_torch({"drivetrain": one, "trl": dict(one)})
    other = {"version": "2.15.0+cu132", "file": "/trl/lib/torch/__init__.py"}
    with pytest.raises(rounds.TorchMismatch, match=r"drivetrain: 2\.13\.0\+cpu at /env/lib/torch"):
        rounds.same_torch({"drivetrain": one, "trl": other})


def test_run_rounds_runs_every_variant_once_per_round_in_rotated_order() -> None:
    seen: list[tuple[str, int]] = []

    def variant(name: str) -> Any:
        return rounds.Variant(name, lambda r: seen.append((name, r)) or {"round_seen": float(r)})

    records = rounds.run_rounds([variant("a"), variant("b")], 3, rounds.Guard(max_load_before=1e9))
    assert seen == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert [(x["variant"], x["round"], x["position"]) for x in records] == [
        ("a", 0, 0),
        ("b", 0, 1),
        ("b", 1, 0),
        ("a", 1, 1),
        ("a", 2, 0),
        ("b", 2, 1),
    ]
    assert [x["figures"]["round_seen"] for x in records] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def test_warmup_runs_come_first_untimed_and_unrecorded() -> None:
    seen: list[tuple[str, int]] = []

    def variant(name: str) -> Any:
        return rounds.Variant(name, lambda r: seen.append((name, r)) or {})

    records = rounds.run_rounds(
        [variant("a"), variant("b")], 2, rounds.Guard(max_load_before=1e9), warmup_runs=1
    )
    assert seen == [("a", 0), ("b", 0), ("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert [(x["variant"], x["round"]) for x in records] == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
