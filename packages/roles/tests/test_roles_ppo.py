"""``drivetrain ppo``: the first step equals PPO written out on plain Hugging Face models, config-time refusals,
the run folder and resume.

Parity: one PPO step (KL in the reward and in the loss, GAE, whitening, value clipping) on the same samples and
rewards gives the actor's loss and grad norm and the critic's loss and grad norm of a single-process
implementation of the formulas on the Hugging Face policy, reference and value model (the critic's trunk with
its fresh head) within 1e-5 fp32.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.testing.reference import grad_norm, load_reference_model
from drivetrain_roles.jobs.default_assets import (
    build_arithmetic_tokenizer,
    write_model_dir,
)
from drivetrain_roles.ppo.config import load_config
from drivetrain_roles.ppo.step import sample, update
from drivetrain_roles.ppo.trainer import CRITIC_START_DIR, PPOTrainer
from drivetrain_roles.rl.batch import RolloutBatch
from drivetrain_roles.rollout.hf import HFRollout

N, TEMPERATURE, KL_COEF, KL_LOSS_COEF, GAMMA, LAM, CLIP_VALUE = 2, 0.8, 0.1, 0.05, 0.9, 0.8, 0.5
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])


SETTINGS = (
    f"rollout.n={N}",
    f"rollout.temperature={TEMPERATURE}",
    "trainer.prompts_per_step=3",
    "algorithm.ppo_mini_batches=1",
    f"algorithm.gamma={GAMMA}",
    f"algorithm.lam={LAM}",
    f"algorithm.cliprange_value={CLIP_VALUE}",
    f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
    f"algorithm.kl_loss_coef={KL_LOSS_COEF}",
)


@pytest.fixture
def config_for(small_rl_config):
    """``config(model_path, *overrides)``: PPO with this module's constants (GAE, value clip, both KL terms)."""
    return lambda model_path, *overrides: small_rl_config(load_config, model_path, *SETTINGS, *overrides)


