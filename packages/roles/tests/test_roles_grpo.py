"""``drivetrain grpo``: group advantages, first-step parity with a plain Hugging Face GRPO, the run folder and resume.

Parity: the first step's loss and grad norm equal a single-process implementation of the same algorithm on
the Hugging Face model (same samples, same rewards) within 1e-5 fp32, and the rollout's log-probs of the
synced weights equal the actor's recomputed ones within 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.rollout import RolloutOutput, SamplingConfig
from drivetrain_engine_core.testing.launcher import run_distributed
from drivetrain_engine_core.testing.reference import grad_norm, load_reference_model
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.step import rollout_batch, sample, score, update
from drivetrain_roles.grpo.trainer import GRPOTrainer
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.jobs.default_assets import (
    build_arithmetic_tokenizer,
    write_model_dir,
)
from drivetrain_roles.rl.advantage_estimators import group_advantages
from drivetrain_roles.rl.batch import RolloutBatch
from drivetrain_roles.rl.policy_update import RolloutStatistics, log_prob_gap, mismatch_kl_sum
from drivetrain_roles.rl.rewards import RewardError, compute_rewards, exact_answer_rewards
from drivetrain_roles.rl.sampling import sampling_config
from drivetrain_roles.rollout.hf import HFRollout
from tensordict import TensorDict

N, TEMPERATURE, KL_COEF = 4, 0.8, 0.1
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, 4)
    expected = (rewards[:4] - 0.5) / (rewards[:4].std() + 1e-6)
    torch.testing.assert_close(advantages[:4], expected)
    assert torch.equal(advantages[4:], torch.zeros(4))  # all right: nothing to prefer
    assert exact_answer_rewards([" 12", "13", "1"], ["12", "12", "1 "]).tolist() == [1.0, 0.0, 1.0]


def test_dr_grpo_keeps_the_centred_rewards_unscaled():
    """Dr. GRPO (verl's ``norm_adv_by_std_in_grpo=False``): the deviation's division weights prompts whose rewards
    barely differ most."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    assert group_advantages(rewards, 4, scale_by_std=False).tolist() == [
        0.75,
        -0.25,
        -0.25,
        -0.25,
        0,
        0,
        0,
        0,
    ]
    assert load_config(None, ["algorithm.scale_by_std=false"]).algorithm.scale_by_std is False


def test_a_group_of_one_keeps_its_rewards_as_advantages():
    """One response per prompt: its unbiased deviation is NaN, which made every advantage NaN (and the batch was
    refused as non-finite, naming no cause); verl takes mean 0 and deviation 1 for such a group."""
    rewards = torch.tensor([1.0, 0.0, 1.0])
    assert group_advantages(rewards, 1).tolist() == [1.0, 0.0, 1.0]


def test_the_log_prob_gap_skips_empty_responses():
    """A third-party rollout may return an empty response; the max over its no tokens raised."""
    offsets = torch.tensor([0, 3, 5])
    nested = lambda flat: torch.nested.nested_tensor_from_jagged(flat, offsets)  # noqa: E731
    batch = {"loss_mask": nested(torch.tensor([False, True, True, False, False]))}
    actor = nested(torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0]))
    gap = log_prob_gap(batch, actor, [torch.tensor([-1.5, -2.0]), torch.tensor([])])
    assert gap == pytest.approx(0.5)


def test_the_mismatch_kl_is_the_k3_estimate_over_response_tokens():
    """``rollout/mismatch_kl``: sum of ``r - 1 - log r``, ``r = exp(actor - rollout)``, over response tokens only."""
    offsets = torch.tensor([0, 3, 5])
    nested = lambda flat: torch.nested.nested_tensor_from_jagged(flat, offsets)  # noqa: E731
    batch = {"loss_mask": nested(torch.tensor([False, True, True, True, False]))}
    actor = nested(torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0]))
    rollout = [torch.tensor([-1.5, -2.0]), torch.tensor([-2.5])]
    expected = sum(math.exp(d) - 1 - d for d in (0.5, 0.0, -0.5))
    assert mismatch_kl_sum(batch, actor, rollout) == pytest.approx(expected, rel=1e-12)
    assert mismatch_kl_sum(batch, actor, [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0])]) == 0.0


