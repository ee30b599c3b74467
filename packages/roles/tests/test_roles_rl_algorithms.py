"""The RL algorithms chosen by name, each against its formula written out here per sequence in plain Python.

Advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++ and its baseline variant), policy losses (PPO-clip with
clip-higher and dual-clip, GSPO, CISPO), aggregations (the five ``loss_agg_mode``s), KL ``abs``, DAPO's
overlong penalty and group filter; then the refusal of unknown names and of combinations that make no sense,
and one short ``drivetrain grpo`` run of a non-default combination.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import LossContext, jagged
from drivetrain_engine_core.rollout import RolloutOutput
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.step import rollout_batch
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.losses import FlatTokens, PolicyLossConfig, aggregate, kl_penalty, policy_loss_fn
from drivetrain_roles.rl.advantage_estimators import AdvantageConfig, outcome_advantages
from drivetrain_roles.rl.reward_shaping import equal_reward_groups, overlong_penalty
from tensordict import TensorDict

# Two groups of three responses. Prompt tokens have mask 0; the last response has a masked token inside it (a
# tool's output), which is not a step of the episode.
MASKS = [[0, 1, 1], [0, 0, 1, 1, 1, 1], [0, 1], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 0, 1, 1]]
SCORES = [1.0, 0.0, 0.5, 2.0, -1.0, 0.0]
GROUP = 3


def jagged_rows(rows, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    return torch.nested.nested_tensor(
        [torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged, requires_grad=requires_grad
    )


def loss_mask(masks=MASKS) -> torch.Tensor:
    offsets = torch.tensor([0, *torch.tensor([len(m) for m in masks]).cumsum(0).tolist()])
    return jagged(torch.tensor([x for m in masks for x in m], dtype=torch.bool), offsets)


def whiten_by_hand(rows, masks):
    """verl's masked_whiten written out: over every loss token, unbiased variance, eps 1e-8 inside the root."""
    values = [v for row, mask in zip(rows, masks, strict=True) for v, m in zip(row, mask, strict=True) if m]
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [
        [(v - mean) / math.sqrt(variance + 1e-8) if m else 0.0 for v, m in zip(row, mask, strict=True)]
        for row, mask in zip(rows, masks, strict=True)
    ]


def broadcast(per_sequence, masks=MASKS):
    return [[a if m else 0.0 for m in mask] for a, mask in zip(per_sequence, masks, strict=True)]


def groups_of(values):
    return [values[g : g + GROUP] for g in range(0, len(values), GROUP)]


def expected_advantages(name, gamma=1.0):
    per_sequence = []
    for group in groups_of(SCORES):
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            per_sequence.append(
                {
                    "grpo": (r - mean) / (std + 1e-6),
                    "dr_grpo": r - mean,
                    "rloo": r - sum(others) / len(others),
                    "reinforce_plus_plus_baseline": r - mean,
                }.get(name, r)
            )
    if name == "reinforce_plus_plus":
        rows = []
        for score, mask in zip(SCORES, MASKS, strict=True):
            steps = [i for i, m in enumerate(mask) if m]
            row = [0.0] * len(mask)
            for k, i in enumerate(steps):  # the score sits on the last loss token; discounted back per step
                row[i] = score * gamma ** (len(steps) - 1 - k)
            rows.append(row)
        return whiten_by_hand(rows, MASKS)
    rows = broadcast(per_sequence)
    return whiten_by_hand(rows, MASKS) if name == "reinforce_plus_plus_baseline" else rows


