"""The ``hf`` rollout behind ``register_rollouts``: hand-off from an FSDP engine, exact log-probs, refusals.

One process, tiny models: the rollout's per-token log-probs of what it sampled equal the actor's recomputed
log-probs (same synced weights, same temperature) within 1e-5 fp32; a LoRA adapter hand-off serves the same
bits as a merged one; stale, cut-off and asleep use is refused with an error that names the fix.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from drivetrain_engine_core.backend import (
    EngineStateError,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    PluginError,
)
from drivetrain_engine_core.job import create_engine, create_rollout, engine_config_from_dict, make_batch
from drivetrain_engine_core.rollout import HandoffError, SamplingConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, token_mean_nll
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_roles.actor import Actor, ActorConfig
from drivetrain_roles.rollout.hf import HFRollout

TEMPERATURE = 0.7
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13]]
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lm"), arch="qwen2")


def trained_engine(model_dir, lora=None):
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir), lora=lora),
        engine_config=engine_config_from_dict(
            {"backend": "fsdp", "device": "cpu", "micro_batch": {"micro_batch_size": 2}}
        ),
        optimizer_config=OptimizerConfig(lr=1e-2),
    )
    engine.initialize()
    with engine.train_mode():
        engine.train_batch(
            random_batch(vocab_size=20, prompt_lengths=[3, 2], response_lengths=[4, 3], seed=0),
            token_mean_nll,
        )
    return engine


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "mixtral"])
def test_rollout_log_probs_equal_the_actors_after_a_hand_off(model_dir, arch, tmp_path):
    # Mixture-of-experts models: the stream holds one tensor per expert (checkpoint layout) while the served
    # model fuses them (and Mixtral's checkpoint renames its block); the first version is verified.
    model_dir = model_dir if arch == "qwen2" else make_tiny_model_dir(tmp_path, arch=arch)
    engine = trained_engine(model_dir)
    rollout = create_rollout("hf", model_path=str(model_dir))
    assert isinstance(rollout, HFRollout) and rollout.weights_version is None
    assert rollout.update_weights(engine.weight_buckets(version=1, bucket_bytes=4096)) == 1
    sampling = SamplingConfig(n=4, temperature=TEMPERATURE, max_new_tokens=6, seed=3)
    output = rollout.generate(PROMPTS, sampling)
    assert output.version == 1 and len(output.responses) == len(PROMPTS) * 4
    again = rollout.generate(PROMPTS, sampling)
    assert all(torch.equal(a, b) for a, b in zip(output.responses, again.responses, strict=True))
    prompts = [PROMPTS[i // 4] for i in range(len(output.responses))]
    batch = make_batch(
        [torch.tensor(p + r.tolist()) for p, r in zip(prompts, output.responses, strict=True)],
        loss_mask=[
            torch.tensor([0] * len(p) + [1] * len(r)).bool()
            for p, r in zip(prompts, output.responses, strict=True)
        ],
    )
    actor = Actor(engine, ActorConfig(temperature=TEMPERATURE))
    recomputed = actor.compute_log_prob(batch)["log_probs"].unbind()
    for prompt, rolled, actor_values in zip(prompts, output.log_probs, recomputed, strict=True):
        torch.testing.assert_close(rolled, actor_values[len(prompt) :], atol=1e-5, rtol=0)
    greedy = rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6))
    assert len(greedy.responses) == len(PROMPTS)


def test_log_probs_never_hold_every_steps_logits_at_once(model_dir, monkeypatch):
    """The sampled log-probs took one log-softmax over every step's logits stacked, in float32 on the host
    (rows x steps x vocab, ~300 GB at GRPO sizes); now each step's ``rows x vocab`` alone."""
    rollout = create_rollout("hf", model_path=str(model_dir))
    vocab = rollout.model.config.vocab_size
    sizes, log_softmax = [], torch.log_softmax

    def recording(x, *args, **kwargs):
        sizes.append(x.numel())
        return log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", recording)
    output = rollout.generate(PROMPTS, SamplingConfig(n=4, temperature=TEMPERATURE, max_new_tokens=6, seed=3))
    assert max(len(r) for r in output.responses) > 1 and max(sizes) <= len(PROMPTS) * 4 * vocab