def test_the_rollout_statistics_leave_out_filtered_groups():
    """Regression: a group ``algorithm.filter_groups`` took out of the loss (all rewards equal) has no loss token;
    comparing its responses' log-probs failed the step with a shape error. Two prompts of two responses: the
    first group's rewards are equal, so the gap, the k3 sum, the entropy and the token count cover the second
    group's three response tokens."""
    responses = [[5, 6], [7, 8, 9], [5], [6, 7]]
    rolled = [[-0.1, -0.2], [-0.3, -0.4, -0.5], [-1.0], [-2.0, -3.0]]
    output = RolloutOutput(
        responses=[torch.tensor(r) for r in responses],
        log_probs=[torch.tensor(r) for r in rolled],
        version=None,
        n=2,
    )
    examples = [Example(prompt_ids=[1, 2], response_ids=[], prompt_text="", response_text="")] * 2
    config = load_config(None, ["rollout.n=2", "rollout.max_new_tokens=4", "algorithm.filter_groups=true"])
    samples = rollout_batch(examples, output, torch.tensor([1.0, 1.0, 0.0, 1.0]), config)
    assert samples.filtered_groups == 1
    offsets = samples.batch["input_ids"].offsets()
    tokens = int(offsets[-1])
    old = TensorDict(
        {
            "log_probs": torch.nested.nested_tensor_from_jagged(-0.25 * torch.ones(tokens), offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(
                torch.arange(tokens, dtype=torch.float), offsets
            ),
        },
        batch_size=[4],
    )
    statistics = RolloutStatistics.measure(samples.batch, old, samples.rollout_log_probs)
    differences = [-0.25 - r for r in (-1.0, -2.0, -3.0)]  # the second group's response tokens
    assert statistics.log_prob_gap == pytest.approx(max(abs(d) for d in differences))
    assert statistics.mismatch_kl_sum == pytest.approx(sum(math.exp(d) - 1 - d for d in differences))
    # The second group's response tokens sit at 2 (after [1, 2]) of the third sequence and 2, 3 of the fourth.
    third, fourth = int(offsets[2]), int(offsets[3])
    assert statistics.entropy_sum == third + 2 + fourth + 2 + fourth + 3
    assert statistics.response_tokens == 3


@pytest.fixture
def config_for(small_rl_config):
    """``config(model_path, *overrides)``: GRPO with N responses at TEMPERATURE and the KL loss at KL_COEF."""
    settings = (f"rollout.n={N}", f"rollout.temperature={TEMPERATURE}", f"algorithm.kl_loss_coef={KL_COEF}")
    return lambda model_path, *overrides: small_rl_config(load_config, model_path, *settings, *overrides)


REWARD_FILE = """from __future__ import annotations

from dataclasses import dataclass

def answer_length(*, prompts, completions, references):
    return [len(c) + (0.5 if p.endswith("=") else 0.0) for p, c in zip(prompts, completions)]

@dataclass
class Weights:
    length: float = 1.0

def weighted_length(*, prompts, completions, references):
    return [Weights().length * len(c) for c in completions]

def tensor_scores(*, prompts, completions, references):
    import torch
    return torch.tensor([float(len(c)) for c in completions])

def numpy_scores(*, prompts, completions, references):
    import numpy
    return [numpy.float32(len(c)) for c in completions]

def broken(*, prompts, completions, references):
    return [float("nan")] * len(completions)
"""


def test_a_reward_function_from_a_file_scores_the_samples(tmp_path, arithmetic_prompts):
    """The reward was hard-wired to exact answers: verl users bring a reward file and a function name, TRL users
    reward functions that read ``completions``. The function gets the decoded texts and its numbers are the
    rewards the advantages normalise."""
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    tokenizer = build_arithmetic_tokenizer()
    examples = arithmetic_prompts(tokenizer, 2)
    output = RolloutOutput(
        responses=[
            torch.tensor(tokenizer.encode(t, add_special_tokens=False)) for t in ("1", "12", "3", "456")
        ],
        log_probs=[torch.zeros(n) for n in (1, 2, 1, 3)],
        version=None,
        n=2,
    )
    config = load_config(None, [f"algorithm.reward_function={tmp_path / 'my_rewards.py'}:answer_length"])
    samples = score(examples, output, tokenizer, config)
    assert samples.rewards.tolist() == [1.5, 2.5, 1.5, 3.5]
    torch.testing.assert_close(
        samples.batch["advantages"].values()[samples.batch["loss_mask"].values()][[0, 1, 3, 4]],
        group_advantages(samples.rewards, 2)[[0, 1, 2, 3]],
    )
    setting = f"algorithm.reward_function={tmp_path / 'my_rewards.py'}:answer_length"
    unscaled = score(
        examples, output, tokenizer, load_config(None, [setting, "algorithm.scale_by_std=false"])
    )
    response = unscaled.batch["loss_mask"].values()
    assert unscaled.batch["advantages"].values()[response][[0, 1, 3, 4]].tolist() == [-0.5, 0.5, -1.0, 1.0]
    exact = score(examples, output, tokenizer, load_config(None, ["algorithm.reward_function=exact_match"]))
    assert exact.rewards.tolist() == [
        float(a == examples[i // 2].response_text) for i, a in enumerate(["1", "12", "3", "456"])
    ]
    module = "drivetrain_roles.rl.rewards:exact_match_reward"
    assert (
        score(
            examples, output, tokenizer, load_config(None, [f"algorithm.reward_function={module}"])
        ).rewards.tolist()
        == exact.rewards.tolist()
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/missing.py:f", r"importing '.*missing\.py' failed \(FileNotFoundError"),
        (
            "{dir}/my_rewards.py:nothing",
            r"has no function 'nothing'; define nothing\(\*, prompts, completions",
        ),
        (
            "{dir}/my_rewards.py:broken",
            r"returned \[nan, nan\] for 2 completions; it must return one finite number",
        ),
        ("no.such.module:f", r"importing 'no\.such\.module' failed \(ModuleNotFoundError"),
    ],
)
def test_a_reward_function_that_cannot_serve_is_one_clear_error(tmp_path, spec, message):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    with pytest.raises(RewardError, match=message):
        compute_rewards(
            spec.format(dir=tmp_path), prompts=["1+1="] * 2, completions=["2", "3"], references=["2"] * 2
        )


@pytest.mark.parametrize("function", ["numpy_scores", "tensor_scores", "weighted_length"])
def test_numpy_and_tensor_rewards_and_files_with_dataclasses_serve(tmp_path, function):
    """np.float32 is no Python float and a tensor's items are 0-d tensors; a reward file with a ``@dataclass``
    failed to load ("'NoneType' object has no attribute '__dict__'": it was not in ``sys.modules``)."""
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    spec = f"{tmp_path / 'my_rewards.py'}:{function}"
    rewards = compute_rewards(spec, prompts=["1+1="] * 2, completions=["2", "33"], references=["2"] * 2)
    assert rewards.tolist() == [1.0, 2.0]


def test_a_reward_function_setting_without_a_name_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.reward_function='rewards\.py': write a built-in reward \(exact_match, step_credit, math_verify\)",
    ):
        load_config(None, ["algorithm.reward_function=rewards.py"])


def test_truncated_sampling_reaches_the_rollout_and_bad_ranges_are_refused():
    config = load_config(None, ["rollout.top_k=5", "rollout.top_p=0.9", "rollout.min_p=0.05"])
    assert sampling_config(config, seed=7) == SamplingConfig(
        n=8, temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, max_new_tokens=6, seed=7
    )
    with pytest.raises(ConfigError, match=r"rollout.top_k/top_p/min_p: .*got top_k=0, top_p=1.5, min_p=0.0"):
        load_config(None, ["rollout.top_p=1.5"])


def test_first_step_matches_a_plain_hugging_face_grpo(tmp_path, config_for, arithmetic_prompts):
    model_dir = write_model_dir(tmp_path / "model", seed=3)
    tokenizer = build_arithmetic_tokenizer()
    config = config_for(model_dir)
    trainer = GRPOTrainer(config, tmp_path / "run")
    actor = trainer.make_actor(str(model_dir))
    reference = trainer.make_reference(actor, str(model_dir))
    rollout = HFRollout(model_path=str(model_dir))
    samples = sample(rollout, arithmetic_prompts(tokenizer, 3), tokenizer, config, seed=0)
    # The untrained model is never right: give the groups rewards, so that the update is not zero.
    advantages = group_advantages(REWARDS, N)
    samples.batch["advantages"] = torch.nested.nested_tensor_from_jagged(
        torch.repeat_interleave(advantages, samples.batch["input_ids"].offsets().diff()),
        offsets=samples.batch["input_ids"].offsets(),
    )
    batch = samples.batch.clone()
    metrics = update(
        actor,
        reference,
        RolloutBatch(samples.batch, samples.rollout_log_probs, REWARDS, samples.response_lengths),
    )
    assert metrics["rollout/log_prob_diff_max"] < 1e-5
    loss, norm, entropy = _plain_grpo_first_step(model_dir, batch, advantages)
    assert metrics["pg_loss"] + KL_COEF * metrics["kl_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    # The entropy of the rollout's policy over response tokens, from the old-log-prob pass.
    assert metrics["entropy"] == pytest.approx(entropy, rel=1e-5)


def test_a_rollout_longer_than_the_model_or_the_token_budget_is_refused_up_front(tmp_path, config_for):
    """The longest prompt plus ``rollout.max_new_tokens`` over the model's positions or the micro-batch budget
    failed with a BatchError at the first step whose sample grew that long, possibly hours in."""
    from drivetrain_engine_core.backend import ConfigError

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    config = config_for(model_dir, "rollout.max_new_tokens=100000")
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=100000 is \d+ tokens, over the model's"):
        GRPOTrainer(config, tmp_path / "run").run()
    config = config_for(
        model_dir, "engine.micro_batch.micro_batch_size=null", "engine.micro_batch.max_tokens=8"
    )
    with pytest.raises(ConfigError, match=r"over engine.micro_batch.max_tokens=8"):
        GRPOTrainer(config, tmp_path / "run2").run()


def test_a_rollout_that_is_not_installed_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    """``rollout.name=vllm`` passed the config checks and failed only after the SFT warm start."""
    from drivetrain_engine_core.backend import PluginError
    from drivetrain_roles.rl import policy_trainer

    monkeypatch.setattr(policy_trainer, "start_model", lambda *a, **k: pytest.fail("the warm start ran"))
    config = load_config(None, ["rollout.name=vllm", "trainer.progress_bar=false"])
    with pytest.raises(PluginError, match=r"vllm"):
        GRPOTrainer(config, tmp_path / "run").run()


def _plain_grpo_first_step(model_dir, batch, advantages):
    """GRPO's first step written out on the Hugging Face model: ratio 1, PPO clip, k3 KL, token mean; also the
    token-mean entropy of the policy over response tokens."""
    model = load_reference_model(model_dir)
    reference = load_reference_model(model_dir)
    terms, kls, entropies, count = [], [], [], 0
    for ids, mask, advantage in zip(
        batch["input_ids"].unbind(), batch["loss_mask"].unbind(), advantages, strict=True
    ):
        logits = model(ids[None]).logits[0, :-1] / TEMPERATURE
        log_softmax = torch.log_softmax(logits, -1)
        log_probs = log_softmax.gather(-1, ids[1:, None])[:, 0][mask[1:]]
        entropies.append(-(log_softmax.exp() * log_softmax).sum(-1)[mask[1:]].detach())
        with torch.no_grad():
            ref_logits = reference(ids[None]).logits[0, :-1] / TEMPERATURE
            ref = torch.log_softmax(ref_logits, -1).gather(-1, ids[1:, None])[:, 0][mask[1:]]
        ratio = torch.exp(log_probs - log_probs.detach())
        terms.append(torch.maximum(-advantage * ratio, -advantage * ratio.clamp(0.8, 1.2)).sum())
        delta = ref - log_probs
        kls.append((torch.exp(delta) - 1 - delta).sum())
        count += int(mask.sum())
    loss = (torch.stack(terms).sum() + KL_COEF * torch.stack(kls).sum()) / count
    loss.backward()
    entropy = float(torch.cat(entropies).mean())
    return float(loss.detach()), grad_norm(list(model.parameters())), entropy


def test_run_folder_and_resume(tmp_path, config_for, plotted):
    trainer = ["total_steps=2", "prompts_per_step=4", "warm_start_steps=3", "eval_every=1", "eval_samples=8"]
    config = config_for(
        "builtin:arithmetic", *(f"trainer.{v}" for v in [*trainer, "save_every=1", "progress_bar=false"])
    )
    run = tmp_path / "run"
    first = GRPOTrainer(config, run).run()
    assert first.start_step == 0 and len(first.rewards) == 2
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "reward_curve.png",
        "summary.json",
        "final_model/config.json",
        "warm_start/final_model/config.json",
        "checkpoints/latest",
    ):
        assert (run / name).exists(), name
    # The loop beats (a collective timeout names the ranks behind, as in sft); it ended saving step 2.
    beat = json.loads((run / "heartbeat" / "rank0.json").read_text())
    assert (beat["step"], beat["phase"]) == (2, "save")
    longer = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, total_steps=3))
    resumed = GRPOTrainer(longer, run, resume=True).run()
    assert resumed.start_step == 2 and len(resumed.rewards) == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train/reward" in r]
    assert steps == [1, 2, 3]
    # The resumed run's curve: reward, held-out exact match, KL and the rollout/actor gap of all 3 steps.
    series = plotted(run / "reward_curve.png")
    assert series["train/reward"]["panel"] == "reward per completion (exact_match)"
    assert series["train/kl"]["points"] == series["rollout/mismatch_kl"]["points"] == 3
    assert {"val/reward", "val/accuracy", "rollout/log_prob_diff_max"} <= set(series)
    keys = {"train/reward", "train/kl", "train/clip_fraction", "train/response_length", "perf/tokens_per_s"}
    assert keys <= set(records[-2]) and all(
        r["rollout/log_prob_diff_max"] < 1e-5 for r in records if "rollout/log_prob_diff_max" in r
    )
    # Every step's hand-off reports its cost: the first of a run is full and verified, later ones are deltas on
    # the version served (here they send nothing: every reward is 0, so the policy never changes).
    syncs = [
        {k.removeprefix("rollout/sync_"): v for k, v in r.items() if "sync" in k}
        for r in records
        if "train/reward" in r
    ]
    assert (syncs[0]["delta"], syncs[0]["verified"], syncs[0]["fraction_changed"]) == (0.0, 1.0, 1.0)
    assert syncs[0]["bytes"] > 0 and all(s["delta"] == 1.0 for s in syncs[1:]), syncs


