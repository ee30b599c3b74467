"""Weight streams through vLLM's own weight-transfer protocol (``rollout.options.weight_transfer=vllm``): vLLM's
worker session (start/update/finish), its transfer-engine factory and update window, drivetrain's digests checked
in vLLM's worker before anything is loaded. Served log-probs against a plain Hugging Face forward of the weights
sent (fp32). One vLLM instance for the module; runs in the vLLM environment, skipped where vLLM is absent."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("vllm")

from drivetrain_engine_core._handoff import SentVersions, verify_served
from drivetrain_engine_core.backend import EngineStateError
from drivetrain_engine_core.job import create_rollout
from drivetrain_engine_core.rollout import HandoffError, SamplingConfig
from drivetrain_engine_core.testing.policies import actor_log_probs, base_state, moved, save_policy, stream
from drivetrain_rollout_vllm.transfer import DrivetrainTrainerInitInfo, LLMClient
from drivetrain_rollout_vllm.transfer_engine import DrivetrainWeightTransferEngine
from drivetrain_rollout_vllm.weight_source import BucketSource
from vllm.distributed.weight_transfer import ParamMeta, WeightTransferTrainerFactory

SHARED = list(range(3, 43))  # 40 tokens: more than a KV block, shared by two prompts
PROMPTS = [[1, *SHARED, 5, 6], [1, *SHARED, 9], [1, 12, 13]]
SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, seed=3)
VERSIONS = itertools.count(1)
OPTIONS = {"weight_transfer": "vllm", "max_model_len": 128, "kv_cache_memory_bytes": 1 << 26}


@pytest.fixture(scope="module")
def rollout(servable_model_dir):
    return create_rollout("vllm", model_path=str(servable_model_dir), options=OPTIONS)


def served_matches_hf(rollout, model_dir, state, target):
    """The rollout's log-probs of a sampled batch equal the plain HF forward of ``state`` within 1e-5."""
    output = rollout.generate(PROMPTS, SAMPLED)
    expected = actor_log_probs(save_policy(model_dir, state, target), PROMPTS, output, SAMPLED.temperature)
    gap = max(
        (rolled - ref).abs().max().item() for rolled, ref in zip(output.log_probs, expected, strict=True)
    )
    assert gap <= 1e-5, gap
    return output


def test_an_update_through_vllms_protocol_serves_the_weights_sent(rollout, servable_model_dir, tmp_path):
    engines = rollout.llm.collective_rpc(lambda worker: type(worker.weight_transfer_engine).__name__)
    assert engines == [DrivetrainWeightTransferEngine.__name__]
    sender, state, version = SentVersions(), moved(base_state(servable_model_dir), seed=21), next(VERSIONS)
    assert rollout.update_weights(stream(sender, state, version)) == version
    # vLLM's finish_weight_update recorded drivetrain's version as its own weight version.
    assert rollout.llm.get_weight_version() == str(version)
    assert rollout.last_sync.verified  # the first version is read back from what vLLM serves
    output = served_matches_hf(rollout, servable_model_dir, state, tmp_path / "policy")
    assert output.version == version
    # vLLM reloads the whole model each version: no delta is asked for, and one sent anyway is refused.
    assert rollout.delta_base is None
    delta = stream(
        sender, moved(state, seed=22, names=["lm_head.weight"]), next(VERSIONS), base_version=version
    )
    with pytest.raises(HandoffError, match=rf"as a delta on version {version}.*weight_transfer=drivetrain"):
        rollout.update_weights(delta)
    # A stream that misses a tensor is refused before vLLM rebuilds its layers from it.
    missing = {name: tensor for name, tensor in state.items() if name != "model.norm.weight"}
    with pytest.raises(HandoffError, match=r"missed 1 of the model's tensors \(\['model.norm.weight'\]\)"):
        rollout.update_weights(stream(SentVersions(), missing, next(VERSIONS)))
    assert rollout.llm.get_weight_version() == str(version)


def corrupting(client, name):
    """``client.update_weights`` as a transport that flips one byte of ``name`` on its way to vLLM's worker."""
    send = client.update_weights

    def update_weights(info):
        if name in info["names"]:
            index = info["names"].index(name)
            buffer = info["buffer"].clone()
            buffer[info["offsets"][index]] ^= 1
            info = {**info, "buffer": buffer}
        send(info)

    return update_weights


def test_a_tensor_corrupted_on_the_way_to_vllms_worker_is_refused_before_serving(
    rollout, servable_model_dir, tmp_path, monkeypatch
):
    served_before, vllm_before = rollout.weights_version, rollout.llm.get_weight_version()
    name = "model.layers.1.self_attn.k_proj.weight"
    client = rollout._transfer.client
    monkeypatch.setattr(client, "update_weights", corrupting(client, name))
    corrupted = moved(base_state(servable_model_dir), seed=23)
    with pytest.raises(HandoffError, match=rf"{name} reached vLLM's worker with other bytes than were sent"):
        rollout.update_weights(stream(SentVersions(), corrupted, next(VERSIONS)))
    assert rollout.weights_version == served_before
    assert rollout.llm.get_weight_version() == vllm_before  # vLLM's session ended without a version
    with pytest.raises(EngineStateError, match="failed midway"):
        rollout.generate(PROMPTS, SAMPLED)
    monkeypatch.undo()
    # vLLM's update window was closed on the refusal: the next complete version is served exactly.
    state, version = moved(base_state(servable_model_dir), seed=24), next(VERSIONS)
    assert rollout.update_weights(stream(SentVersions(), state, version)) == version
    served_matches_hf(rollout, servable_model_dir, state, tmp_path / "policy")


def test_a_bucket_source_feeds_vllms_trainer_engine_and_its_manifest_checks_what_is_served(
    rollout, servable_model_dir
):
    """The trainer-side path vLLM's nccl/ipc engines take on GPUs: ``WeightTransferTrainerFactory`` builds the
    engine for the init info's backend, ``send_weights()`` replays a ``WeightSource`` each round."""
    states = {}

    def round_buckets():
        version = next(VERSIONS)
        states[version] = moved(base_state(servable_model_dir), seed=version)
        return stream(SentVersions(), states[version], version)

    source = BucketSource(round_buckets)
    with pytest.raises(HandoffError, match="no layout was declared nor a round sent yet"):
        source.metadata()
    engine = WeightTransferTrainerFactory.trainer_init(
        DrivetrainTrainerInitInfo(rank=0), client=LLMClient(rollout.llm), source=source
    )
    for _ in range(2):  # each round a fresh stream, a newer version
        engine.send_weights()
        assert rollout.llm.get_weight_version() == str(source.version)
        verify_served(
            source.manifest, lambda n: rollout.served_weights([n]).get(n), version=source.version, rank=0
        )
    state = states[source.version]
    assert source.metadata() == [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    # vLLM's default grouping of a source (one group per decoder layer) reads the same tensors.
    grouped = {n: t for names, tensors in source.iter_groups() for n, t in zip(names, tensors, strict=True)}
    assert grouped.keys() == state.keys()


def test_a_bucket_source_refuses_tensors_its_declared_layout_does_not_list(servable_model_dir):
    state = base_state(servable_model_dir)
    layout = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    layout[2] = ParamMeta(layout[2].name, torch.bfloat16, layout[2].shape)
    source = BucketSource(lambda: stream(SentVersions(), state, 1), layout=layout)
    with pytest.raises(HandoffError, match=rf"tensor 2 is ParamMeta\(name='{layout[2].name}'.*float32"):
        list(source)
