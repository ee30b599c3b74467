"""``drivetrain env`` for bug reports: Python, platform, torch and its CUDA/NCCL, key libraries, and every
drivetrain plugin with its distribution and version (drivetrain-roles adds the command to core's CLI root)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from typing import Any

import click

LIBRARIES = (
    "torch",
    "tensordict",
    "transformers",
    "peft",
    "megatron-core",
    "mbridge",
    "omegaconf",
    "pluggy",
    "ray",
    "triton",
    "liger-kernel",
)
"""Distributions whose versions explain most behaviour differences (``not installed`` when absent)."""


def environment_report() -> dict[str, Any]:
    """The report as plain values (imports torch to read its CUDA, cuDNN and NCCL versions)."""
    from drivetrain_engine_core.job import plugins

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "accelerator": _torch_accelerator(),
        "plugins": {
            info.name: f"{info.distribution} {info.version} [{info.status}]" for info in plugins().plugins
        },
    }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_accelerator() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None
    return {
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "gloo_available": torch.distributed.is_gloo_available(),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as ``key: value`` lines, one section per block."""
    lines = [f"python: {report['python']}", f"platform: {report['platform']}"]
    for section in ("libraries", "accelerator", "plugins"):
        lines.append(f"{section}:")
        values = report[section] or {"(none)": ""}
        lines.extend(f"  {name}: {value}" for name, value in values.items())
    return "\n".join(lines)


@click.command("env")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def env_command(as_json: bool) -> None:
    """Print versions for bug reports: Python, torch (CUDA, cuDNN, NCCL), key libraries, every plugin."""
    report = environment_report()
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else format_report(report))


__all__ = ["LIBRARIES", "env_command", "environment_report", "format_report"]