def test_stale_cut_off_and_asleep_use_is_refused(model_dir):
    engine = trained_engine(model_dir)
    rollout = HFRollout(model_path=str(model_dir))
    rollout.update_weights(engine.weight_buckets(version=2, bucket_bytes=4096))
    with pytest.raises(HandoffError, match="stale weights: version 2 arrived after version 2"):
        rollout.update_weights(engine.weight_buckets(version=2, bucket_bytes=4096))
    cut = itertools.islice(engine.weight_buckets(version=3, bucket_bytes=4096), 2)
    with pytest.raises(HandoffError, match="ended before its last bucket"):
        rollout.update_weights(cut)
    with pytest.raises(EngineStateError, match="partial"):
        rollout.generate(PROMPTS, SamplingConfig())
    rollout.update_weights(engine.weight_buckets(version=3, bucket_bytes=4096))
    rollout.sleep()
    with pytest.raises(EngineStateError, match=r"asleep; call rollout.wake\(\)"):
        rollout.generate(PROMPTS, SamplingConfig())
    rollout.wake()
    assert rollout.generate(PROMPTS, SamplingConfig(max_new_tokens=2)).version == 3
    with pytest.raises(PluginError, match=r"no rollout named 'sglang'.*hf"):
        create_rollout("sglang", model_path=str(model_dir))


def test_a_failed_stream_leaves_nothing_to_the_next_one(model_dir, monkeypatch):
    """A stream cut off midway kept its cached state dict and covered names: once the model's storage was
    replaced (sleep/wake on a GPU; a dtype round trip here), the next complete stream copied into the old
    storage, passed the coverage check and reported its version while the model kept the failed stream's mix.
    A failure finishing the last bucket left that version reported as served, and its retry was refused."""
    engine = trained_engine(model_dir)
    exported = dict(engine.export_weights())
    rollout = HFRollout(model_path=str(model_dir))
    with pytest.raises(HandoffError, match="ended before its last bucket"):
        rollout.update_weights(itertools.islice(engine.weight_buckets(version=3, bucket_bytes=4096), 2))
    rollout.model.to(torch.float64).to(torch.float32)  # new storage for every parameter
    finish = rollout._weights.finish

    def failing_finish():
        raise HandoffError("the finish failed")

    monkeypatch.setattr(rollout._weights, "finish", failing_finish)
    with pytest.raises(HandoffError, match="the finish failed"):
        rollout.update_weights(engine.weight_buckets(version=4, bucket_bytes=4096))
    assert rollout.weights_version is None
    monkeypatch.setattr(rollout._weights, "finish", finish)
    assert rollout.update_weights(engine.weight_buckets(version=4, bucket_bytes=4096)) == 4
    served = rollout.model.state_dict()
    assert all(torch.equal(served[name], tensor) for name, tensor in exported.items())


def test_adapter_hand_off_serves_the_merged_weights_bit_for_bit(model_dir):
    engine = trained_engine(model_dir, lora=LORA)
    merged, adapter = HFRollout(model_path=str(model_dir)), HFRollout(model_path=str(model_dir))
    merged.update_weights(engine.weight_buckets(version=1))
    adapter.update_weights(engine.weight_buckets(version=1, lora="adapter"))
    adapter.update_weights(engine.weight_buckets(version=2, lora="adapter"))  # folds into the base, not twice
    served = adapter.model.state_dict()
    for name, tensor in merged.model.state_dict().items():
        assert torch.equal(served[name], tensor), name
    # Only the adapted weights' base copies are kept for later folds (a copy of the whole model doubled memory).
    kept = set(adapter._weights._base)
    assert kept and all(name.split(".")[-2] in LORA.target_modules for name in kept)
    with pytest.raises(HandoffError, match="one lora mode"):
        merged.update_weights(engine.weight_buckets(version=2, lora="adapter"))


def _with_generation_config(model_dir, target, **fields):
    """A copy of ``model_dir`` whose ``generation_config.json`` also sets ``fields``."""
    import json
    import shutil

    shutil.copytree(model_dir, target)
    path = target / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return target


