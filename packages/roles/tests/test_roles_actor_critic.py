"""Actor, critic and reference on the real FSDP backend (one process) against plain Hugging Face references."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import BatchError, ConfigError, LoraConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, engine_config_from_dict, jagged, nopad_to_padded
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_entropy,
    reference_log_probs,
    reference_values,
    token_mean_nll,
)
from drivetrain_roles.actor import Actor, ActorConfig, PolicyObjective
from drivetrain_roles.batch_inputs import RoleBatch
from drivetrain_roles.critic import Critic, CriticConfig
from drivetrain_roles.losses import PolicyLossConfig, ValueLossConfig
from drivetrain_roles.mini_batches import UpdateSchedule
from drivetrain_roles.reference import Reference
from tensordict import TensorDict

VOCAB = 100
PROMPTS = [3, 5, 2, 4, 6, 1, 3, 2]
RESPONSES = [5, 2, 7, 3, 5, 6, 4, 4]


def engine_for(model_dir, *, model_type="language_model", lr=1e-2, lora=None, optimizer=True):
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir), model_type=model_type, lora=lora),
        engine_config=engine_config_from_dict({"backend": "fsdp", "micro_batch": {"micro_batch_size": 3}}),
        optimizer_config=OptimizerConfig(lr=lr, weight_decay=0.0) if optimizer else None,
    )
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("actor"), arch="qwen2", vocab_size=VOCAB, with_tokenizer=False
    )


def rollout(seed=0) -> TensorDict:
    batch = random_batch(vocab_size=VOCAB, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=seed)
    offsets = batch["input_ids"].offsets()
    # One advantage per sequence (+1 / -1 alternating), broadcast to its tokens.
    per_sequence = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(PROMPTS))])
    batch["advantages"] = jagged(torch.repeat_interleave(per_sequence, offsets.diff()), offsets)
    return batch


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.values() if t.is_nested else t


def surrogate(log_probs, batch) -> float:
    """Token-mean of -A * ratio over response tokens (the unclipped PPO objective, to be minimised)."""
    mask = batch["loss_mask"].values()
    ratio = torch.exp(flat(log_probs) - batch["old_log_probs"].values())
    return float((-batch["advantages"].values() * ratio)[mask].mean())


def test_actor_log_probs_match_hugging_face_and_update_lowers_the_policy_loss(model_dir, monkeypatch) -> None:
    batch = rollout()
    actor = Actor(
        engine_for(model_dir),
        ActorConfig(
            loss=PolicyLossConfig(clip_ratio_high=0.2), schedule=UpdateSchedule(mini_batch_size=8, epochs=1)
        ),
    )
    asked_for_entropy = record_entropy_requests(actor, monkeypatch)
    log_probs = actor.compute_log_prob(batch)["log_probs"]
    reference = reference_log_probs(model_dir, batch)
    torch.testing.assert_close(flat(log_probs), flat(reference), atol=1e-5, rtol=1e-5)
    batch["old_log_probs"] = jagged(log_probs.values().clone(), batch["input_ids"].offsets())
    before = surrogate(log_probs, batch)

    first = actor.update_policy(batch)
    # At the first step the policy is the rollout policy: ratio 1, no clipping, pg_loss = -mean(A).
    mask = batch["loss_mask"].values()
    assert first["pg_loss"] == pytest.approx(float(-batch["advantages"].values()[mask].mean()), abs=1e-5)
    assert first["approx_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["pg_clipfrac"] == 0.0
    assert first["grad_norm"] > 0 and first["lr"] == pytest.approx(1e-2)
    # No entropy bonus: the update asks the engine for log-probs alone and reports no entropy.
    assert "entropy" not in first and asked_for_entropy == [False]
    for _ in range(3):
        metrics = actor.update_policy(batch)
    after = surrogate(actor.compute_log_prob(batch)["log_probs"], batch)
    assert after < before - 0.1, (before, after)
    assert metrics["approx_kl"] != 0.0


def record_entropy_requests(actor: Actor, monkeypatch) -> list[bool]:
    """Whether each of the actor's ``train_batch`` calls asked the engine for the entropy."""
    asked: list[bool] = []
    train_batch = actor.engine.train_batch

    def recording(batch, loss_fn, *, options=None):
        asked.append(options.compute_entropy)
        return train_batch(batch, loss_fn, options=options)

    monkeypatch.setattr(actor.engine, "train_batch", recording)
    return asked