@pytest.mark.parametrize(
    ("name", "gamma"),
    [
        ("grpo", 1.0),
        ("dr_grpo", 1.0),
        ("rloo", 1.0),
        ("reinforce_plus_plus", 1.0),
        ("reinforce_plus_plus", 0.9),
        ("reinforce_plus_plus_baseline", 1.0),
    ],
)
def test_each_advantage_estimator_equals_its_formula(name, gamma):
    config = AdvantageConfig(adv_estimator=name, gamma=gamma)
    advantages = outcome_advantages(torch.tensor(SCORES), loss_mask(), GROUP, config)
    for row, want in zip(advantages.unbind(), expected_advantages(name, gamma), strict=True):
        assert row.tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_of_equal_graded_rewards_has_nothing_to_prefer(name):
    """Eight responses all scored 0.7 (partial credit): their float32 mean was not 0.7, so each got +0.056 (0.1:
    -0.007) instead of 0. Beside it a graded group with negative rewards, against the formula in float64."""
    masks = [[0, 1, 1]] * 16
    scores = [0.7] * 8 + [0.7, -0.3, 0.1, 1.0, -1.0, 0.25, 0.7, 0.1]
    advantages = outcome_advantages(
        torch.tensor(scores), loss_mask(masks), 8, AdvantageConfig(adv_estimator=name)
    )
    per_sequence = []
    for group in (scores[:8], scores[8:]):
        rewards = torch.tensor(group, dtype=torch.float32).tolist()  # the rewards as float32 holds them
        mean = sum(rewards) / 8
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 7)
        per_sequence += {
            "grpo": [(r - mean) / (std + 1e-6) for r in rewards],
            "rloo": [(r - mean) * 8 / 7 for r in rewards],
        }.get(name, [r - mean for r in rewards])
    assert per_sequence[:8] == [0.0] * 8  # what the formula gives a constant group
    want = broadcast(per_sequence, masks)
    if name == "reinforce_plus_plus_baseline":  # whitened over every loss token of the batch
        want = whiten_by_hand(want, masks)
    else:  # exactly 0, not within a tolerance
        assert [row.tolist() for row in advantages.unbind()[:8]] == [[0.0, 0.0, 0.0]] * 8
    for row, expected in zip(advantages.unbind(), want, strict=True):
        assert row.tolist() == pytest.approx(expected, abs=1e-6)


def test_grpo_without_the_deviation_is_dr_grpo():
    scaled_off = AdvantageConfig(adv_estimator="grpo", scale_by_std=False)
    advantages = outcome_advantages(torch.tensor(SCORES), loss_mask(), GROUP, scaled_off)
    for row, want in zip(advantages.unbind(), expected_advantages("dr_grpo"), strict=True):
        assert row.tolist() == pytest.approx(want, abs=1e-6)


# ------------------------------------------------------------------ aggregation

VALUES = [[9.0, 0.5, -1.0], [9.0, 9.0, 2.0, 1.0, 0.0, 3.0], [9.0, 4.0]]
AGG_MASKS = [[0, 1, 1], [0, 0, 1, 1, 1, 1], [0, 1]]


def aggregate_by_hand(mode, factor=None):
    sums = [
        sum(v for v, m in zip(row, mask, strict=True) if m)
        for row, mask in zip(VALUES, AGG_MASKS, strict=True)
    ]
    counts = [sum(mask) for mask in AGG_MASKS]
    return {
        "token-mean": sum(sums) / sum(counts),
        "seq-mean-token-sum": sum(sums) / len(sums),
        "seq-mean-token-mean": sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums),
        "seq-mean-token-sum-norm": sum(sums) / (len(sums) * factor) if factor else None,
        "token-sum": sum(sums),
    }[mode]


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"],
)
def test_each_aggregation_equals_its_formula_whatever_the_micro_batches(mode):
    """Each micro-batch's share, with the global counts, sums to the formula over the whole mini-batch."""
    context = LossContext(global_token_count=sum(map(sum, AGG_MASKS)), global_sequence_count=len(AGG_MASKS))
    total = 0.0
    for rows in ([0, 2], [1]):
        tokens = FlatTokens.from_jagged(jagged_rows([AGG_MASKS[i] for i in rows]))
        values = jagged_rows([VALUES[i] for i in rows]).values()
        total += float(aggregate(values, tokens, context, mode, loss_scale_factor=8))
    assert total == pytest.approx(aggregate_by_hand(mode, factor=8), rel=1e-6)


def test_the_constant_length_mode_needs_its_constant():
    with pytest.raises(ConfigError, match=r"loss_agg_mode='seq-mean-token-sum-norm' divides by a constant"):
        PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm")


# ------------------------------------------------------------------ policy losses

OLD = [[0.0, -1.0, -0.7, -2.0], [0.0, 0.0, -0.4, -1.5, -0.3]]
NEW = [[0.0, -0.6, -0.48, -1.0], [0.0, 0.0, -0.5, -0.9, -0.1]]
ADVANTAGES = [1.5, -0.8]
POLICY_MASKS = [[0, 1, 1, 1], [0, 0, 1, 1, 1]]


