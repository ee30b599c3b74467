"""Router replay (R3): the ``hf`` rollout records each token's routed experts, the FSDP actor replays them.

References written out on plain Hugging Face models, not drivetrain's replay hooks
(``drivetrain_engine_core.testing.routing``, shared with the Megatron tests): the routing of a plain forward
(``output_router_logits``, top-k of the softmax) and, after an update, a plain forward whose routers are
forced to the record by the R3 formula (softmax of the live logits at the recorded experts, renormalised as
Qwen3-MoE's ``norm_topk_prob`` says). One process, the tiny Qwen3-MoE (4 experts, top-2), fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from drivetrain_engine_core.backend import BatchError, ConfigError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, engine_config_from_dict, make_batch
from drivetrain_engine_core.kit import NOT_RECORDED, ROUTED_EXPERTS
from drivetrain_engine_core.rollout import RolloutOutput, SamplingConfig
from drivetrain_engine_core.testing import (
    TinyTorchEngine,
    forced_log_probs,
    make_tiny_model_dir,
    plain_hf_top_k,
)
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.rl.router_replay import check_router_replay
from drivetrain_roles.rollout.hf import HFRollout
from drivetrain_roles.workers.dispatch import WorkerTopology
from drivetrain_roles.workers.generation import merged_output
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13, 4, 8]]  # different lengths: the prefill is left-padded
SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=5, seed=3, record_routed_experts=True)
TOP_K = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")


def make_engine(model_dir, layout="packed"):
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir), use_remove_padding=layout == "packed"),
        engine_config=engine_config_from_dict(
            {"backend": "fsdp", "device": "cpu", "micro_batch": {"micro_batch_size": 2}}
        ),
        optimizer_config=OptimizerConfig(lr=0.5, clip_grad=None),
    )
    engine.initialize()
    return engine


def sequences_of(output):
    prompts = [PROMPTS[i // output.n] for i in range(len(output.responses))]
    return [torch.tensor(p + r.tolist()) for p, r in zip(prompts, output.responses, strict=True)]


def replay_batch(output, routes=None):
    return make_batch(sequences_of(output), **{ROUTED_EXPERTS: routes or output.routed_experts})


def infer(engine, batch):
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs["log_probs"]


def test_recorded_routes_are_plain_hf_routing_and_replay_changes_nothing_on_the_same_weights(model_dir):
    rollout = HFRollout(model_path=str(model_dir))
    output = rollout.generate(PROMPTS, SAMPLING)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for sequence, record, prompt in zip(
        sequences_of(output), output.routed_experts, [PROMPTS[i // 2] for i in range(6)], strict=True
    ):
        assert record.shape == (len(sequence), reference.config.num_hidden_layers, TOP_K)
        # Every token the rollout read, prompt (its prefill) and response (its decode steps), is routed as a
        # plain HF forward of the whole sequence routes it; the last token was never read.
        expected = plain_hf_top_k(reference, sequence)
        assert torch.equal(record[:-1].long(), expected[:-1])
        assert (record[-1] == NOT_RECORDED).all()
        # Prompt tokens hold the prefill's routing: that of the prompt alone (left padding changes nothing).
        assert torch.equal(record[: len(prompt)].long(), plain_hf_top_k(reference, torch.tensor(prompt)))
    for layout in ("packed", "padded"):
        engine = make_engine(model_dir, layout)
        live = infer(engine, make_batch(sequences_of(output)))
        replayed = infer(engine, replay_batch(output))
        assert torch.equal(replayed.values(), live.values())  # bit for bit


def experts_used(engine):
    """Capture the top-k indices every expert block of ``engine`` computes with, per layer (a pre-hook on the
    experts, after any replay of the router's output)."""
    seen = {}
    for name, module in engine.module.named_modules():
        if name.endswith("mlp.experts"):
            layer = int(name.split("layers.")[1].split(".")[0])
            module.register_forward_pre_hook(lambda m, args, layer=layer: seen.__setitem__(layer, args[1]))
    return seen


def test_after_an_update_the_actor_routes_through_the_recorded_experts(model_dir):
    rollout = HFRollout(model_path=str(model_dir))
    output = rollout.generate(PROMPTS, SAMPLING)
    engine = make_engine(model_dir)
    batch = replay_batch(output)
    with engine.train_mode():
        for _ in range(
            3
        ):  # a large step moves the routers: some recorded choices are no longer the live ones
            engine.train_batch(
                batch,
                lambda out, mb, ctx: (
                    -(out["log_probs"] * mb["loss_mask"]).sum() / ctx.global_token_count,
                    {},
                ),
            )
    rollout.update_weights(engine.weight_buckets(version=1))
    updated = rollout.model
    sequences, changed = sequences_of(output), 0
    for sequence, record in zip(sequences, output.routed_experts, strict=True):
        live = plain_hf_top_k(updated, sequence)[:-1].sort(-1).values
        changed += int((live != record[:-1].long().sort(-1).values).any(-1).sum())
    assert changed > 0, "the update did not change any routing; the test proves nothing"
    seen = experts_used(engine)
    for sequence, record in zip(sequences, output.routed_experts, strict=True):
        single = make_batch([sequence], **{ROUTED_EXPERTS: [record]})
        replayed = infer(engine, single).values()
        for layer in range(record.shape[1]):
            assert torch.equal(seen[layer][:-1], record[:-1, layer].long())
        expected = forced_log_probs(updated, sequence, record)
        torch.testing.assert_close(replayed[1:], expected, rtol=0, atol=1e-5)


def test_routes_of_another_model_are_refused(model_dir):
    engine = make_engine(model_dir)
    routes = [torch.zeros(4, 3, TOP_K, dtype=torch.int16)]  # the tiny model has 2 layers
    with pytest.raises(
        BatchError, match=r"records 3 layers x top-2 per token, but the model routes 2 layers"
    ):
        infer(engine, make_batch([torch.tensor([1, 5, 6, 7])], **{ROUTED_EXPERTS: routes}))


def test_a_rollout_asked_to_record_a_dense_model_names_the_option(tmp_path):
    rollout = HFRollout(model_path=str(make_tiny_model_dir(tmp_path, arch="qwen2")))
    with pytest.raises(BatchError, match=r"rollout.router_replay=disabled"):
        rollout.generate(PROMPTS, SAMPLING)


def test_the_worker_groups_merge_keeps_each_responses_routes_in_order():
    """Ray's colocated and disaggregated groups merge the workers' outputs by data-parallel rank: the routes
    follow their responses (they were dropped, and the actor then routed live without a word)."""
    topology = [WorkerTopology(rank=r, dp_rank=1 - r, dp_size=2, is_output_rank=True) for r in range(2)]
    outputs = [
        RolloutOutput(
            responses=[torch.tensor([r])],
            log_probs=[torch.zeros(1)],
            version=3,
            n=1,
            routed_experts=[torch.full((2, 2, TOP_K), r, dtype=torch.int16)],
        )
        for r in range(2)
    ]
    merged = merged_output(outputs, topology, n=1)
    assert [int(r) for r in merged.responses] == [1, 0]
    assert [int(r[0, 0, 0]) for r in merged.routed_experts] == [1, 0]
    plain = [dataclasses.replace(o, routed_experts=None) for o in outputs]
    assert merged_output(plain, topology, n=1).routed_experts is None


def test_router_replay_that_cannot_be_served_is_refused_up_front():
    with pytest.raises(ConfigError, match=r"rollout.router_replay='R2' is not a valid 'disabled' \| 'R3'"):
        load_config(None, ["rollout.router_replay=R2"])
    from drivetrain_engine_fsdp import FSDPEngine

    with pytest.raises(ConfigError, match=r"rollout.name=other does not record; use rollout.name=hf"):
        check_router_replay("R3", "other", object, FSDPEngine)
    # An engine that does not declare the capability (core's tiny test engine).
    with pytest.raises(ConfigError, match=r"engine.backend=tiny does not replay routed experts"):
        check_router_replay("R3", "hf", HFRollout, TinyTorchEngine)
    check_router_replay("R3", "hf", HFRollout, FSDPEngine)
    check_router_replay("disabled", "other", object, TinyTorchEngine)