def test_an_entropy_bonus_makes_the_update_compute_and_report_the_entropy(model_dir, monkeypatch) -> None:
    """The entropy the update reports is the token mean over response tokens of the policy's entropy, as a
    plain Hugging Face forward computes it (one optimizer step, so the policy is the one scored)."""
    batch = rollout()
    config = ActorConfig(
        loss=PolicyLossConfig(entropy_coeff=0.01), schedule=UpdateSchedule(mini_batch_size=8)
    )
    actor = Actor(engine_for(model_dir), config)
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    asked_for_entropy = record_entropy_requests(actor, monkeypatch)
    metrics = actor.update_policy(batch)
    expected = flat(reference_entropy(model_dir, batch))[batch["loss_mask"].values()].mean()
    assert asked_for_entropy == [True]
    assert metrics["entropy"] == pytest.approx(float(expected), rel=1e-5)


def test_actor_accepts_padded_batches_and_answers_padded(model_dir) -> None:
    batch = rollout()
    actor = Actor(engine_for(model_dir, optimizer=False))
    expected = actor.compute_log_prob(batch)["log_probs"]
    padded = nopad_to_padded(batch, prompt_lengths=torch.tensor(PROMPTS))
    padded_batch = TensorDict(padded, batch_size=[len(PROMPTS)])
    dense = actor.compute_log_prob(padded_batch)["log_probs"]
    attention = padded["attention_mask"].bool()
    assert dense.shape == attention.shape
    torch.testing.assert_close(dense[attention], expected.values(), atol=1e-6, rtol=1e-6)
    assert float(dense[~attention].abs().sum()) == 0.0


def test_a_padded_update_needs_its_response_mask_and_keeps_per_sequence_fields(model_dir) -> None:
    """Without ``response_mask`` padding conversion marked every real token for the loss, so an update trained on
    the prompts too, with no error; per-sequence fields (verl's ``uid``) were refused as not ``(B, L)``."""
    batch = rollout()
    actor = Actor(engine_for(model_dir), ActorConfig(schedule=UpdateSchedule(mini_batch_size=8)))
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    padded = nopad_to_padded(batch, prompt_lengths=torch.tensor(PROMPTS))
    unmasked = TensorDict(
        {k: v for k, v in padded.items() if k != "response_mask"}, batch_size=[len(PROMPTS)]
    )
    with pytest.raises(BatchError, match=r"needs \['response_mask'\] .*the prompt included"):
        actor.update_policy(unmasked)
    with pytest.raises(
        BatchError, match=r"missing field 'loss_mask' \(a padded batch gives it as response_mask"
    ):
        actor.update_policy(RoleBatch.wrap(unmasked).nopad)  # what a worker group's dispatch sends
    padded_batch = TensorDict({**padded, "uid": torch.arange(len(PROMPTS))}, batch_size=[len(PROMPTS)])
    metrics = actor.update_policy(padded_batch)
    # The first step's ratio is 1: pg_loss is minus the token mean of the advantages over the response tokens.
    mask = batch["loss_mask"].values()
    assert metrics["pg_loss"] == pytest.approx(float(-batch["advantages"].values()[mask].mean()), abs=1e-5)


def test_an_update_takes_the_callers_objective_in_place_of_ppo(model_dir) -> None:
    """GSPO, truncated importance sampling or another KL form needed a copy of ``update_policy``; an objective
    runs the caller's loss with the actor's mini-batches, metric reduction and LR step. Here the SFT loss: one
    step's summed NLL is the policy's before the step, as a plain Hugging Face model scores it."""
    batch = rollout()
    actor = Actor(engine_for(model_dir), ActorConfig(schedule=UpdateSchedule(mini_batch_size=8)))
    with pytest.raises(BatchError, match=r"missing field 'rollout_log_probs'"):
        actor.update_policy(batch, PolicyObjective(token_mean_nll, required_fields=("rollout_log_probs",)))
    reference = reference_log_probs(model_dir, batch).values()
    metrics = actor.update_policy(batch, PolicyObjective(token_mean_nll, metric_names=("nll_sum",)))
    expected = -float(reference[batch["loss_mask"].values()].sum())
    assert metrics["nll_sum"] == pytest.approx(expected, rel=1e-5)
    assert set(metrics) == {"nll_sum", "grad_norm", "lr"} and metrics["grad_norm"] > 0
    with pytest.raises(ConfigError, match=r"reports no metric \['nll_summ'\]; it reports \['nll_sum'\]"):
        actor.update_policy(batch, PolicyObjective(token_mean_nll, metric_names=("nll_summ",)))


