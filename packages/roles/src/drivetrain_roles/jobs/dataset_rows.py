"""Rows of a Hugging Face ``datasets`` source, as TRL's ``--dataset_name`` reads one: a folder written by
``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose split is picked), another folder of data files (a
clone of a Hub dataset repository: its parquet/jsonl files, splits named by file), or a Hub dataset id
(``trl-lib/Capybara``, with its config and split).

``datasets`` is imported only when such a source is given; ``.parquet`` and ``.jsonl`` files keep their own
readers (:func:`~.data.read_rows`), whose messages name the file and line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import DrivetrainError

SUPPORTED_SOURCES = (
    "data.train_files and data.val_files take .parquet or .jsonl files; folders written by datasets' save_to_disk "
    "(a DatasetDict's split chosen by data.train_split / data.val_split) or holding a dataset's data files; and "
    "Hugging Face Hub dataset ids such as trl-lib/Capybara (with data.dataset_config for a named config and "
    "data.train_split / data.val_split)"
)
"""What a data source may be, for the messages that refuse one."""

_SAVED_MARKERS = ("dataset_dict.json", "state.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".txt", ".arrow")


class DatasetSourceError(DrivetrainError, ValueError):
    """A ``datasets`` source cannot be read as configured; the message names it, the supported forms and the fix."""


def is_dataset_source(source: str) -> bool:
    """Whether ``source`` is read with ``datasets``: an existing folder, or a name shaped like a Hub dataset id
    that is no local path (``org/name`` or ``name``, without a data file's extension)."""
    path = Path(source)
    if path.is_dir():
        return True
    return (
        not path.exists()
        and _HUB_ID.fullmatch(source) is not None
        and not source.lower().endswith(_FILE_SUFFIXES)
    )


def dataset_rows(source: str, *, split: str, dataset_config: str | None) -> list[dict[str, Any]]:
    """The rows of ``split`` of the dataset ``source`` (a folder or a Hub id) as dicts.

    Raises:
        DatasetSourceError: the folder or Hub dataset cannot be loaded (not found, not cached while offline, an
            unknown config or split); the message names the source, the reason and the supported forms.
    """
    import datasets

    try:
        if any((Path(source) / marker).is_file() for marker in _SAVED_MARKERS):
            loaded = _split_of(datasets.load_from_disk(source), split, source)
        else:
            loaded = datasets.load_dataset(source, name=dataset_config, split=split)
    except (OSError, ValueError) as e:  # ConnectionError and FileNotFoundError are OSErrors
        reason = str(e).split("\n")[0][:300]
        raise DatasetSourceError(
            f"data source {source!r} (split {split!r}{_config(dataset_config)}) could not be loaded with "
            f"datasets: {type(e).__name__}: {reason}. {SUPPORTED_SOURCES}. A Hub dataset must be reachable or "
            "in this machine's cache (HF_HUB_OFFLINE=1 reads the cache only)."
        ) from e
    return loaded.to_list()


def _split_of(loaded: Any, split: str, source: str) -> Any:
    """A saved ``Dataset`` itself, or the ``split`` of a saved ``DatasetDict``."""
    if not hasattr(loaded, "keys"):
        return loaded
    if split not in loaded:
        raise DatasetSourceError(
            f"data source {source!r} is a DatasetDict with splits {sorted(loaded)}, without {split!r}; set "
            "data.train_split (or data.val_split for data.val_files) to one of them."
        )
    return loaded[split]


def _config(dataset_config: str | None) -> str:
    return f", config {dataset_config!r}" if dataset_config is not None else ""


__all__ = ["SUPPORTED_SOURCES", "DatasetSourceError", "dataset_rows", "is_dataset_source"]
