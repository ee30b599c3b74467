"""Each loss against hand-computed values, and its invariance to how a mini-batch is cut into pieces."""

from __future__ import annotations

import math

import pytest
import torch
from drivetrain_engine_core.job import LossContext
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_roles.losses import (
    PolicyLossConfig,
    ValueLossConfig,
    kl_penalty,
    policy_loss_fn,
    sft_loss_fn,
    value_loss_fn,
)
from tensordict import TensorDict


def jagged(rows: list[list[float]], requires_grad: bool = False) -> torch.Tensor:
    return torch.nested.nested_tensor(
        [torch.tensor(r, dtype=torch.float32) for r in rows], layout=torch.jagged, requires_grad=requires_grad
    )


def context_for(mask_rows: list[list[float]]) -> LossContext:
    tokens = int(sum(sum(r) for r in mask_rows))
    return LossContext(global_token_count=tokens, global_sequence_count=len(mask_rows))


LOG_PROBS = [[0.0, -1.0, -2.0], [0.0, -0.5]]
MASK = [[0.0, 1.0, 1.0], [0.0, 1.0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 3.5 / 3),
        ("seq-mean-token-sum", (3.0 + 0.5) / 2),
        ("seq-mean-token-mean", (1.5 + 0.5) / 2),
    ],
)
def test_sft_loss_matches_hand_computation(mode: str, expected: float) -> None:
    output = TensorDict({"log_probs": jagged(LOG_PROBS)}, batch_size=[2])
    batch = TensorDict({"loss_mask": jagged(MASK)}, batch_size=[2])
    loss, _ = sft_loss_fn(mode)(output, batch, context_for(MASK))
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_sft_loss_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        sft_loss_fn("mean")


def test_policy_loss_matches_hand_computation() -> None:
    # Four response tokens: clipped above (A>0), clipped below (A<0), dual-clipped (A<0, ratio 5), unclipped.
    ratios = [1.5, 0.5, 5.0, 1.0]
    advantages = [1.0, -1.0, -1.0, 2.0]
    log_probs = [0.0, *[math.log(r) for r in ratios]]
    output = TensorDict(
        {"log_probs": jagged([log_probs]), "entropy": jagged([[0.0, 1.0, 2.0, 3.0, 4.0]])}, batch_size=[1]
    )
    mask = [[0.0, 1.0, 1.0, 1.0, 1.0]]
    batch = TensorDict(
        {
            "loss_mask": jagged(mask),
            "old_log_probs": jagged([[0.0] * 5]),
            "advantages": jagged([[0.0, *advantages]]),
            "ref_log_prob": jagged([[0.0, *[lp - 1.0 for lp in log_probs[1:]]]]),
        },
        batch_size=[1],
    )
    config = PolicyLossConfig(entropy_coeff=0.1, kl_loss_coef=0.5, kl_estimator="k1")
    loss, metrics = policy_loss_fn(config)(output, batch, context_for(mask))
    pg_loss = (-1.2 + 0.8 + 3.0 - 2.0) / 4
    entropy = (1 + 2 + 3 + 4) / 4
    kl = 1.0  # k1 = log pi - log pi_ref = 1 on every token
    assert metrics["pg_loss"] == pytest.approx(pg_loss, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)
    assert metrics["approx_kl"] == pytest.approx(-sum(math.log(r) for r in ratios) / 4, rel=1e-6)
    assert metrics["entropy"] == pytest.approx(entropy)
    assert metrics["kl_loss"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(pg_loss - 0.1 * entropy + 0.5 * kl, rel=1e-6)


def test_policy_loss_without_dual_clip_keeps_large_negative_advantage_loss() -> None:
    output = TensorDict({"log_probs": jagged([[0.0, math.log(5.0)]]), "entropy": jagged([[0.0, 0.0]])}, [1])
    batch = TensorDict(
        {
            "loss_mask": jagged([[0.0, 1.0]]),
            "old_log_probs": jagged([[0.0, 0.0]]),
            "advantages": jagged([[0.0, -1.0]]),
        },
        [1],
    )
    loss, _ = policy_loss_fn(PolicyLossConfig(clip_ratio_c=None))(output, batch, context_for([[0.0, 1.0]]))
    assert loss.item() == pytest.approx(5.0, rel=1e-6)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1.0)), ("low_var_kl", math.exp(-1.0))],
)
def test_kl_estimators_match_hand_computation(estimator: str, expected: float) -> None:
    value = kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), estimator)
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_kl_rejects_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="k3"):
        PolicyLossConfig(kl_estimator="k4")