def policy_loss_and_grad(config: PolicyLossConfig):
    log_probs = jagged_rows(NEW, requires_grad=True)
    batch = TensorDict(
        {
            "loss_mask": jagged_rows(POLICY_MASKS),
            "old_log_probs": jagged_rows(OLD),
            "advantages": jagged_rows(broadcast(ADVANTAGES, POLICY_MASKS)),
        },
        batch_size=[2],
    )
    context = LossContext(global_token_count=6, global_sequence_count=2)
    loss, metrics = policy_loss_fn(config)(TensorDict({"log_probs": log_probs}, [2]), batch, context)
    loss.backward()
    return loss.detach(), metrics, log_probs.grad.values()


def response_tokens(rows, masks=POLICY_MASKS):
    """The loss tokens' values of each row, as leaf tensors, and their flat positions."""
    picked, positions, start = [], [], 0
    for row, mask in zip(rows, masks, strict=True):
        index = [i for i, m in enumerate(mask) if m]
        picked.append(torch.tensor([row[i] for i in index], requires_grad=True))
        positions.append([start + i for i in index])
        start += len(mask)
    return picked, positions


def flat_grad(leaves, positions):
    grad = torch.zeros(sum(len(m) for m in POLICY_MASKS))
    for leaf, where in zip(leaves, positions, strict=True):
        grad[where] = leaf.grad
    return grad


def test_clip_higher_clips_each_side_at_its_own_bound_and_dual_clip_caps_negative_advantages():
    low, high, c = 0.2, 0.28, 1.5
    config = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    loss, metrics, grad = policy_loss_and_grad(config)
    leaves, positions = response_tokens(NEW)
    terms, clipped, dual = [], 0, 0
    for new, old, advantage in zip(leaves, [o for o in response_tokens(OLD)[0]], ADVANTAGES, strict=True):
        for t in range(len(new)):
            ratio = torch.exp(new[t] - old[t].detach())
            surrogate = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - low, 1 + high))
            clipped += bool(-advantage * ratio.clamp(1 - low, 1 + high) > -advantage * ratio)
            if advantage < 0 and surrogate > -advantage * c:
                surrogate, dual = torch.tensor(-advantage * c), dual + 1
            terms.append(surrogate)
    expected = torch.stack(terms).sum() / 6
    expected.backward()
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(clipped / 6)
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(dual / 6)
    assert clipped == 2 and dual == 1  # ratios 1.49 and 2.7 clipped at 1.28 (1.25 is not), 1.82 dual-clipped
    torch.testing.assert_close(grad, flat_grad(leaves, positions))


def test_gspo_clips_one_sequence_level_ratio_and_has_its_gradient():
    """``s_i = exp(mean_t (log pi - log pi_old))``, loss ``mean_i max(-A_i s_i, -A_i clip(s_i))``: the per-token
    form must give the same value and the same gradient."""
    config = PolicyLossConfig(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.1)
    loss, metrics, grad = policy_loss_and_grad(config)
    leaves, positions = response_tokens(NEW)
    old_rows = response_tokens(OLD)[0]
    per_sequence = []
    for new, old, advantage in zip(leaves, old_rows, ADVANTAGES, strict=True):
        ratio = torch.exp((new - old.detach()).mean())
        per_sequence.append(torch.maximum(-advantage * ratio, -advantage * ratio.clamp(0.8, 1.1)))
    expected = torch.stack(per_sequence).mean()
    expected.backward()
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    torch.testing.assert_close(grad, flat_grad(leaves, positions))
    assert float(metrics["pg_clipfrac_lower"]) == 0.0  # GSPO has no dual clip


@pytest.mark.parametrize("low", [0.1, 10.0])
def test_cispo_weights_log_pi_by_the_clipped_ratio_without_its_gradient(low):
    """``clip_ratio_low=10`` (verl's CISPO example) leaves the weight unbounded below."""
    config = PolicyLossConfig(loss_mode="cispo", clip_ratio_low=low, clip_ratio_high=0.2)
    loss, metrics, grad = policy_loss_and_grad(config)
    leaves, positions = response_tokens(NEW)
    terms, clipped = [], 0
    for new, old, advantage in zip(leaves, response_tokens(OLD)[0], ADVANTAGES, strict=True):
        for t in range(len(new)):
            ratio = math.exp(float(new[t].detach()) - float(old[t].detach()))
            weight = min(max(ratio, 1 - low), 1.2)
            clipped += weight != ratio
            terms.append(-weight * advantage * new[t])
    expected = torch.stack(terms).sum() / 6
    expected.backward()
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(clipped / 6) and clipped
    torch.testing.assert_close(grad, flat_grad(leaves, positions))


