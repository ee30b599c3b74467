"""The ``vllm`` rollout against a plain Hugging Face forward (fp32, CPU). Runs in the vLLM environment
(packages/rollout-vllm/scripts/make-env); skipped where vLLM is not installed. One vLLM instance per module:
vLLM on CPU is heavy, so the tests share it and hand off increasing weight versions."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")

from drivetrain_engine_core._handoff import SentVersions
from drivetrain_engine_core.backend import EngineStateError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, create_rollout, engine_config_from_dict
from drivetrain_engine_core.rollout import HandoffError, SamplingConfig
from drivetrain_engine_core.testing import random_batch, token_mean_nll
from drivetrain_engine_core.testing.policies import base_state, moved, stream
from drivetrain_rollout_vllm import VLLMRollout
from drivetrain_rollout_vllm.sampling import PROMPT_SEED_STRIDE

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13]]
SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, seed=3)
VERSIONS = itertools.count(1)


@pytest.fixture(scope="module")
def model_dir(servable_model_dir):
    return servable_model_dir


# Away from the defaults (the model's 512 positions, a 1 GiB CPU cache), so the test below sees them taken.
OPTIONS = {"max_model_len": 64, "kv_cache_memory_bytes": 1 << 28}


@pytest.fixture(scope="module")
def rollout(model_dir):
    return create_rollout("vllm", model_path=str(model_dir), options=OPTIONS)


def test_vllm_runs_with_the_rollouts_options(rollout):
    config = rollout.llm.llm_engine.vllm_config
    assert (config.model_config.max_model_len, config.cache_config.kv_cache_memory_bytes) == (64, 1 << 28)
    assert config.model_config.enforce_eager
    with pytest.raises(Exception, match="maximum context length is 64 tokens"):
        rollout.generate([[1] * 70], SamplingConfig(max_new_tokens=1))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=engine_config_from_dict(
            {"backend": "fsdp", "device": "cpu", "micro_batch": {"micro_batch_size": 2}}
        ),
        optimizer_config=OptimizerConfig(lr=1e-2),
    )
    engine.initialize()
    return engine


def train_a_step(engine, seed):
    with engine.train_mode():
        engine.train_batch(
            random_batch(vocab_size=20, prompt_lengths=[3, 2], response_lengths=[4, 3], seed=seed),
            token_mean_nll,
        )


def reference_log_probs(model, prompts, output, temperature, **truncation):
    """Log-probs of each sampled token under a plain HF forward of ``model`` (the actor's computation), of the
    tempered distribution cut as ``truncation`` says (:func:`truncated`)."""
    expected = []
    for index, (response, rolled) in enumerate(zip(output.responses, output.log_probs, strict=True)):
        prompt = prompts[index // output.n]
        ids = torch.tensor([prompt + response.tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        logits = truncated(logits, **truncation)
        expected.append(torch.log_softmax(logits, dim=-1).gather(-1, response[:, None]).squeeze(-1))
        assert rolled.shape == expected[-1].shape
    return expected


def truncated(logits, top_k=0, top_p=1.0, min_p=0.0):
    """The tempered logits with the tokens each option removes set to -inf, written out from SamplingConfig's
    definitions: ``top_k`` keeps the k likeliest; ``min_p`` drops a token less likely than min_p times the
    likeliest; ``top_p`` keeps the likeliest tokens until their probabilities reach top_p, i.e. drops a token
    when it and every less likely token hold at most 1 - top_p (the likeliest is always kept)."""
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if top_k:
        drop |= logits < logits.topk(top_k, dim=-1).values[:, -1:]
    probs = torch.softmax(logits, dim=-1)
    if min_p:
        drop |= probs < min_p * probs.max(dim=-1, keepdim=True).values
    if top_p < 1:
        ascending, order = probs.sort(dim=-1)
        tail = ascending.cumsum(dim=-1) <= 1 - top_p
        tail[:, -1] = False
        drop |= torch.zeros_like(drop).scatter(-1, order, tail)
    return logits.masked_fill(drop, float("-inf"))


def hf_model(model_dir, engine=None):
    """The plain HF model at ``model_dir``, with ``engine``'s exported weights when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if engine is not None:
        model.load_state_dict(dict(engine.export_weights()))
    return model


def assert_close_per_token(output, expected):
    for rolled, reference in zip(output.log_probs, expected, strict=True):
        torch.testing.assert_close(rolled, reference, atol=1e-5, rtol=0)


def test_initial_log_probs_equal_a_plain_hf_forward(rollout, model_dir):
    assert isinstance(rollout, VLLMRollout) and rollout.weights_version is None
    output = rollout.generate(PROMPTS, SAMPLED)
    assert output.version is None and output.n == 2 and len(output.responses) == 6
    assert all(0 < len(r) <= 5 for r in output.responses)
    assert_close_per_token(output, reference_log_probs(hf_model(model_dir), PROMPTS, output, 0.7))
    again = rollout.generate(PROMPTS, SAMPLED)
    assert all(torch.equal(a, b) for a, b in zip(output.responses, again.responses, strict=True))


def test_a_call_past_the_cpu_schedulers_step_budget_samples_each_prompt_as_alone(rollout, model_dir):
    """70 prompts of 60 tokens sharing their first 40 are 4,200 tokens, past the 4,096 vLLM's CPU scheduler takes
    in one step (a multi-turn step's 64 episodes pass it every turn): each prompt samples what it samples alone
    under its seed, at a plain HF forward's log-probs. vLLM used to cut the last prefill across two steps and then
    stop on rewinding its seeded generator ("CPU Generator does not use offset")."""
    shared = [1] + [(7 * j) % 50 + 2 for j in range(39)]
    prompts = [shared + [(11 * i + j) % 50 + 2 for j in range(20)] for i in range(70)]
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=3, seed=5)
    output = rollout.generate(prompts, sampling)
    assert_close_per_token(output, reference_log_probs(hf_model(model_dir), prompts, output, 0.9))
    for i in (0, 68, 69):
        alone = rollout.generate([prompts[i]], replace(sampling, seed=5 + i * PROMPT_SEED_STRIDE))
        assert torch.equal(alone.responses[0], output.responses[i]), i


