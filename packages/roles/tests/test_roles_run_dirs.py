"""New run directories: each launch claims its own, even when several start in the same second."""

from __future__ import annotations

import datetime

from drivetrain_roles.jobs import launch


class _FrozenClock:
    """``datetime`` as ``new_output_dir`` reads it, stopped at one second."""

    UTC = datetime.UTC

    class datetime:  # stands in for the module's class
        @staticmethod
        def now(tz):
            return datetime.datetime(2026, 11, 23, 13, 2, 11, tzinfo=tz)


def test_launches_in_the_same_second_get_their_own_run_directories(tmp_path, monkeypatch) -> None:
    """Run directories were named to the second and created later with exist_ok: a sweep starting jobs
    together put them in one folder (each other's config.yaml, metrics.jsonl, checkpoints, pruning)."""
    monkeypatch.setattr(launch, "datetime", _FrozenClock)
    monkeypatch.delenv("RANK", raising=False)
    dirs = [launch.new_output_dir("sft", tmp_path) for _ in range(3)]
    assert [d.name for d in dirs] == ["sft-20261123-130211", "sft-20261123-130211-2", "sft-20261123-130211-3"]
    assert all(d.is_dir() for d in dirs)
    monkeypatch.setenv("RANK", "1")  # a rank of an outer launcher names it only; rank 0's claim is the run's
    assert launch.new_output_dir("sft", tmp_path).name == "sft-20261123-130211"
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name for d in dirs]
