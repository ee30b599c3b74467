"""What the roles tests share: a local Ray cluster, the arithmetic prompts the RL tests sample from, the small
``grpo``/``ppo`` config their parity tests run on and a run folder's state entry for entry.

NOTE: the helpers are fixtures because under ``--import-mode=importlib`` a test module can import neither
conftest nor a sibling module.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.jobs.default_assets import arithmetic_examples

SMALL_RL = (
    "engine.micro_batch.micro_batch_size=3",
    "engine.micro_batch.max_tokens=null",
    "rollout.max_new_tokens=4",
)
"""Micro-batches of 3 sequences (no token budget) and 4 new tokens: small enough for parity tests on one CPU."""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster of 2 CPUs for one test module (skipped without Ray), whatever ``RAY_ADDRESS`` says."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


def _arithmetic_prompts(tokenizer: Any, count: int) -> list[Example]:
    return [
        Example(
            prompt_ids=tokenizer(e["prompt"])["input_ids"],
            response_ids=[],
            prompt_text=e["prompt"],
            response_text=e["response"],
        )
        for e in arithmetic_examples(count, seed=1)
    ]


@pytest.fixture(scope="session")
def arithmetic_prompts() -> Callable[[Any, int], list[Example]]:
    """``prompts(tokenizer, count)``: the first ``count`` arithmetic problems (seed 1) as prompts to sample from,
    the answer as ``response_text`` (what the exact-answer reward compares), no response ids."""
    return _arithmetic_prompts


def _small_rl_config(load_config: Callable[..., Any], model_path: str | Path, *overrides: str) -> Any:
    return load_config(None, [f"model.path={model_path}", *SMALL_RL, *overrides])


@pytest.fixture(scope="session")
def small_rl_config() -> Callable[..., Any]:
    """``config(load_config, model_path, *overrides)``: the config of ``grpo`` or ``ppo`` (the command's
    ``load_config``) for ``model_path`` with :data:`SMALL_RL`'s sizes, ``overrides`` on top."""
    return _small_rl_config


FolderState = dict[str, tuple[int, int, int, bytes | str | None]]


def _folder_state(run: Path) -> FolderState:
    """Every entry under ``run``: its mode (kind), size, modification time and bytes (a link: its target)."""
    state = {}
    for path in sorted(run.rglob("*")):
        info = path.lstat()
        content = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else None
        state[str(path.relative_to(run))] = (info.st_mode, info.st_size, info.st_mtime_ns, content)
    return state


@pytest.fixture(scope="session")
def folder_state() -> Callable[[Path], FolderState]:
    """``state(run)``: every entry of the run folder ``run`` (mode, size, mtime, bytes or link target), what a
    refused ``--resume`` must leave as it was."""
    return _folder_state


def _plotted(curve: Path) -> dict[str, dict[str, Any]]:
    """The series ``curve`` (a run's PNG) holds, by metric, each checked against the run's ``metrics.jsonl``:
    as many points as finite records of that metric, the last the last recorded value."""
    import math

    from drivetrain_roles.jobs.curves import read_curve_series
    from drivetrain_roles.jobs.metrics import read_records

    records = read_records(curve.parent / "metrics.jsonl")
    series = {entry["key"]: entry for entry in read_curve_series(curve)}
    for key, entry in series.items():
        values = [r[key] for r in records if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        assert (entry["points"], entry["last"]) == (len(values), values[-1]), key
    return series


@pytest.fixture(scope="session")
def plotted() -> Callable[[Path], dict[str, dict[str, Any]]]:
    """``plotted(curve)``: ``{metric: {"panel", "key", "label", "points", "last"}}`` of a run's curve PNG, read
    from its metadata (not its pixels) and checked against the run's ``metrics.jsonl``."""
    return _plotted