def test_after_a_weight_stream_log_probs_follow_the_trained_model(rollout, engine, model_dir):
    train_a_step(engine, seed=0)
    version = next(VERSIONS)
    assert rollout.update_weights(engine.weight_buckets(version=version, bucket_bytes=4096)) == version
    output = rollout.generate(PROMPTS, SAMPLED)
    assert output.version == version
    trained = hf_model(model_dir, engine)
    assert_close_per_token(output, reference_log_probs(trained, PROMPTS, output, 0.7))
    # What vLLM computes with is, bit for bit, what the engine exported (read back through vLLM's layers).
    exported = dict(engine.export_weights())
    served = rollout.served_weights(sorted(exported))
    assert all(torch.equal(served[name], tensor) for name, tensor in exported.items())


@pytest.mark.parametrize("truncation", [{"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.1}], ids=str)
def test_truncated_sampling_reports_the_distribution_sampled_from(rollout, engine, model_dir, truncation):
    output = rollout.generate(
        PROMPTS, SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, seed=1, **truncation)
    )
    reference = hf_model(model_dir, engine if rollout.weights_version else None)
    expected = reference_log_probs(reference, PROMPTS, output, 0.7, **truncation)
    assert_close_per_token(output, expected)
    full = reference_log_probs(reference, PROMPTS, output, 0.7)
    assert any((e - f).abs().max() > 1e-3 for e, f in zip(expected, full, strict=True))  # it did truncate


def test_responses_end_at_a_stop_token(rollout):
    free = rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=5))
    stop = int(free.responses[0][1])
    stopped = rollout.generate(
        PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=(stop,))
    )
    first = free.responses[0].tolist()
    assert stopped.responses[0].tolist() == first[: first.index(stop) + 1]


def test_stale_and_partial_streams_are_refused(rollout, engine):
    served = rollout.weights_version
    with pytest.raises(HandoffError, match="stale"):
        rollout.update_weights(engine.weight_buckets(version=served or 0, bucket_bytes=4096))
    assert rollout.weights_version == served
    train_a_step(engine, seed=1)
    version = next(VERSIONS)
    buckets = list(engine.weight_buckets(version=version, bucket_bytes=4096))
    with pytest.raises(HandoffError, match="ended before its last bucket"):
        rollout.update_weights(buckets[:-1])
    with pytest.raises(EngineStateError, match="failed midway"):
        rollout.generate(PROMPTS, SAMPLED)
    assert (
        rollout.update_weights(buckets) == version and rollout.generate(PROMPTS, SAMPLED).version == version
    )


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
FUSED["up_proj"] = "gate_up_proj"


def largest_layer_bytes(state):
    """The bytes of the largest group of tensors vLLM loads into one layer: a decoder layer's q/k/v projections
    (weights and biases, fused into ``qkv_proj``), its gate/up projections (``gate_up_proj``), or a tensor alone."""
    layers: dict[str, int] = {}
    for name, tensor in state.items():
        module = name.rpartition(".")[0]
        parent, _, short = module.rpartition(".")
        layer = f"{parent}.{FUSED.get(short, short)}"
        layers[layer] = layers.get(layer, 0) + tensor.numel() * tensor.element_size()
    return max(layers.values())


