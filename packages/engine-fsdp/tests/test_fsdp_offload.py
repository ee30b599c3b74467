"""Offload of the FSDP engine: gradients freed (not moved), host buffers reused, training unchanged."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, init_distributed
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch
from drivetrain_engine_core.testing.device import device_under_test, requires_cuda
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_fsdp import offload
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from drivetrain_engine_fsdp.offload import HostBuffers
from drivetrain_engine_fsdp.shards import sharded_like
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

OFFLOAD = {"param_offload": True, "optimizer_offload": True}
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "qwen2", arch="qwen2")


def make_engine(path, **engine):
    instance = FSDPEngine(
        model_config=ModelConfig(path=str(path)),
        engine_config=FSDPEngineConfig(
            device=device_under_test(), micro_batch=MicroBatchConfig(micro_batch_size=2), **engine
        ),
        optimizer_config=OPTIMIZER,
    )
    instance.initialize()
    return instance


def batch(seed):
    return random_batch(vocab_size=64, prompt_lengths=[3, 5, 2], response_lengths=[4, 2, 6], seed=seed)


def grads(engine):
    return [p.grad for p in engine.module.parameters()]


def test_offloaded_steps_equal_resident_steps(model_dir):
    resident, offloaded = make_engine(model_dir), make_engine(model_dir, **OFFLOAD)
    for seed in (1, 2, 3):
        losses = []
        for engine in (resident, offloaded):
            with engine.train_mode():
                output = engine.train_batch(batch(seed), token_mean_nll)
            losses.append((output.loss, output.metrics["grad_norm"]))
        assert losses[1] == pytest.approx(losses[0], rel=1e-6, abs=0)


def test_gradients_are_freed_after_the_step_and_kept_before_it(model_dir):
    engine = make_engine(model_dir, **OFFLOAD)
    with engine.train_mode():
        engine.train_batch(batch(1), token_mean_nll)
    assert all(g is None for g in grads(engine))  # the step consumed them: freed, not moved
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(batch(2), token_mean_nll)
    kept = grads(engine)
    assert any(g is not None for g in kept)  # no step yet: a caller may still step on them
    with engine.train_mode():
        engine.optimizer_step()
    with engine.train_mode():
        pass
    assert all(g is None for g in grads(engine))


def test_resident_engine_keeps_its_gradients(model_dir):
    engine = make_engine(model_dir)
    with engine.train_mode():
        engine.train_batch(batch(1), token_mean_nll)
    assert any(g is not None for g in grads(engine))


def test_host_buffers_are_allocated_once_and_reused():
    buffers = HostBuffers()
    first = buffers.stash((0, "exp_avg"), torch.arange(6.0))
    second = buffers.stash((0, "exp_avg"), torch.arange(6.0) * 2)
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(second, torch.arange(6.0) * 2)


def test_offloaded_state_of_a_cuda_mesh_stays_in_its_host_buffer():
    """An offloaded DTensor moment of a CUDA mesh wraps its host buffer in place (regression: ``from_local``
    moved the buffer straight back to the mesh's device, so the optimizer offload freed nothing on a GPU).
    Runs on CPU: the mesh only names cuda (no backend) and the moment is rewrapped as
    ``move_optimizer_state`` does after stashing it."""
    init_distributed(device_under_test(), 60.0)  # a one-rank default group, as later engines of the run need
    mesh = DeviceMesh("cuda", [0], _init_backend=False)
    moment = DTensor.from_local(torch.zeros(4, device="meta"), mesh, [Shard(0)], run_check=False)
    buffer = HostBuffers().stash((0, "exp_avg"), torch.arange(4.0))
    offloaded = sharded_like(moment, buffer)
    assert isinstance(offloaded, DTensor) and offloaded.device_mesh.device_type == "cuda"
    assert offloaded.placements == (Shard(0),) and offloaded.shape == (4,)
    assert offloaded.to_local().device.type == "cpu" and offloaded.to_local().data_ptr() == buffer.data_ptr()


def offloaded_locals(engine):
    """The local tensors of every offloaded parameter and of one optimizer moment."""
    params = [p.to_local() for p in engine.module.parameters()]
    return params, next(iter(engine.optimizer.state.values()))["exp_avg"].to_local()


def test_offloaded_parameters_live_in_the_reused_host_buffers(model_dir):
    """Parked parameters are the engine's host buffers (one per tensor, a tied weight once) and stay there
    across steps; FSDP2 re-registers them (the steps equal resident ones in the test above)."""
    engine = make_engine(model_dir, **OFFLOAD)
    pointers = []
    for seed in (1, 2):
        with engine.train_mode():
            engine.train_batch(batch(seed), token_mean_nll)
        params, _ = offloaded_locals(engine)
        assert all(engine.placement.param_buffers.holds(local) for local in params)
        pointers.append([local.data_ptr() for local in params])
    assert pointers[0] == pointers[1]
    assert len(engine.placement.param_buffers._buffers) == len(
        {id(p) for p in engine.module.parameters()}
    ) + len(list(engine.module.buffers()))


@requires_cuda
def test_offload_reuses_pinned_buffers_across_steps(model_dir):
    """Host buffers are pinned and reused; the optimizer state's load is left to a side stream (its arrival
    is awaited by the optimizer step; the steps equal resident ones in the first test)."""
    engine = make_engine(model_dir, **OFFLOAD)
    pointers = []
    for seed in (1, 2):
        with engine.train_mode():
            assert engine.placement._optimizer_arrival is not None
            engine.train_batch(batch(seed), token_mean_nll)
            assert engine.placement._optimizer_arrival is None
        params, state = offloaded_locals(engine)
        assert all(t.device.type == "cpu" and t.is_pinned() for t in [*params, state])
        pointers.append([t.data_ptr() for t in [*params, state]])
    assert pointers[0] == pointers[1]
    metrics = engine.transfer_metrics
    assert metrics["perf/offload_bytes"] > 0 and metrics["perf/load_bytes"] > 0
    assert metrics["perf/offload_s"] > 0 and metrics["perf/load_s"] > 0


def test_moving_state_to_the_host_waits_for_the_compute_device(monkeypatch):
    """``engine.to("cpu")`` copies optimizer state non-blocking, so it must wait for the compute device (the
    copies are queued there), not for the target (regression: it waited for "cpu", a no-op, so the state could
    be read on the host before it landed). Runs on CPU: the placement only names cuda; the waits are recorded."""
    from drivetrain_engine_fsdp.placement import Placement

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    waited = []
    monkeypatch.setattr(offload, "synchronize", waited.append)
    Placement(module, optimizer, device="cuda", home_device="cuda").to(
        "cpu", model=False, optimizer=True, grad=False
    )
    assert waited == ["cuda"]


def test_waking_an_engine_under_the_cpu_offload_policy_keeps_its_state_on_the_host(monkeypatch):
    """Under FSDP2's CPU offload policy parameters and optimizer state live on the host during compute; a
    wake-up ``engine.to("cuda")`` moved them to the GPU (FSDP2 then re-pinned the parameters to the host
    beside CUDA moments and gradients: the next step failed on mixed devices). The compute device means the
    home device. Runs on CPU: the placement only names cuda; the moves are recorded."""
    from drivetrain_engine_fsdp.placement import Placement

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    moves = []
    monkeypatch.setattr(offload, "move_parameters", lambda module, device: moves.append(("params", device)))
    monkeypatch.setattr(
        offload, "move_optimizer_state", lambda optimizer, device: moves.append(("optimizer", device))
    )
    monkeypatch.setattr(offload, "synchronize", lambda device: None)
    placement = Placement(module, optimizer, device="cuda", home_device="cpu")
    placement.to("cuda", model=True, optimizer=True, grad=False)
    assert moves == [("params", "cpu"), ("optimizer", "cpu")]
    assert not placement.params_on_cpu and not placement.optimizer_on_cpu  # at home, not offloaded