def test_shipped_example_yaml_holds_the_defaults():
    from importlib.resources import files

    assert load_config(str(files("drivetrain_roles.grpo").joinpath("example.yaml"))) == load_config()


def test_ppo_mini_batches_and_epochs_set_the_actor_update_schedule(tmp_path, config_for):
    from drivetrain_engine_core.backend import ConfigError

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    config = config_for(model_dir, "algorithm.ppo_mini_batches=2", "algorithm.ppo_epochs=3")
    schedule = GRPOTrainer(config, tmp_path / "run").make_actor(str(model_dir)).config.schedule
    sequences = config.trainer.prompts_per_step * N
    assert (schedule.mini_batch_size, schedule.epochs, schedule.shuffle) == (sequences // 2, 3, True)
    with pytest.raises(ConfigError, match=r"algorithm\.ppo_epochs must be >= 1"):
        config_for(model_dir, "algorithm.ppo_epochs=0")
    # 9 sequences in mini-batches of ceil(9 / 4) = 3 made 3 optimizer steps, not 4.
    with pytest.raises(ConfigError, match=r"ppo_mini_batches=4 must divide .* 3 x 3 = 9"):
        config_for(model_dir, "algorithm.ppo_mini_batches=4", "trainer.prompts_per_step=3", "rollout.n=3")


def test_layouts_that_cannot_make_the_configured_optimizer_steps_are_refused_up_front(tmp_path, config_for):
    """A rank sampling fewer sequences than ``ppo_mini_batches`` failed at the first update (after the warm
    start and a rollout); the colocated controller's mini-batches, sized for ``trainer.prompts_per_step``, made
    another number of optimizer steps for another prompt count; ``epsilon=0`` made equal-reward groups NaN."""
    from drivetrain_engine_core.backend import BatchError, ConfigError
    from drivetrain_roles.grpo.config import check_mini_batch_share
    from drivetrain_roles.grpo.controller import ColocatedGRPO

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    config = config_for(
        model_dir, "trainer.prompts_per_step=2", "rollout.n=2", "algorithm.ppo_mini_batches=4"
    )
    check_mini_batch_share(config, world_size=1)  # 4 sequences on one rank: 4 steps of one
    with pytest.raises(
        ConfigError, match=r"ranks samples 2 sequences .* algorithm.ppo_mini_batches=4 .* <= 2\."
    ):
        check_mini_batch_share(config, world_size=2)
    examples = [Example(prompt_ids=[1], response_ids=[], prompt_text="", response_text="")] * 3
    with pytest.raises(BatchError, match=r"got 3 prompts, but trainer.prompts_per_step=2"):
        ColocatedGRPO(None, config, None).sample(0, examples)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"algorithm.epsilon must be > 0"):
        config_for(model_dir, "algorithm.epsilon=0")


