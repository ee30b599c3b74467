"""GPU lane: drivetrain's weight stream carried by vLLM's own CUDA IPC transport (vLLM's ``ipc`` trainer and worker
engines), its digest manifest checked against what vLLM serves before sampling, and the served log-probs against
a plain Hugging Face forward of the weights sent (fp32). Needs vLLM's CUDA build and a GPU: vLLM's ``ipc`` and
``nccl`` engines ask the accelerator for its device at their first step (ipc_engine.py:222 and :279,
nccl_common.py:203 and :255 in vLLM 0.32), which a CPU-only machine refuses. Skipped elsewhere
(``requires_cuda``); ``.ci/gpu-lane`` runs it with ``PYTHON`` set to such an environment's Python."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from drivetrain_engine_core._handoff import SentVersions, verify_served
from drivetrain_engine_core.rollout import RolloutOutput, SamplingConfig
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_engine_core.testing.policies import actor_log_probs, base_state, moved, save_policy, stream
from drivetrain_rollout_vllm import worker
from drivetrain_rollout_vllm.rollout import sampled_log_probs
from drivetrain_rollout_vllm.sampling import sampling_params
from drivetrain_rollout_vllm.transfer import LLMClient
from drivetrain_rollout_vllm.weight_source import BucketSource

PROMPTS = [[1, *range(3, 43), 5], [1, 12, 13]]
SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, seed=3)


@requires_cuda
def test_vllms_ipc_transport_carries_a_bucket_source_checked_by_its_manifest(
    servable_model_dir, tmp_path, monkeypatch
):
    import vllm
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    # NOTE: a CUDA IPC handle opens only in another process than the one that made it: vLLM's engine runs in its
    # own (multiprocessing on), and the handles it is sent hold torch classes, which its msgpack sends pickled.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = vllm.LLM(
        model=str(servable_model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        generation_config="vllm",
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=128,
        weight_transfer_config={"backend": "ipc"},
    )
    state = moved(base_state(servable_model_dir), seed=31)
    source = BucketSource(lambda: stream(SentVersions(), state, 1, device="cuda"))
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0), client=LLMClient(llm), source=source
    )
    engine.send_weights()
    served = llm.collective_rpc(worker.served_weights, args=([held.name for held in source.manifest],))[0]
    verify_served(source.manifest, served.get, version=1, rank=0)

    params = [sampling_params(SAMPLED, end_ids=(), prompt=i) for i in range(len(PROMPTS))]
    requests = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    results = llm.generate(requests, params, use_tqdm=False)
    completions = [c for r in results for c in sorted(r.outputs, key=lambda c: c.index)]
    output = RolloutOutput(
        responses=[torch.tensor(list(c.token_ids)) for c in completions],
        log_probs=[sampled_log_probs(c) for c in completions],
        version=1,
        n=SAMPLED.n,
    )
    expected = actor_log_probs(save_policy(servable_model_dir, state, tmp_path / "p"), PROMPTS, output, 0.7)
    for rolled, reference in zip(output.log_probs, expected, strict=True):
        assert (rolled - reference.to(rolled.device)).abs().max().item() <= 1e-5