@pytest.mark.parametrize("loss_mode", ["gspo", "cispo"])
def test_the_new_surrogates_read_nothing_back_from_the_device(monkeypatch, loss_mode):
    """As PPO-clip's (test_roles_losses): metrics stay device tensors, read once per step by the engine."""

    def no_read(*args, **kwargs):
        raise AssertionError("a loss function read a tensor back to the host")

    aggregation = "seq-mean-token-mean" if loss_mode == "gspo" else "seq-mean-token-sum-norm"
    config = PolicyLossConfig(
        loss_mode=loss_mode,
        loss_agg_mode=aggregation,
        loss_scale_factor=4,
        kl_loss_coef=0.1,
        kl_estimator="abs",
    )
    batch = TensorDict(
        {
            "loss_mask": jagged_rows(POLICY_MASKS),
            "old_log_probs": jagged_rows(OLD),
            "advantages": jagged_rows(broadcast(ADVANTAGES, POLICY_MASKS)),
            "ref_log_prob": jagged_rows(OLD),
        },
        batch_size=[2],
    )
    context = LossContext(global_token_count=6, global_sequence_count=2)
    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, no_read)
    _, metrics = policy_loss_fn(config)(TensorDict({"log_probs": jagged_rows(NEW)}, [2]), batch, context)
    monkeypatch.undo()
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())


def test_kl_abs_is_the_absolute_log_ratio():
    value = kl_penalty(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.5]), "abs")
    assert value.tolist() == pytest.approx([1.0, 0.5])


# ------------------------------------------------------------------ DAPO's reward shaping


def test_overlong_penalty_is_zero_then_linear_to_the_factor():
    lengths = torch.tensor([3, 6, 7, 8, 10])
    penalty = overlong_penalty(lengths, max_length=10, buffer_length=4, penalty_factor=0.5)
    expected = [min(-(n - (10 - 4)) / 4 * 0.5, 0.0) for n in lengths.tolist()]
    assert penalty.tolist() == pytest.approx(expected)
    assert overlong_penalty(lengths, 10, 0, 1.0).tolist() == [0.0] * 5