def test_first_step_matches_ppo_written_out_on_hugging_face_models(tmp_path, config_for, arithmetic_prompts):
    model_dir = write_model_dir(tmp_path / "model", seed=3)
    tokenizer = build_arithmetic_tokenizer()
    config = config_for(model_dir)
    trainer = PPOTrainer(config, tmp_path / "run")
    actor = trainer.actor = trainer.make_actor(str(model_dir))
    # Another policy as the reference, so that both KL terms (reward and loss) reach the gradients.
    reference_dir = write_model_dir(tmp_path / "reference", seed=4)
    reference = trainer.make_reference(actor, str(reference_dir))
    critic = trainer.make_critic(str(model_dir))
    # Copies: on one rank the exported tensors may be the parameters themselves, which the update changes.
    critic_weights = {name: tensor.clone() for name, tensor in critic.engine.export_weights()}
    samples = sample(
        HFRollout(model_path=str(model_dir)), arithmetic_prompts(tokenizer, 3), tokenizer, config, seed=0
    )
    # The untrained model is never right: give the responses scores, so that the update is not zero.
    batch = samples.batch.clone()
    metrics = update(
        actor,
        reference,
        critic,
        RolloutBatch(samples.batch, samples.rollout_log_probs, REWARDS, samples.response_lengths),
        config.algorithm,
        KL_COEF,
        train_actor=True,
    )
    critic_dir = tmp_path / "run" / CRITIC_START_DIR
    expected = _plain_ppo_first_step(model_dir, reference_dir, critic_dir, critic_weights, batch)
    assert metrics["rollout/log_prob_diff_max"] < 1e-5
    loss = metrics["pg_loss"] + KL_LOSS_COEF * metrics["kl_loss"]
    assert loss == pytest.approx(expected["actor_loss"], rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(expected["actor_grad_norm"], rel=1e-5)
    assert metrics["critic/vf_loss"] == pytest.approx(expected["critic_loss"], rel=1e-5)
    assert metrics["critic/grad_norm"] == pytest.approx(expected["critic_grad_norm"], rel=1e-5)
    assert metrics["kl"] == pytest.approx(expected["kl"], rel=1e-5, abs=1e-7)
    assert metrics["critic/vf_explained_var"] == pytest.approx(expected["explained_var"], rel=1e-4, abs=1e-6)
    assert metrics["critic/returns_mean"] == pytest.approx(expected["returns_mean"], rel=1e-5, abs=1e-7)
    assert expected["actor_grad_norm"] > 0 and expected["critic_grad_norm"] > 0 and expected["kl"] > 0.01


def _plain_ppo_first_step(model_dir, reference_dir, critic_dir, critic_weights, batch):
    """PPO's first step written out: k1 KL in each token's reward, the score on the last response token, GAE
    (``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``), advantages whitened over
    every response token, PPO-clip (ratio 1) + k3 KL loss, and the clipped value loss, all token means."""
    policy, reference = load_reference_model(model_dir), load_reference_model(reference_dir)
    value_model = load_reference_model(critic_dir, "value_model")
    value_model.load_state_dict(critic_weights)
    per_sequence = []
    for ids, mask, score in zip(
        batch["input_ids"].unbind(), batch["loss_mask"].unbind(), REWARDS, strict=True
    ):
        response = mask[1:]  # token i is predicted at position i - 1
        log_probs = torch.log_softmax(policy(ids[None]).logits[0, :-1] / TEMPERATURE, -1)
        log_probs = log_probs.gather(-1, ids[1:, None])[:, 0][response]
        with torch.no_grad():
            ref = torch.log_softmax(reference(ids[None]).logits[0, :-1] / TEMPERATURE, -1)
            ref = ref.gather(-1, ids[1:, None])[:, 0][response]
        values = value_model(ids[None]).logits[0, :-1, 0][response]
        old = log_probs.detach()
        rewards = -KL_COEF * (old - ref)
        rewards[-1] += score
        advantages, following_advantage, following_value = torch.zeros_like(rewards), 0.0, 0.0
        for t in reversed(range(len(rewards))):
            delta = rewards[t] + GAMMA * following_value - values[t].detach()
            following_advantage = delta + GAMMA * LAM * following_advantage
            advantages[t], following_value = following_advantage, values[t].detach()
        per_sequence.append((log_probs, ref, values, advantages, advantages + values.detach(), old - ref))
    log_probs, ref, values, advantages, returns, k1 = (torch.cat(x) for x in zip(*per_sequence, strict=True))
    whitened = (advantages - advantages.mean()) / torch.sqrt(advantages.var() + 1e-8)
    ratio = torch.exp(log_probs - log_probs.detach())
    pg = torch.maximum(-whitened * ratio, -whitened * ratio.clamp(0.8, 1.2))
    delta = ref - log_probs
    actor_loss = (pg + KL_LOSS_COEF * (torch.exp(delta) - 1 - delta)).mean()
    actor_loss.backward()
    clipped = values.detach() + (values - values.detach()).clamp(-CLIP_VALUE, CLIP_VALUE)
    critic_loss = (0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)).mean()
    critic_loss.backward()
    residual = returns - values.detach()
    return {
        "actor_loss": float(actor_loss.detach()),
        "actor_grad_norm": grad_norm(list(policy.parameters())),
        "critic_loss": float(critic_loss.detach()),
        "critic_grad_norm": grad_norm(list(value_model.parameters())),
        "kl": float(k1.mean()),
        "explained_var": float(1 - residual.var(unbiased=False) / returns.var(unbiased=False)),
        "returns_mean": float(returns.mean()),
    }


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.adv_estimator=grpo",
            r"adv_estimator='grpo' needs no critic: drivetrain ppo would train a critic whose values nothing reads",
        ),
        (
            "algorithm.adv_estimator=gea",
            r"adv_estimator='gea' is not known; did you mean 'gae'\? choose one of grpo",
        ),
        (
            "algorithm.kl_penalty=k4",
            r"algorithm.kl_penalty='k4' is not known; did you mean 'kl'\? choose one of k1, k2, k3, abs",
        ),
        ("algorithm.kl_ctrl.type=adaptiv", r"kl_ctrl.type='adaptiv' is not known; did you mean 'adaptive'\?"),
        ("algorithm.loss_mode=gpso", r"algorithm.loss_mode='gpso' is not known; did you mean 'gspo'\?"),
        (
            "algorithm.loss_agg_mode=token_mean",
            r"loss_agg_mode='token_mean' is not known; did you mean 'token-mean'",
        ),
        (
            "algorithm.kl_ctrl.type=adaptive algorithm.use_kl_in_reward=false",
            r"kl_ctrl.type=adaptive steers the KL coefficient of the reward, but algorithm.use_kl_in_reward=false",
        ),
        ("trainer.critic_warmup=120", r"trainer.critic_warmup=120 leaves no step of trainer.total_steps=120"),
        (
            "trainer.mode=async",
            r"trainer.mode=.async.: drivetrain ppo trains on the samples of the step.s own weights only",
        ),
        ("algorithm.lam=1.5", r"algorithm.lam in \[0, 1\], got 1.0, 1.5"),
        ("algorithm.ppo_mini_batches=3", r"ppo_mini_batches=3 must divide .* 32 x 8 = 256"),
    ],
)
def test_bad_settings_are_refused_when_the_config_loads(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


def test_grpo_refuses_gae_and_the_shipped_example_holds_the_defaults():
    from importlib.resources import files

    from drivetrain_roles.grpo.config import load_config as load_grpo_config

    with pytest.raises(ConfigError, match=r"adv_estimator='gae' needs a critic's values"):
        load_grpo_config(None, ["algorithm.adv_estimator=gae"])
    assert load_config(str(files("drivetrain_roles.ppo").joinpath("example.yaml"))) == load_config()
    assert (
        load_config(None, ["rollout.n=1"]).rollout.n == 1
    )  # one response per prompt: the critic is the baseline


def test_a_bad_setting_is_one_line_from_the_command(tmp_path):
    from click.testing import CliRunner
    from drivetrain_engine_core._cli import main as drivetrain_cli

    result = CliRunner().invoke(
        drivetrain_cli, ["ppo", "--output-dir", str(tmp_path / "run"), "algorithm.adv_estimator=rloo"]
    )
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "algorithm.adv_estimator='rloo' needs no critic" in result.output


def test_run_folder_and_resume(tmp_path, config_for, plotted):
    trainer = ["total_steps=2", "prompts_per_step=4", "warm_start_steps=3", "eval_every=1", "eval_samples=8"]
    config = config_for(
        "builtin:arithmetic",
        *(f"trainer.{v}" for v in [*trainer, "save_every=1", "progress_bar=false", "critic_warmup=1"]),
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=8",
    )
    run = tmp_path / "run"
    first = PPOTrainer(config, run).run()
    assert first.start_step == 0 and len(first.rewards) == 2
    for name in ("reward_curve.png", "summary.json", "final_model/config.json", "critic_start/config.json"):
        assert (run / name).exists(), name
    assert (run / "checkpoints" / "critic" / "global_step_2" / "manifest.json").exists()
    longer = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, total_steps=3))
    resumer = PPOTrainer(longer, run, resume=True)
    resumed = resumer.run()
    assert resumed.start_step == 2 and len(resumed.rewards) == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    series = plotted(run / "reward_curve.png")  # GRPO's panels and the critic's explained variance
    assert {
        "train/reward",
        "val/accuracy",
        "train/kl",
        "rollout/mismatch_kl",
        "critic/vf_explained_var",
    } <= set(series)
    # The critic's warm-up: the first step trains the critic alone (no actor metrics, no hand-off).
    assert "train/pg_loss" not in steps[0] and "rollout/sync_bytes" not in steps[0]
    keys = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/returns_mean"}
    keys |= {
        "critic/advantages_mean",
        "critic/advantages_std",
        "train/clip_fraction",
        "train/kl",
        "train/kl_coef",
    }
    assert keys <= set(steps[1]), keys - set(steps[1])
    # The adaptive KL coefficient of step 3 continues from the one saved with step 2.
    assert steps[2]["train/kl_coef"] != config.algorithm.kl_ctrl.kl_coef
    assert resumer.critic.updates_done == 3 and resumer.actor.updates_done == 2