def test_the_warm_start_is_reused_only_by_a_resumed_run(monkeypatch, tmp_path) -> None:
    """The embedded job's SFT warm start ran once per run folder: a new ``--overwrite`` run with other warm-start
    steps, seed or data silently started from the old one, and one cut short after writing ``config.json``
    was reused forever. Now only a resumed run reuses it, and only a finished one (its ``summary.json``)."""
    from drivetrain_roles.rl.warm_start import start_model
    from drivetrain_roles.sft import warm_start

    runs = []

    class FakeSFTTrainer:
        def __init__(self, config, output_dir, overwrite, batch_size_setting, ctrl_c_saves):
            self.config, self.output_dir = config, output_dir

        def run(self):
            runs.append(self.config.trainer.total_steps)
            (self.output_dir / "final_model").mkdir(parents=True, exist_ok=True)
            (self.output_dir / "final_model" / "config.json").write_text("{}")
            if self.config.trainer.total_steps != 13:  # 13: a warm start cut short before its summary
                summary = {"evaluations": [], "config": {"model": {"path": self.config.model.path}}}
                (self.output_dir / "summary.json").write_text(json.dumps(summary))
            return type("Result", (), {"evaluations": []})()

    monkeypatch.setattr(warm_start, "SFTTrainer", FakeSFTTrainer)

    def config(steps: int):
        return load_config(None, [f"trainer.warm_start_steps={steps}"])

    start_model(config(13), tmp_path, resume=False)
    start_model(config(13), tmp_path, resume=True)  # cut short: run again
    start_model(config(7), tmp_path, resume=False)  # a new run with other settings
    final = start_model(config(7), tmp_path, resume=True)  # a resumed run reuses it
    assert runs == [13, 13, 7]
    assert final == str(tmp_path / "warm_start" / "final_model")