def test_value_loss_matches_hand_computation() -> None:
    output = TensorDict({"values": jagged([[0.0, 1.0, 0.2]])}, [1])
    mask = [[0.0, 1.0, 1.0]]
    batch = TensorDict(
        {
            "loss_mask": jagged(mask),
            "values": jagged([[0.0, 0.0, 0.0]]),
            "returns": jagged([[0.0, 2.0, 0.0]]),
        },
        [1],
    )
    loss, metrics = value_loss_fn(ValueLossConfig(cliprange_value=0.5))(output, batch, context_for(mask))
    # token 1: v clipped to 0.5 -> 0.5 * (0.5 - 2)^2 = 1.125 (clipped); token 2: 0.5 * 0.2^2 = 0.02.
    assert loss.item() == pytest.approx((1.125 + 0.02) / 2, rel=1e-6)
    assert metrics["vf_clipfrac"] == pytest.approx(0.5)


def _sft_pieces(mode: str, log_probs: torch.Tensor, masks: list[list[float]], groups: list[list[int]]):
    """Sum of the losses of ``groups`` of sequences, each with the global context, and the gradient."""
    context = context_for(masks)
    leaf = log_probs.clone().requires_grad_(True)
    offsets = [0]
    for row in masks:
        offsets.append(offsets[-1] + len(row))
    total = torch.zeros(())
    for group in groups:
        rows = [leaf[offsets[i] : offsets[i + 1]] for i in group]
        output = TensorDict(
            {"log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, [len(group)]
        )
        batch = TensorDict({"loss_mask": jagged([masks[i] for i in group])}, [len(group)])
        loss, _ = sft_loss_fn(mode)(output, batch, context)
        total = total + loss
    total.backward()
    return total.detach(), leaf.grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_loss_and_gradient_do_not_depend_on_how_the_batch_is_split(mode: str) -> None:
    torch.manual_seed(0)
    masks = [[0, 0, 1, 1, 1], [0, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1]]
    log_probs = -torch.rand(sum(len(m) for m in masks))
    whole, whole_grad = _sft_pieces(mode, log_probs, masks, [[0, 1, 2, 3]])
    # Micro-batches of two, uneven "dynamic" pieces, and two data-parallel shards of unequal token counts.
    for groups in ([[0, 1], [2, 3]], [[2], [0, 3], [1]], [[0, 2, 3], [1]]):
        total, grad = _sft_pieces(mode, log_probs, masks, groups)
        torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_nan_and_inf_outside_the_mask_change_neither_losses_nor_gradients(mode: str) -> None:
    # Prompt positions (mask 0) hold NaN old log-probs, inf advantages, NaN reference log-probs, values and
    # returns: what a rollout leaves in fields it never set. The masked tokens must be selected out, not
    # multiplied by 0 (NaN * 0 = NaN, in the loss and in every gradient that flows through it).
    mask = [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    nan, inf = float("nan"), float("inf")
    clean = {
        "old_log_probs": [[0.0, -0.9, -2.2], [0.0, 0.0, -0.4]],
        "advantages": [[0.0, 1.0, -0.5], [0.0, 0.0, 2.0]],
        "ref_log_prob": [[0.0, -1.1, -1.9], [0.0, 0.0, -0.6]],
        "values": [[0.0, 0.3, -0.2], [0.0, 0.0, 0.5]],
        "returns": [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
    }
    poisoned = {
        "old_log_probs": [[nan, -0.9, -2.2], [nan, nan, -0.4]],
        "advantages": [[inf, 1.0, -0.5], [-inf, inf, 2.0]],
        "ref_log_prob": [[nan, -1.1, -1.9], [nan, nan, -0.6]],
        "values": [[nan, 0.3, -0.2], [inf, nan, 0.5]],
        "returns": [[inf, 1.0, 0.0], [nan, nan, 1.0]],
    }
    policy = policy_loss_fn(PolicyLossConfig(loss_agg_mode=mode, kl_loss_coef=0.1, entropy_coeff=0.01))
    critic = value_loss_fn(ValueLossConfig(loss_agg_mode=mode))

    def losses_and_grads(fields: dict[str, list[list[float]]]) -> list[torch.Tensor]:
        log_probs = jagged([[0.0, -1.0, -2.0], [0.0, -0.3, -0.5]], requires_grad=True)
        values = jagged([[0.0, 0.4, -0.1], [0.0, 0.2, 0.7]], requires_grad=True)
        entropy = jagged([[0.0, 1.0, 0.5], [0.0, 0.2, 0.9]])
        batch = TensorDict(
            {"loss_mask": jagged(mask), **{k: jagged(v) for k, v in fields.items()}}, batch_size=[2]
        )
        output = TensorDict({"log_probs": log_probs, "entropy": entropy, "values": values}, batch_size=[2])
        pg, _ = policy(output, batch, context_for(mask))
        vf, _ = critic(output, batch, context_for(mask))
        (pg + vf).backward()
        return [pg.detach(), vf.detach(), log_probs.grad.values(), values.grad.values()]

    expected, actual = losses_and_grads(clean), losses_and_grads(poisoned)
    for want, got in zip(expected, actual, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_an_unlikely_prompt_token_gives_no_nan_gradient_through_the_kl(estimator: str) -> None:
    """A prompt token (mask 0) with log-prob -95: ``exp(0 - (-95))`` overflowed in k3; the loss was finite but
    its gradient ``0 * inf`` was NaN, and the whole optimizer step was skipped."""
    mask = [[0.0, 0.0, 1.0, 1.0]]
    log_probs = jagged([[0.0, -95.0, -1.0, -0.5]], requires_grad=True)
    batch = TensorDict(
        {
            "loss_mask": jagged(mask),
            "old_log_probs": jagged([[0.0, -95.0, -1.0, -0.5]]),
            "advantages": jagged([[0.0, 0.0, 1.0, -1.0]]),
            "ref_log_prob": jagged([[0.0, 0.0, -1.2, -0.4]]),
        },
        batch_size=[1],
    )
    output = TensorDict({"log_probs": log_probs, "entropy": jagged([[0.0, 0.0, 0.3, 0.2]])}, batch_size=[1])
    config = PolicyLossConfig(kl_loss_coef=1.0, kl_estimator=estimator, entropy_coeff=0.0)
    loss, _ = policy_loss_fn(config)(output, batch, context_for(mask))
    loss.backward()
    grad = log_probs.grad.values()
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[:2].tolist() == [0.0, 0.0]  # prompt positions take no gradient
    # Loss tokens: -A (ratio 1) + d/dlogp of the KL estimate at delta = ref - logp, over 2 loss tokens.
    delta = torch.tensor([-1.2 - -1.0, -0.4 - -0.5])
    kl_grad = {"k1": torch.ones(2), "k2": -delta, "k3": 1.0 - torch.exp(delta)}[estimator]
    torch.testing.assert_close(grad[2:], (torch.tensor([-1.0, 1.0]) + kl_grad) / 2)


def test_policy_and_value_losses_read_nothing_back_from_the_device(monkeypatch) -> None:
    """Their metrics stay detached tensors on the device, which the engine reads once per step with the loss
    (one transfer); ``float(...)`` per metric stalled the host once per metric and micro-batch on a GPU, before
    it could queue the backward. A read is made to fail here."""

    def no_read(*args, **kwargs):
        raise AssertionError("a loss function read a tensor back to the host")

    mask = [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    batch = TensorDict(
        {
            "loss_mask": jagged(mask),
            "old_log_probs": jagged([[0.0, -0.9, -2.2], [0.0, 0.0, -0.4]]),
            "advantages": jagged([[0.0, 1.0, -0.5], [0.0, 0.0, 2.0]]),
            "ref_log_prob": jagged([[0.0, -1.1, -1.9], [0.0, 0.0, -0.6]]),
            "values": jagged([[0.0, 0.3, -0.2], [0.0, 0.0, 0.5]]),
            "returns": jagged([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),
        },
        batch_size=[2],
    )
    output = TensorDict(
        {
            "log_probs": jagged([[0.0, -1.0, -2.0], [0.0, -0.3, -0.5]]),
            "entropy": jagged([[0.0, 1.0, 0.5], [0.0, 0.2, 0.9]]),
            "values": jagged([[0.0, 0.4, -0.1], [0.0, 0.2, 0.7]]),
        },
        batch_size=[2],
    )
    policy = policy_loss_fn(PolicyLossConfig(kl_loss_coef=0.1))
    critic = value_loss_fn(ValueLossConfig())
    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, no_read)
    results = [policy(output, batch, context_for(mask)), critic(output, batch, context_for(mask))]
    monkeypatch.undo()
    for _, metrics in results:
        assert metrics and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_the_policy_loss_reads_the_entropy_only_with_an_entropy_bonus(entropy_coeff: float) -> None:
    """With ``entropy_coeff=0`` the loss needs no entropy, so the actor's update can ask the engine for
    log-probs alone (a fused log-prob kernel computes them without the logits); ``0 * entropy`` in the loss
    also made the backward compute the entropy's gradient through the output projection for nothing. With a
    bonus the entropy enters the loss and its backward, and is a metric."""
    mask = [[0.0, 1.0, 1.0]]
    entropy = jagged([[0.0, 1.0, 0.5]], requires_grad=True)
    batch = TensorDict(
        {
            "loss_mask": jagged(mask),
            "old_log_probs": jagged([[0.0, -1.0, -2.0]]),
            "advantages": jagged([[0.0, 1.0, -0.5]]),
        },
        batch_size=[1],
    )
    fields = {"log_probs": jagged([[0.0, -1.0, -2.0]], requires_grad=True)}
    if entropy_coeff:
        fields["entropy"] = entropy
    config = PolicyLossConfig(kl_loss_coef=0.0, entropy_coeff=entropy_coeff)
    loss, metrics = policy_loss_fn(config)(TensorDict(fields, batch_size=[1]), batch, context_for(mask))
    loss.backward()
    if entropy_coeff:
        assert float(metrics["entropy"]) == pytest.approx(0.75)
        assert entropy.grad is not None
    else:
        assert "entropy" not in metrics
    assert float(loss.detach()) == pytest.approx(float(metrics["pg_loss"]) - entropy_coeff * 0.75)


@requires_cuda
def test_per_sequence_sums_do_not_wait_for_the_device():
    """``repeat_interleave`` without its output size reads the lengths back from the GPU: every seq-mean, DPO and
    reward-model loss waited for the device after each micro-batch."""
    from drivetrain_roles.losses.aggregation import FlatTokens

    offsets = torch.tensor([0, 3, 7], device="cuda")
    mask = torch.nested.nested_tensor_from_jagged(torch.ones(7, dtype=torch.bool, device="cuda"), offsets)
    values = torch.arange(7.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums = FlatTokens.from_jagged(mask).per_sequence_sum(values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums.tolist() == [3.0, 18.0]
