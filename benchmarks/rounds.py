"""Benchmark rounds: named variants measured in interleaved, rotated rounds under a load guard (issue #49).

One run of two commands back to back says little on a shared machine: identical commands differ by more than
the effects measured. So every variant runs once per round, the order rotating from round to round (two
variants: A B, B A, A B), and what is reported is each variant's median with its range, and each ratio's median
and range taken over rounds (the ratio of round ``r``'s two runs, not a ratio of medians and never the most
favourable run).

Around every run a guard records the machine's load: the 1-minute load average before and after, and the CPU
seconds every other process spent during the run (``/proc/stat``'s busy time minus the run's own ``rusage``),
as an average number of busy cores. A run that starts above ``max_load_before`` is refused (:class:`LoadTooHigh`)
when the guard is strict, else flagged; a run during which others kept more than ``max_other_load`` cores busy
is flagged. Flagged runs stay in the JSON and are named in the summary.

A variant is a callable of the round's index (to pick a seed or a folder) returning its own figures (``{"cpu_s_per_step": ...}``), measured in this process and
its children; :func:`command` makes one from a subprocess's argv. :func:`torch_build` and :func:`same_torch`
check that the sides being compared import the same torch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Figures = dict[str, float]
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""``/proc/stat``'s cpu line: user, nice, system, irq, softirq, steal (idle and iowait are not busy)."""


class LoadTooHigh(RuntimeError):
    """The machine was busier than the guard allows before a run."""


class TorchMismatch(RuntimeError):
    """The sides of a comparison import different torch builds."""


@dataclass(frozen=True)
class Variant:
    """A named thing to measure: ``run(round)`` does the work and returns its own figures (may be empty)."""

    name: str
    run: Callable[[int], Figures]