def test_filtered_groups_leave_the_loss_and_the_rest_get_their_estimator():
    """A step of two prompts, three responses each: the first group's rewards (after the overlong penalty) are
    all equal, so with ``filter_groups`` its responses have no loss token; the second gets RLOO advantages."""
    responses = [[5, 6], [5, 7], [8, 9], [5, 6, 7, 8], [5], [6, 6, 6]]
    output = RolloutOutput(
        responses=[torch.tensor(r) for r in responses],
        log_probs=[torch.zeros(len(r)) for r in responses],
        version=None,
        n=3,
    )
    examples = [
        Example(prompt_ids=[1, 2], response_ids=[], prompt_text="", response_text="") for _ in range(2)
    ]
    config = load_config(
        None,
        [
            "rollout.n=3",
            "rollout.max_new_tokens=4",
            "algorithm.adv_estimator=rloo",
            "algorithm.filter_groups=true",
            "algorithm.overlong_buffer_len=2",
            "algorithm.overlong_penalty_factor=1.0",
        ],
    )
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    samples = rollout_batch(examples, output, rewards, config)
    penalties = [min(-(len(r) - 2) / 2, 0.0) for r in responses]  # starts 2 tokens before max_new_tokens=4
    shaped = [float(r) + p for r, p in zip(rewards, penalties, strict=True)]
    assert samples.rewards.tolist() == pytest.approx(shaped)
    assert samples.filtered_groups == 1
    second = shaped[3:]
    rloo = [r - (sum(second) - r) / 2 for r in second]
    for k, (mask, advantage) in enumerate(
        zip(samples.batch["loss_mask"].unbind(), samples.batch["advantages"].unbind(), strict=True)
    ):
        response = [False, False] + [True] * len(responses[k])
        if k < 3:
            assert not mask.any()
        else:
            assert mask.tolist() == response
            assert advantage[mask].tolist() == pytest.approx([rloo[k - 3]] * len(responses[k]))
    assert equal_reward_groups(torch.tensor(shaped), 3).tolist() == [True, False]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.adv_estimator=rlo",
            r"algorithm.adv_estimator='rlo' is not known; did you mean 'rloo'\? choose one "
            r"of grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae",
        ),
        ("algorithm.loss_mode=gpso", r"algorithm.loss_mode='gpso' is not known; did you mean 'gspo'\?"),
        (
            "algorithm.loss_agg_mode=seq-mean-token-summ",
            r"did you mean 'seq-mean-token-sum'\? choose one of token-mean",
        ),
        (
            "algorithm.kl_estimator=low_var",
            r"algorithm.kl_estimator='low_var' is not known; did you mean 'low_var_kl'",
        ),
        (
            "algorithm.adv_estimator=gae",
            r"adv_estimator='gae' needs a critic's values, and drivetrain grpo trains no "
            r"critic; choose one of grpo, dr_grpo",
        ),
        ("algorithm.clip_ratio_c=1.0", r"clip_ratio_c=1.0: the dual-clip bound must be > 1 .* or null"),
        ("algorithm.loss_mode=gspo", r"loss_mode='gspo' with loss_agg_mode='token-mean'.* set that"),
        (
            "algorithm.clip_ratio_low=1.5",
            r"clip_ratio_low=1.5 with loss_mode='vanilla': .* Only loss_mode=cispo takes >= 1",
        ),
        (
            "algorithm.adv_estimator=rloo algorithm.scale_by_std=false",
            r"scale_by_std=False with adv_estimator='rloo': "
            r"only grpo reads it",
        ),
        ("algorithm.adv_estimator=dr_grpo algorithm.scale_by_std=true", r"use adv_estimator=grpo"),
        (
            "algorithm.gamma=0.9",
            r"gamma=0.9 with adv_estimator='grpo': only reinforce_plus_plus and gae discount",
        ),
        (
            "algorithm.loss_scale_factor=64",
            r"loss_scale_factor=64 is read only by loss_agg_mode=seq-mean-token-sum-norm",
        ),
        ("algorithm.overlong_buffer_len=6", r"overlong_buffer_len=6 must be below rollout.max_new_tokens=6"),
        (
            "rollout.lora_handoff=adapter",
            r"lora_handoff=adapter hands off the LoRA adapters alone, and model.lora is",
        ),
    ],
)
def test_unknown_names_and_senseless_combinations_are_refused_at_config_time(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


def test_the_constant_length_defaults_to_the_longest_response():
    config = load_config(
        None, ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_new_tokens=5"]
    )
    assert config.algorithm.policy_loss(max_new_tokens=5).loss_scale_factor == 5


# ------------------------------------------------------------------ end to end


def test_drivetrain_grpo_runs_a_non_default_combination(tmp_path):
    """``drivetrain grpo algorithm.adv_estimator=rloo algorithm.loss_mode=gspo ...`` for two steps on a tiny model:
    the response length as reward (the untrained model is never right), so that groups differ."""
    from click.testing import CliRunner
    from drivetrain_engine_core._cli import main as drivetrain_cli
    from drivetrain_roles.jobs.default_assets import write_model_dir

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    (tmp_path / "length.py").write_text(
        "def length(*, prompts, completions, references):\n    return [float(len(c)) for c in completions]\n"
    )
    overrides = [
        f"model.path={model_dir}",
        f"algorithm.reward_function={tmp_path / 'length.py'}:length",
        "algorithm.adv_estimator=rloo",
        "algorithm.loss_mode=gspo",
        "algorithm.loss_agg_mode=seq-mean-token-mean",
        "algorithm.clip_ratio_high=0.28",
        "algorithm.kl_estimator=abs",
        "algorithm.filter_groups=true",
        "algorithm.overlong_buffer_len=2",
        "optimizer.lr_schedule=cosine",  # its length is the run's (it asked for optimizer.total_steps)
        "optimizer.warmup_steps=0",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "trainer.eval_every=0",
        "trainer.eval_samples=4",
        "trainer.save_every=0",
        "trainer.progress_bar=false",
    ]
    result = CliRunner().invoke(drivetrain_cli, ["grpo", "--output-dir", str(tmp_path / "run"), *overrides])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # Cosine over the run's 2 steps from a user model's lr 1e-6: lr x (1 + cos(pi x step / 2)) / 2 per update.
    assert [r["train/lr"] for r in steps] == pytest.approx(
        [1e-6 * (1 + math.cos(math.pi * s / 2)) / 2 for s in (0, 1)]
    )
    for record in steps:
        assert 0.0 <= record["train/filtered_group_fraction"] <= 1.0
        assert math.isfinite(record["train/pg_loss"]) and math.isfinite(record["train/grad_norm"])
        # abs KL at the reference's own weights after one step of lr 1e-6: small, but an absolute value.
        assert record["train/kl"] >= 0.0