RANK_ONE_FAILS = """
import torch.distributed as dist

def flaky(*, prompts, completions, references):
    if dist.get_rank() == 1:
        raise ConnectionError("the grader service is down")
    return [0.0] * len(completions)
"""


class _FixedRollout:
    """Answers every prompt with the same two one-token responses."""

    def __init__(self, token: int) -> None:
        self.token = token

    def generate(self, prompts, sampling):
        responses = [torch.tensor([self.token]) for _ in range(len(prompts) * sampling.n)]
        return RolloutOutput(
            responses=responses, log_probs=[torch.zeros(1) for _ in responses], version=None, n=sampling.n
        )


def _sample_on_two_ranks(rank: int, world_size: int, reward_file: str, examples: list[Example]) -> str:
    tokenizer = build_arithmetic_tokenizer()
    config = load_config(None, [f"algorithm.reward_function={reward_file}:flaky", "rollout.n=2"])
    rollout = _FixedRollout(tokenizer.encode("3", add_special_tokens=False)[0])
    try:
        sample(rollout, examples, tokenizer, config, seed=0)  # type: ignore[arg-type]
    except RewardError as e:
        return str(e)
    return "scored"


def test_a_reward_function_failing_on_one_rank_fails_every_rank(tmp_path, arithmetic_prompts):
    """A grader failing on rank 1 alone left rank 0 waiting in the update's collectives until the timeout."""
    reward_file = tmp_path / "flaky_rewards.py"
    reward_file.write_text(RANK_ONE_FAILS)
    examples = arithmetic_prompts(build_arithmetic_tokenizer(), 1)
    answers = run_distributed(_sample_on_two_ranks, str(reward_file), examples, world_size=2, timeout_s=120)
    assert answers[0] == answers[1]
    assert answers[0].startswith("rank 1 (of failing ranks 1): reward function 'flaky' (")
    assert "raised ConnectionError: the grader service is down" in answers[0]


@pytest.mark.parametrize(("command", "default"), [("grpo", 175), ("ppo", 200)])
def test_a_warm_start_of_zero_steps_names_the_commands_own_default(command, default) -> None:
    """grpo's and ppo's warm starts differ in length; the refusal read a fixed 200 for both."""
    from drivetrain_roles.ppo.config import load_config as load_ppo_config

    load = {"grpo": load_config, "ppo": load_ppo_config}[command]
    with pytest.raises(ConfigError, match=rf"at least 1 step \({default} by default\)"):
        load(None, ["trainer.warm_start_steps=0"])
