"""``drivetrain ckpt merge`` shows its progress: the step's weights written of their total, on a terminal only."""

from __future__ import annotations

import io
import re
import sys

import pytest
from drivetrain_ckpt_tools.merge import merge_checkpoint


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stderr", "progress", "shown"),
    [(Terminal, True, True), (io.StringIO, True, False), (Terminal, False, False)],
)
def test_a_merge_counts_every_stored_weight_on_a_terminal_only(
    synthetic_step, source_model, tmp_path, monkeypatch, stderr, progress, shown
) -> None:
    monkeypatch.setattr(sys, "stderr", stderr())
    merge_checkpoint(synthetic_step, tmp_path / "hf", progress=progress)
    output = sys.stderr.getvalue()
    total = len(source_model.state_dict())  # what the step stores, the tied output embedding included
    if shown:
        assert re.findall(r"merge: 100%\|[^|]*\| (\d+)/(\d+)", output)[-1] == (str(total), str(total))
    else:
        assert output == ""
