"""The CPU-compat layer: the only place where drivetrain changes third-party behaviour (decision record 0015).

megatron-core assumes CUDA everywhere: it allocates with ``device=torch.cuda.current_device()``, calls
``module.cuda()``, checks ``param.type() == "torch.cuda.FloatTensor"``, synchronises streams and keeps its
tensor-parallel RNG streams as CUDA generator states. None of that is needed for the maths, so on a machine
without CUDA (tests, CI) these shims make the same code run on CPU over gloo:

1. ``_CpuDeviceMode`` (a ``TorchFunctionMode``): rewrites ``device="cuda"`` / ``cuda:N`` / integer ordinals
   in tensor factories and ``.to()`` to ``cpu``; makes ``Tensor.cuda()`` a no-op; makes the no-argument
   ``Tensor.type()`` report ``torch.cuda.<Type>`` so that megatron's dtype checks accept CPU tensors.
2. ``torch.cuda`` stubs: ``current_device`` returns the CPU device (megatron uses it only as a device
   argument; an ordinal would need shim 1, which is off while a backward runs megatron's autograd functions:
   a mode is disabled inside its own handler), ``synchronize`` and ``empty_cache`` do nothing,
   ``current_stream`` / ``Stream`` / ``Event`` hand out inert objects.
3. ``_CpuRNGStatesTracker``: megatron's tensor-parallel RNG tracker with CPU generator states, installed as
   megatron's global tracker (weights are loaded from Hugging Face afterwards, and dropout is off in the
   tests, so only the bookkeeping matters).
4. The all-to-all token dispatcher of mixture-of-experts layers (expert parallelism): its host copies of the
   per-rank token counts (``maybe_move_tensor_to_cpu(..., as_numpy=True)``) leave a CPU tensor untouched, a
   tensor that ``all_to_all_single`` refuses as split sizes; :func:`_install_host_split_sizes` returns them
   as the NumPy arrays a CUDA run gets. Its copy stream's ``record_event`` hands out an inert event (shim 2).

It is applied explicitly by the engine, once per process, only when the engine device is ``cpu`` and CUDA
is absent; it is never applied on GPU machines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_FACTORY_KWARG = "device"
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _to_cpu_device(device: Any) -> Any:
    """``cpu`` for anything that names a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device``, ordinals)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuDeviceMode(TorchFunctionMode):
    """Redirect CUDA placements to CPU and report CPU tensors as ``torch.cuda.*`` types (shim 1)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype) or func(*args)
        if _FACTORY_KWARG in kwargs:
            kwargs[_FACTORY_KWARG] = _to_cpu_device(kwargs[_FACTORY_KWARG])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _InertStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: every method is a no-op (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    def record_event(self, *args: Any, **kwargs: Any) -> _InertStream:
        """An inert event: megatron's all-to-all token dispatcher records one and later synchronises on it."""
        del args, kwargs
        return _InertStream()


@contextlib.contextmanager
def _null_stream(*args: Any, **kwargs: Any) -> Iterator[None]:
    del args, kwargs
    yield


def _stub_torch_cuda() -> None:
    """Shim 2: CUDA runtime calls that megatron makes for placement and stream bookkeeping only."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment, return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    # The shim deliberately returns a stand-in, not a torch.cuda.Stream (one cannot be built without CUDA).
    torch.cuda.current_stream = lambda *args, **kwargs: _InertStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *args, **kwargs: _InertStream()  # type: ignore[assignment]
    torch.cuda.Stream = _InertStream  # type: ignore[misc, assignment]
    torch.cuda.Event = _InertStream  # type: ignore[misc, assignment]
    torch.cuda.stream = _null_stream  # type: ignore[assignment]


def _install_cpu_rng_tracker() -> None:
    """Shim 3: a tensor-parallel RNG tracker whose named streams are CPU generator states."""
    from megatron.core.tensor_parallel import random as mcore_random

    class _CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked.")
            self._is_initialized = True
            self.seeds_.add(seed)
            generator = torch.Generator().manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} is not tracked; tracked: {sorted(self.states_)}.")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mcore_random._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _install_host_split_sizes() -> None:
    """Shim 4: the token dispatcher's host copies as NumPy arrays for CPU tensors too (the all-to-all's split
    sizes must be a sequence of integers)."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        del record_stream  # CPU work is synchronous: no stream to record
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.cpu()
            return tensor.numpy() if as_numpy else tensor
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def cpu_compat_needed(device: str) -> bool:
    """Whether the engine must apply the shims: a CPU engine on a machine without CUDA."""
    return device == "cpu" and not torch.cuda.is_available()


def apply_cpu_compat() -> None:
    """Apply every shim once per process (idempotent); call before building any megatron object."""
    global _APPLIED
    if _APPLIED:
        return
    _stub_torch_cuda()
    _install_cpu_rng_tracker()
    _install_host_split_sizes()
    # The mode stays active for the life of the process: megatron allocates lazily (buffers, p2p shapes).
    _CpuDeviceMode().__enter__()
    _APPLIED = True


def seed_cpu_rng_tracker(seed: int, tensor_parallel_rank: int) -> None:
    """Seed the tracked streams the way ``model_parallel_cuda_manual_seed`` does, on CPU generators."""
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tensor_parallel_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