@dataclass(frozen=True)
class Guard:
    """Load limits: ``max_load_before`` (1-minute load average at a run's start) and ``max_other_load`` (cores
    other processes kept busy during it, on average); ``strict`` refuses a run that starts above the first."""

    max_load_before: float = 1.5
    max_other_load: float = 0.5
    strict: bool = False

    def flags(self, load_before: float, other_load: float) -> list[str]:
        """What this run exceeded, in words (empty: a clean run)."""
        found = []
        if load_before > self.max_load_before:
            found.append(f"load {load_before:.2f} > {self.max_load_before} at start")
        if other_load > self.max_other_load:
            found.append(f"others kept {other_load:.2f} cores busy > {self.max_other_load}")
        return found

    def admit(self, load_before: float) -> None:
        """Refuse a strict run that starts above ``max_load_before``."""
        if self.strict and load_before > self.max_load_before:
            raise LoadTooHigh(
                f"load average {load_before:.2f} exceeds --max-load {self.max_load_before} before a run; wait for "
                "a quiet machine, or raise --max-load (the run will then be flagged, not refused)."
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The rounds' and the guard's command-line options (``--rounds``, ``--max-load``, ...)."""
    parser.add_argument("--rounds", type=int, default=3, help="rotated rounds (default 3)")
    parser.add_argument("--max-load", type=float, default=1.5, help="flag runs starting above this load")
    parser.add_argument(
        "--max-other-load", type=float, default=0.5, help="flag runs while others keep this many cores busy"
    )
    parser.add_argument("--strict-load", action="store_true", help="refuse, not flag, runs above --max-load")
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of each variant before round 0 (default 1: no round's first run pays cold caches)",
    )


def guard_from(args: argparse.Namespace) -> Guard:
    """The :class:`Guard` that :func:`add_arguments`' options describe."""
    return Guard(args.max_load, args.max_other_load, args.strict_load)


def schedule(names: Sequence[str], rounds: int) -> list[tuple[int, int, str]]:
    """``(round, position, name)`` for every run: round ``r`` runs ``names`` rotated left by ``r``."""
    if rounds < 1 or not names:
        raise ValueError(f"need at least one round and one variant, got {rounds} rounds of {list(names)}")
    plan = []
    for r in range(rounds):
        shift = r % len(names)
        order = [*names[shift:], *names[:shift]]
        plan.extend((r, position, name) for position, name in enumerate(order))
    return plan


def busy_seconds(stat: str) -> float:
    """All processes' busy CPU seconds since boot from the text of ``/proc/stat``."""
    fields = stat.splitlines()[0].split()[1:]
    ticks = sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def measure(variant: Variant, guard: Guard, round_index: int = 0) -> dict[str, Any]:
    """One guarded run of ``variant`` in round ``round_index``: its CPU and wall seconds, its figures, and the
    load around it."""
    load_before = os.getloadavg()[0]
    guard.admit(load_before)
    busy, own, started = busy_seconds(_read_stat()), own_seconds(), time.perf_counter()
    figures = variant.run(round_index)
    wall = time.perf_counter() - started
    own_cpu = own_seconds() - own
    other = max(0.0, busy_seconds(_read_stat()) - busy - own_cpu)
    other_load = other / wall if wall > 0 else 0.0
    return {
        "cpu_s": round(own_cpu, 4),
        "wall_s": round(wall, 4),
        "figures": figures,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "other_cpu_s": round(other, 3),
        "other_load": round(other_load, 3),
        "flags": guard.flags(load_before, other_load),
    }


def run_rounds(
    variants: Sequence[Variant],
    rounds: int = 3,
    guard: Guard | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    warmup_runs: int = 0,
) -> list[dict[str, Any]]:
    """Every variant once per round in rotated order; one record per run (``on_run`` sees each as it ends).

    ``warmup_runs`` untimed runs of each variant (as round 0) come first and are not recorded: the first run of a
    benchmark reads its model, data and libraries cold, and was 1.0-2.5 CPU-s dearer than its repeats, charged to
    whichever variant the schedule puts first.
    """
    by_name = {v.name: v for v in variants}
    for _ in range(warmup_runs):
        for variant in variants:
            variant.run(0)
    records = []
    for r, position, name in schedule(list(by_name), rounds):
        record = {
            "variant": name,
            "round": r,
            "position": position,
            **measure(by_name[name], guard or Guard(), r),
        }
        records.append(record)
        if on_run:
            on_run(record)
    return records


def figure(record: Mapping[str, Any], key: str) -> float | None:
    """A run's value of ``key``: one of its own figures, else ``cpu_s``/``wall_s``/``other_load``."""
    value = record["figures"].get(key, record.get(key))
    return None if value is None else float(value)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, minimum and maximum of ``values``, and the values in order of rounds."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def summary(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant, each numeric figure's :func:`spread` over rounds, and the rounds the guard flagged."""
    result: dict[str, dict[str, Any]] = {}
    for record in records:
        keys = {"cpu_s", "wall_s", "other_load", *record["figures"]}
        entry = result.setdefault(record["variant"], {"flagged_rounds": []})
        for key in sorted(keys):
            value = figure(record, key)
            if value is not None:
                entry.setdefault(key, []).append(value)
        if record["flags"]:
            entry["flagged_rounds"].append(record["round"])
    return {
        name: {k: (v if k == "flagged_rounds" else spread(v)) for k, v in entry.items()}
        for name, entry in result.items()
    }


def ratio(records: Sequence[Mapping[str, Any]], numerator: str, denominator: str, key: str) -> dict[str, Any]:
    """``numerator``'s ``key`` over ``denominator``'s, per round (rounds where either lacks it are skipped),
    with its :func:`spread`."""
    per_round: dict[int, dict[str, float]] = {}
    for record in records:
        value = figure(record, key)
        if value is not None and record["variant"] in (numerator, denominator):
            per_round.setdefault(record["round"], {})[record["variant"]] = value
    values = [
        pair[numerator] / pair[denominator]
        for _, pair in sorted(per_round.items())
        if numerator in pair and pair.get(denominator)
    ]
    if not values:
        raise ValueError(f"no round has both {numerator!r} and {denominator!r} with {key!r}")
    return spread(values)


def command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Callable[[], Figures]:
    """A variant's ``run`` that runs ``argv`` to completion (its CPU time counts as this process's children's);
    a failure raises with the command's last output."""

    def run(_: int) -> Figures:
        done = subprocess.run(list(argv), env=dict(env) if env else None, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr or done.stdout)[-3000:]
            raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({done.returncode}):\n{tail}")
        return {}

    return run


def torch_build(python: str) -> dict[str, str]:
    """The torch ``python`` imports: its version and the file it is loaded from."""
    code = "import json, torch; print(json.dumps({'version': torch.__version__, 'file': torch.__file__}))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def same_torch(builds: Mapping[str, Mapping[str, str]]) -> None:
    """Refuse a comparison whose sides (``{side: torch_build(...)}``) import different torch builds."""
    distinct = {(b["version"], os.path.realpath(b["file"])) for b in builds.values()}
    if len(distinct) > 1:
        listed = "; ".join(f"{side}: {b['version']} at {b['file']}" for side, b in builds.items())
        raise TorchMismatch(
            f"the sides import different torch builds ({listed}); run both from one environment (install the "
            "other side's packages into it) so that the comparison measures the trainers, not the builds."
        )
