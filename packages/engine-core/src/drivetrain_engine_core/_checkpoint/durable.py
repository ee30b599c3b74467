"""fsync helpers: what makes a published step survive a power loss, not only a killed process.

A rename is durable only once the directory holding it is fsynced, and a file's contents only once the file
is; ``os.replace`` alone orders nothing on disk. The publish sequence (:mod:`.publish`) calls these in the
order files -> manifest -> step directory -> root (rename) -> ``latest`` -> root.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush one file's contents to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (creations, renames, deletions inside it) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory bottom-up, ``root`` last."""
    directories = [root]
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            directories.append(path)
        elif path.is_file():
            fsync_file(path)
    for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(directory)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to a hidden sibling, fsync it, and rename it over ``path`` (the directory is not fsynced)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    fsync_file(temporary)
    os.replace(temporary, path)
