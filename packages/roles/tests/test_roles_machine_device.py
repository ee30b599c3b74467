"""The engine's default device is found without importing torch only where torch certainly sees no GPU, and
then agrees with torch."""

from __future__ import annotations

import torch
from drivetrain_roles.runtime.command_config import machine


def test_the_build_is_read_as_torch_reports_it() -> None:
    build = machine._torch_build()
    assert build is not None
    assert build["cuda"] == repr(torch.version.cuda)
    assert build["hip"] == repr(torch.version.hip)


def test_cpu_without_torch_only_where_torch_sees_no_gpu() -> None:
    assert machine.may_see_a_gpu() or not torch.cuda.is_available()
    assert machine.machine_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_cuda_build_is_asked_only_where_the_driver_loads(monkeypatch) -> None:
    monkeypatch.setattr(machine.sys, "platform", "linux")
    monkeypatch.setattr(machine, "_torch_build", lambda: {"cuda": "'13.2'", "hip": "None"})
    monkeypatch.setattr(machine, "_loads", lambda library: library == "libcuda.so.1")
    assert machine.may_see_a_gpu()
    monkeypatch.setattr(machine, "_loads", lambda library: False)
    assert not machine.may_see_a_gpu()
    monkeypatch.setattr(machine, "_torch_build", lambda: {"cuda": "None", "hip": "'6.4'"})
    assert machine.may_see_a_gpu(), "a ROCm build is always asked"
    monkeypatch.setattr(machine, "_torch_build", lambda: None)
    assert machine.may_see_a_gpu(), "an unreadable build is asked"