def test_a_refused_resume_writes_nothing_in_the_run_folder(tmp_path, folder_state):
    """A resume refused at the actor's checkpoint (another seed; another model, now refused before, at the run's
    recorded start) had already rebuilt ``critic_start``, linking the run's critic start to the refused model; the
    critic is made once the checkpoint has loaded and matched the run, so the folder is as it was, entry for entry."""
    from click.testing import CliRunner
    from drivetrain_engine_core._cli import main as drivetrain_cli
    from drivetrain_engine_core.testing import make_tiny_model_dir

    run = tmp_path / "run"
    first = [
        f"model.path={write_model_dir(tmp_path / 'model', seed=3)}",
        *("engine.micro_batch.micro_batch_size=4", "engine.micro_batch.max_tokens=null"),
        *("rollout.n=2", "rollout.max_new_tokens=4", "algorithm.ppo_mini_batches=1"),
        *("data.generated_train_size=8", "data.generated_val_size=0", "trainer.prompts_per_step=2"),
        *("trainer.total_steps=1", "trainer.save_every=1", "trainer.critic_warmup=0"),
        "trainer.progress_bar=false",
    ]
    started = CliRunner().invoke(drivetrain_cli, ["ppo", "--output-dir", str(run), *first])
    assert started.exit_code == 0, started.output
    assert (run / CRITIC_START_DIR / "config.json").is_file()
    before = folder_state(run)
    other = make_tiny_model_dir(tmp_path / "other", hidden_size=48)
    refusals = {
        "trainer.seed=7": "trained with trainer.seed=0, this run has 7; resume with the same value or start a new",
        # Refused before the checkpoint loads, by the run's recorded start (jobs.resume_start).
        f"model.path={other}": f"started from model.path={tmp_path / 'model'} ({run / 'config.yaml'}), this --resume",
    }
    for override, message in refusals.items():
        refused = CliRunner().invoke(drivetrain_cli, ["ppo", "--resume", "--output-dir", str(run), override])
        assert refused.exit_code == 1 and "Traceback" not in refused.output
        assert message in refused.output
        assert folder_state(run) == before, override


def test_a_users_schedule_spans_the_steps_each_model_trains():
    """``optimizer.lr_schedule=cosine`` asked for ``optimizer.total_steps``; the run's length is its one source:
    the actor's schedule spans the steps it trains (frozen for ``critic_warmup``), the critic's every step."""
    config = load_config(
        None,
        [
            "optimizer.lr_schedule=cosine",
            "critic.optimizer.lr_schedule=linear",
            "trainer.total_steps=50",
            "trainer.critic_warmup=10",
        ],
    )
    actor, critic = config.run_optimizer(), config.run_critic_optimizer()
    assert (actor.lr_schedule, actor.total_steps, actor.warmup_steps) == ("cosine", 40, 10)
    assert (critic.lr_schedule, critic.total_steps, critic.warmup_steps) == ("linear", 50, 0)
    assert (
        load_config(None, ["optimizer.lr_schedule=cosine", "optimizer.total_steps=30"])
        .run_optimizer()
        .total_steps
        == 30
    )
    with pytest.raises(ConfigError, match=r"needs optimizer.total_steps greater than warmup_steps"):
        load_config(
            None, ["optimizer.lr_schedule=cosine", "trainer.total_steps=15", "trainer.critic_warmup=10"]
        )