def test_the_models_generation_config_does_not_change_what_is_sampled(model_dir, tmp_path):
    """Qwen2.5-Instruct's generation_config.json sets ``repetition_penalty: 1.05``; generate used it for every
    field the rollout left unset, so it sampled from another distribution than the log-probs it reported.
    With penalties in the model's generation config, the samples equal those of the same weights without."""
    penalised = _with_generation_config(
        model_dir, tmp_path / "penalised", repetition_penalty=5.0, no_repeat_ngram_size=1, top_k=2
    )
    sampling = SamplingConfig(n=4, temperature=TEMPERATURE, max_new_tokens=6, seed=3)
    plain = HFRollout(model_path=str(model_dir)).generate(PROMPTS, sampling)
    shifted = HFRollout(model_path=str(penalised)).generate(PROMPTS, sampling)
    for a, b in zip(plain.responses + plain.log_probs, shifted.responses + shifted.log_probs, strict=True):
        assert torch.equal(a, b)


def test_responses_end_at_any_end_of_sequence_id(model_dir, tmp_path):
    """Llama 3 lists several end-of-sequence ids in its config (the rollout crashed on the list); Gemma's chat
    models end a turn with one that only the generation config names (responses ran past it)."""
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    free = HFRollout(model_path=str(model_dir)).generate(PROMPTS, greedy).responses
    # Two ids the greedy responses produce: each becomes an end-of-sequence id of a copy of the model.
    first, second = free[0][1].item(), free[1][2].item()
    copy = _with_generation_config(model_dir, tmp_path / "ends", eos_token_id=[2, second])
    import json

    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, first]}))
    ended = HFRollout(model_path=str(copy)).generate(PROMPTS, greedy).responses
    for response, full in zip(ended, free, strict=True):
        stops = [i for i, token in enumerate(full.tolist()) if token in (2, first, second)]
        expected = full[: stops[0] + 1] if stops else full
        assert torch.equal(response, expected)
    assert len(ended[0]) == 2 and len(ended[1]) <= 3


@requires_cuda
def test_sampling_leaves_the_processes_cuda_generator_as_it_was(model_dir):
    """The sampling seed is set with ``manual_seed``, which seeds the CUDA generator too; forked for the CPU
    only, every ``generate`` left the colocated engines' CUDA generator (their dropout) reseeded."""
    rollout = HFRollout(model_path=str(model_dir), device="cuda")
    torch.cuda.manual_seed(1234)
    before = torch.cuda.get_rng_state()
    rollout.generate(PROMPTS, SamplingConfig(n=2, temperature=TEMPERATURE, max_new_tokens=3, seed=3))
    assert torch.equal(torch.cuda.get_rng_state(), before)


def test_truncated_sampling_reports_the_distribution_sampled_from(model_dir):
    """With ``top_k`` the rollout samples from the tempered distribution cut to the k likeliest tokens and
    renormalised; the log-probs it reports are of that distribution (the formula, from a plain forward)."""
    from transformers import AutoModelForCausalLM

    sampling = SamplingConfig(n=3, temperature=TEMPERATURE, top_k=3, max_new_tokens=6, seed=5)
    output = HFRollout(model_path=str(model_dir)).generate(PROMPTS, sampling)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for index, (response, rolled) in enumerate(zip(output.responses, output.log_probs, strict=True)):
        prompt = PROMPTS[index // 3]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response.tolist()])).logits[0, len(prompt) - 1 : -1]
        tempered = logits / TEMPERATURE
        kept = tempered.masked_fill(tempered < tempered.topk(3, dim=-1).values[:, -1:], float("-inf"))
        expected = torch.log_softmax(kept, dim=-1).gather(-1, response[:, None]).squeeze(-1)
        torch.testing.assert_close(rolled, expected, atol=1e-5, rtol=0)


def test_responses_end_at_a_stop_token(model_dir):
    rollout = HFRollout(model_path=str(model_dir))
    free = rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6)).responses[0].tolist()
    stop = free[1]
    stopped = rollout.generate(
        PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,))
    ).responses[0]
    assert stopped.tolist() == free[: free.index(stop) + 1]