def test_critic_values_match_hugging_face_and_update_lowers_the_value_loss(tmp_path) -> None:
    model_dir = make_tiny_model_dir(tmp_path, arch="qwen2", model_type="value_model", vocab_size=VOCAB)
    batch = random_batch(
        vocab_size=VOCAB, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=1, with_returns=True
    )
    critic = Critic(
        engine_for(model_dir, model_type="value_model", lr=5e-3),
        CriticConfig(
            loss=ValueLossConfig(cliprange_value=10.0), schedule=UpdateSchedule(mini_batch_size=4, epochs=2)
        ),
    )
    values = critic.compute_values(batch)["values"]
    torch.testing.assert_close(flat(values), flat(reference_values(model_dir, batch)), atol=1e-5, rtol=1e-5)
    batch["values"] = jagged(flat(values).clone(), batch["input_ids"].offsets())
    mask = batch["loss_mask"].values()

    def mse(current) -> float:
        return float(0.5 * (flat(current) - batch["returns"].values())[mask].square().mean())

    before = mse(values)
    metrics = {}
    for _ in range(4):
        metrics = critic.update_critic(batch)
    assert set(metrics) == {"vf_loss", "vf_clipfrac", "grad_norm", "lr"}
    assert 0.0 <= metrics["vf_clipfrac"] <= 1.0
    assert mse(critic.compute_values(batch)["values"]) < 0.8 * before


def test_reference_from_own_engine_and_from_actor_base(model_dir) -> None:
    batch = rollout()
    expected = flat(reference_log_probs(model_dir, batch))
    own = Reference(engine_for(model_dir, optimizer=False)).compute_ref_log_prob(batch)["ref_log_prob"]
    torch.testing.assert_close(flat(own), expected, atol=1e-5, rtol=1e-5)

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    actor = Actor(
        engine_for(model_dir, lora=lora, lr=5e-2), ActorConfig(schedule=UpdateSchedule(mini_batch_size=8))
    )
    batch["old_log_probs"] = jagged(
        actor.compute_log_prob(batch)["log_probs"].values(), batch["input_ids"].offsets()
    )
    actor.update_policy(batch)
    trained = flat(actor.compute_log_prob(batch)["log_probs"])
    base = flat(Reference(actor.engine, use_actor_base=True).compute_ref_log_prob(batch)["ref_log_prob"])
    torch.testing.assert_close(base, expected, atol=1e-5, rtol=1e-5)
    assert float((trained - expected).abs().max()) > 1e-3  # the adapters did change the policy


def test_reference_on_actor_base_needs_adapters(model_dir) -> None:
    with pytest.raises(ValueError, match="LoRA"):
        Reference(engine_for(model_dir, optimizer=False), use_actor_base=True)


def test_a_resumed_actor_shuffles_its_mini_batches_as_the_uninterrupted_one(model_dir, tmp_path) -> None:
    # Two shuffled mini-batches per update: the order of update k is seeded by k, so an actor restored from a
    # checkpoint after one update must continue from updates_done=1, or its second update differs. The role's
    # own checkpoint holds the count (a role in a Ray worker had no way to restore it).
    config = ActorConfig(schedule=UpdateSchedule(mini_batch_size=4, epochs=1, shuffle=True, seed=7))
    batch = rollout(seed=3)
    batch["old_log_probs"] = jagged(
        torch.zeros(batch["input_ids"].values().shape), batch["input_ids"].offsets()
    )
    actor = Actor(engine_for(model_dir), config)
    actor.update_policy(batch)
    actor.save_checkpoint(tmp_path, global_step=1, extra_state={"epoch": 3})
    expected = actor.update_policy(batch)
    resumed = Actor(engine_for(model_dir), config)
    assert resumed.load_checkpoint(tmp_path) == {"global_step": 1, "epoch": 3, "updates_done": 1}
    assert resumed.updates_done == 1
    assert resumed.update_policy(batch) == expected
