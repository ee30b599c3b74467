"""The device a command's engine runs on unless ``engine.device`` is given, found without importing torch where
the answer is certain.

``cuda`` where torch sees a GPU, else ``cpu`` (what users of the Hugging Face Trainer and TRL expect; a GPU is
never left idle). Asking torch costs its import, seconds on a laptop and 8-30 s on two busy cores, before
``--help-config`` or ``--print-config`` prints a line; where torch certainly sees no GPU it is not asked.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import sys
from pathlib import Path

_BUILD_LINE = re.compile(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def machine_device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``; torch is imported only where it may see one."""
    if "torch" not in sys.modules and not may_see_a_gpu():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def may_see_a_gpu() -> bool:
    """False only where torch certainly sees no GPU: a build without CUDA and ROCm (PyTorch's CPU wheels,
    macOS), or a CUDA build on Linux where NVIDIA's driver library does not load (CUDA finds devices through
    ``libcuda.so.1``, loaded the same way). Anything unknown: true, and torch is asked."""
    build = _torch_build()
    if build is None or build.get("hip", "None") != "None":
        return True
    if build.get("cuda", "None") == "None":
        return False
    return not sys.platform.startswith("linux") or _loads("libcuda.so.1")


def _torch_build() -> dict[str, str] | None:
    """The ``cuda`` and ``hip`` versions torch was built for, as written in its ``version.py`` (``'None'``
    for neither), read without importing torch; ``None`` where that file cannot be read."""
    spec = importlib.util.find_spec("torch")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        return None
    try:
        text = (Path(next(iter(locations))) / "version.py").read_text()
    except OSError:
        return None
    return dict(_BUILD_LINE.findall(text))


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


__all__ = ["machine_device", "may_see_a_gpu"]
