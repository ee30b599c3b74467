"""Adapter-only hand-offs on the ``vllm`` rollout (vLLM's LoRA support), against transformers + PEFT: the base model
with the engine's exported adapters, forward in fp32. One vLLM instance for the module; the engine trains its
adapters between versions."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")

import peft
from drivetrain_engine_core.backend import LoraConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, create_rollout, engine_config_from_dict
from drivetrain_engine_core.rollout import HandoffError, SamplingConfig
from drivetrain_engine_core.testing import random_batch, token_mean_nll

# alpha / rank = 3: not a power of two, so vLLM's lora_B (scaled in place) cannot be undone by a division.
LORA = LoraConfig(rank=4, alpha=12.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
SHARED = list(range(3, 43))  # 40 tokens: more than a KV block, shared by every prompt
PROMPTS = [[1, *SHARED, 5, 6], [1, *SHARED, 9], [1, 12, 13]]
SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=6, seed=3)
VERSIONS = itertools.count(1)


@pytest.fixture(scope="module")
def rollout(servable_model_dir):
    options = {
        "max_model_len": 128,
        "kv_cache_memory_bytes": 1 << 26,
        "enable_lora": True,
        "max_lora_rank": 8,
    }
    return create_rollout("vllm", model_path=str(servable_model_dir), options=options)


@pytest.fixture(scope="module")
def engine(servable_model_dir):
    engine = create_engine(
        model_config=ModelConfig(path=str(servable_model_dir), lora=LORA),
        engine_config=engine_config_from_dict(
            {"backend": "fsdp", "device": "cpu", "micro_batch": {"micro_batch_size": 2}}
        ),
        optimizer_config=OptimizerConfig(lr=5e-2),
    )
    engine.initialize()
    return engine


def train_and_hand_off(engine, rollout, seed):
    """One training step of the adapters, then the adapters alone handed off in 1 KiB buckets (several)."""
    with engine.train_mode():
        batch = random_batch(vocab_size=20, prompt_lengths=[3, 2], response_lengths=[4, 3], seed=seed)
        engine.train_batch(batch, token_mean_nll)
    version = next(VERSIONS)
    buckets = list(engine.weight_buckets(version=version, bucket_bytes=1024, lora="adapter"))
    assert len(buckets) > 2 and all(bucket.lora == "adapter" for bucket in buckets)
    return version, buckets


def adapters_of(buckets):
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def peft_model(model_dir, adapters):
    """transformers + PEFT: the base model with ``adapters`` (the engine's PEFT names) bound."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules))
    model = peft.get_peft_model(base, config)
    missing = peft.set_peft_model_state_dict(model, adapters).unexpected_keys
    assert not missing
    return model.eval()


def reference(model, prompts, responses, n, temperature=0.7):
    expected = []
    for index, response in enumerate(responses):
        prompt = prompts[index // n]
        ids = torch.tensor([prompt + response.tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        expected.append(torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1))
    return expected


def largest_gap(log_probs, expected):
    return max(float((a - b).abs().max()) for a, b in zip(log_probs, expected, strict=True))


def test_an_adapter_version_samples_as_peft_does(rollout, engine, servable_model_dir):
    version, buckets = train_and_hand_off(engine, rollout, seed=0)
    assert rollout.update_weights(buckets) == version
    assert rollout.last_sync.verified  # read back from vLLM's LoRA, lora_B against arrival x 3 bit for bit
    output = rollout.generate(PROMPTS, SAMPLED)
    assert output.version == version
    tuned = reference(peft_model(servable_model_dir, adapters_of(buckets)), PROMPTS, output.responses, 2)
    assert largest_gap(output.log_probs, tuned) < 1e-5
    base = reference(peft_model(servable_model_dir, {}), PROMPTS, output.responses, 2)
    assert largest_gap(output.log_probs, base) > 1e-3  # the adapter is what samples


def test_a_request_started_under_a_version_finishes_under_it(rollout, engine, servable_model_dir):
    """vLLM holds a running request's adapter: a request of version k, half decoded when k+1 arrives, finishes
    with k's log-probs; new requests get k+1; a third version removes the oldest (two kept)."""
    from vllm import SamplingParams

    _, buckets = train_and_hand_off(engine, rollout, seed=1)
    rollout.update_weights(buckets)
    older = adapters_of(buckets)
    llm = rollout.llm.llm_engine
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5, logprobs=0, ignore_eos=True)
    llm.add_request(
        "in-flight", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=rollout._adapters.current
    )
    outputs = [out for _ in range(4) for out in llm.step()]
    assert not any(out.finished for out in outputs)  # still decoding
    newer, next_buckets = train_and_hand_off(engine, rollout, seed=2)
    assert rollout.update_weights(next_buckets) == newer
    while not any(out.finished for out in outputs):
        outputs += llm.step()
    completion = next(out for out in outputs if out.finished).outputs[0]
    response = torch.tensor(list(completion.token_ids))
    rolled = torch.tensor(
        [step[t].logprob for step, t in zip(completion.logprobs, response.tolist(), strict=True)]
    )
    under_k = reference(peft_model(servable_model_dir, older), PROMPTS[:1], [response], 1)
    under_k1 = reference(
        peft_model(servable_model_dir, adapters_of(next_buckets)), PROMPTS[:1], [response], 1
    )
    assert largest_gap([rolled], under_k) < 1e-5 < largest_gap([rolled], under_k1)
    kept = rollout._adapters.loaded_ids
    rollout.update_weights(train_and_hand_off(engine, rollout, seed=3)[1])
    assert rollout._adapters.loaded_ids == [kept[-1], kept[-1] + 1]
    assert llm.list_loras() == {kept[-1], kept[-1] + 1}


def cut_after(buckets, count):
    """The stream as a sender whose connection drops after ``count`` buckets."""
    yield from buckets[:count]
    raise ConnectionError("the trainer's connection was cut")


@pytest.mark.parametrize("failure", ["first bucket corrupted", "last bucket corrupted", "connection cut"])
def test_a_failed_adapter_stream_leaves_the_previous_version_serving_as_peft_does(
    rollout, engine, servable_model_dir, failure
):
    """vLLM adds an adapter version whole, once its stream ended: a stream that fails at any bucket leaves the
    previous version serving (the error says so), sampled as transformers + PEFT sample with its adapters, and
    a delta may build on it."""
    served, buckets = train_and_hand_off(engine, rollout, seed=4)
    rollout.update_weights(buckets)
    _, failing = train_and_hand_off(engine, rollout, seed=5)
    if failure == "connection cut":
        stream, error = cut_after(failing, len(failing) - 1), ConnectionError
    else:
        bucket = failing[0 if failure.startswith("first") else -1]
        bucket.buffer[bucket.specs[0].offset] ^= 0x40
        stream, error = iter(failing), HandoffError
    with pytest.raises(error) as failed:
        rollout.update_weights(stream)
    assert failed.value.__notes__[-1].startswith(f"The rollout still serves version {served} ")
    assert rollout.weights_version == served == rollout.delta_base
    output = rollout.generate(PROMPTS, SAMPLED)
    assert output.version == served
    previous = reference(peft_model(servable_model_dir, adapters_of(buckets)), PROMPTS, output.responses, 2)
    assert largest_gap(output.log_probs, previous) < 1e-5
    refused = reference(peft_model(servable_model_dir, adapters_of(failing)), PROMPTS, output.responses, 2)
    assert largest_gap(output.log_probs, refused) > 1e-3