def test_buckets_are_applied_as_they_arrive_holding_less_than_a_layer(rollout, model_dir):
    """4 KiB buckets cut every fused layer (a 64 KiB q_proj is a bucket of its own): between two buckets the
    rollout holds only the cut layer's tensors, and what it serves after the last is the stream bit for bit."""
    state, version, held = moved(base_state(model_dir), seed=11), next(VERSIONS), []

    def recording(buckets):
        for bucket in buckets:
            yield bucket
            held.append(rollout.held_bytes)  # the rollout applied the bucket and asks for the next

    buckets = SentVersions().stream(
        state.items(), version=version, base_version=None, dtype=None, lora="merged", bucket_bytes=4096
    )
    assert rollout.update_weights(recording(buckets)) == version
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    assert len(held) > 20 and 0 < max(held) < largest_layer_bytes(state) < model_bytes / 4
    assert held[-1] == 0 == rollout.held_bytes
    served = rollout.served_weights(sorted(state))
    assert all(torch.equal(served[name], tensor) for name, tensor in state.items())


def test_a_delta_of_one_projection_serves_its_fused_layer_exactly(rollout, model_dir):
    """A delta that sends layer 1's ``k_proj`` alone: vLLM rebuilds the fused ``qkv_proj`` from that and the
    served ``q_proj``/``v_proj``; the log-probs are a plain HF forward's of the new weights."""
    changed_name = "model.layers.1.self_attn.k_proj.weight"
    sender, first = SentVersions(), moved(base_state(model_dir), seed=12)
    base = next(VERSIONS)
    rollout.update_weights(stream(sender, first, base))
    changed = moved(first, seed=13, names=[changed_name])
    delta = stream(sender, changed, next(VERSIONS), base_version=base)
    assert [name for bucket in delta for name in bucket.names] == [changed_name]
    rollout.update_weights(delta)
    output = rollout.generate(PROMPTS, SAMPLED)
    reference = hf_model(model_dir)
    reference.load_state_dict(changed)
    assert_close_per_token(output, reference_log_probs(reference, PROMPTS, output, 0.7))
    served = rollout.served_weights(sorted(changed))
    assert all(torch.equal(served[name], tensor) for name, tensor in changed.items())


def test_a_stream_refused_midway_says_its_layers_are_loaded_and_generation_waits(rollout, model_dir):
    state = moved(base_state(model_dir), seed=14)
    renamed = dict(state)
    renamed["model.norm.weigth"] = renamed.pop("model.norm.weight")  # now last: earlier layers are loaded
    with pytest.raises(
        HandoffError,
        match=r"holds 'model.norm.weigth'.*; hand off weights of the same architecture. \d+ of the served model's "
        r"layers were already loaded from this stream .*refuses to generate until a complete version arrives",
    ):
        rollout.update_weights(stream(SentVersions(), renamed, next(VERSIONS)))
    with pytest.raises(EngineStateError, match="failed midway"):
        rollout.generate(PROMPTS, SAMPLED)
    assert rollout.delta_base is None and rollout.held_bytes == 0
    version = next(VERSIONS)
    assert rollout.update_weights(stream(SentVersions(), state, version)) == version
    assert rollout.generate(PROMPTS, SAMPLED).version == version


def test_a_load_that_fails_inside_a_layer_leaves_nothing_for_the_next_stream(rollout, model_dir, monkeypatch):
    """vLLM fails after loading layer 0's ``q_proj`` of its fused ``qkv_proj``: the stream fails saying layers are
    loaded, and the next complete stream serves its own bits (a layer left open would count the failed load's
    ``q_proj`` towards it and drop its ``k_proj``/``v_proj``)."""
    model = rollout.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]
    load = model.load_weights

    def failing(weights):
        weights = list(weights)
        if any(name.startswith("model.layers.0.self_attn.q_proj") for name, _ in weights):
            load([(name, t) for name, t in weights if name.startswith("model.layers.0.self_attn.q_proj")])
            raise RuntimeError("injected: the load failed midway")
        return load(weights)

    monkeypatch.setattr(model, "load_weights", failing)
    with pytest.raises(HandoffError, match=r"injected.*layers were already loaded from this stream"):
        rollout.update_weights(stream(SentVersions(), moved(base_state(model_dir), seed=15), next(VERSIONS)))
    monkeypatch.undo()
    state, version = moved(base_state(model_dir), seed=16), next(VERSIONS)
    assert rollout.update_weights(stream(SentVersions(), state, version)) == version
    served = rollout.served_weights(sorted(state))
    assert all(torch.equal(served[name], tensor) for name, tensor in state.items())
