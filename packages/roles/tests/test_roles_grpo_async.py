"""``trainer.mode``: generation ahead of training, per-token versions, staleness and the rollout correction.

- The truncated importance-sampling loss against the formula written out here, on tokens of mixed versions.
- ``async`` with ``max_staleness=0`` reproduces ``sync`` exactly (the same samples, losses within 1e-6).
- ``one_step_off`` trains step k on samples of version k - 1 that were generated while step k - 1 trained.
- Groups holding a token older than allowed (a partial rollout) leave the loss and are counted.
- A rollout thread that fails is named by the step and version it was generating; the resumed run trains that
  step's batch once, generated again by the checkpoint's weights.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import LossContext
from drivetrain_engine_core.rollout import RolloutOutput, SamplingConfig
from drivetrain_roles.grpo import trainer as trainer_module
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.step import rollout_batch
from drivetrain_roles.grpo.trainer import GRPOTrainer
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.jobs.default_assets import write_model_dir
from drivetrain_roles.losses.policy import PolicyLossConfig, policy_loss_fn
from drivetrain_roles.rl.pipeline import RolloutPipeline, RolloutThreadError
from drivetrain_roles.rl.versions import Versions, staleness_metrics

CAP = 2.0
LENGTH_REWARD = """def length(*, prompts, completions, references):
    return [float(len(c)) for c in completions]
"""


def _jagged(rows):
    return torch.nested.nested_tensor_from_jagged(
        torch.cat(rows), offsets=torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0)])
    )


def test_the_truncated_is_loss_is_the_formula_on_mixed_version_tokens() -> None:
    """Two sequences whose response tokens came from three weight versions: the rollout's log-probs equal the
    old policy's on the current version's tokens (weight 1), lie below them on older ones (weight > 1, one
    over the cap) and above them on another (weight < 1)."""
    torch.manual_seed(0)
    mask = [torch.tensor([False, True, True, True]), torch.tensor([False, False, True, True, True])]
    old = [torch.tensor([0.0, -1.0, -0.5, -2.0]), torch.tensor([0.0, 0.0, -0.3, -1.2, -0.7])]
    # token versions (current 5): [-, 5, 4, 3] and [-, -, 5, 5, 2]
    rollout = [torch.tensor([0.0, -1.0, -0.9, -3.5]), torch.tensor([0.0, 0.0, -0.3, -1.2, -0.2])]
    advantages = [torch.full((4,), 1.5), torch.full((5,), -0.8)]
    log_probs = [o + 0.1 * torch.randn_like(o) for o in old]
    leaf = torch.cat(log_probs).requires_grad_()
    micro_batch = {
        "loss_mask": _jagged(mask),
        "old_log_probs": _jagged(old),
        "rollout_log_probs": _jagged(rollout),
        "advantages": _jagged(advantages),
    }
    config = PolicyLossConfig(rollout_is_cap=CAP, clip_ratio_c=None)
    context = LossContext(global_token_count=6, global_sequence_count=2)
    loss, metrics = policy_loss_fn(config)({"log_probs": _jagged([leaf[:4], leaf[4:]])}, micro_batch, context)
    loss.backward()

    # Written out: w = min(exp(old - rollout), cap); token-mean of w * max(-A r, -A clip(r, 0.8, 1.2)).
    expected_terms, weights = [], []
    reference = torch.cat(log_probs).detach().requires_grad_()
    flat = {k: torch.cat(v) for k, v in {"old": old, "rollout": rollout, "adv": advantages}.items()}
    trained = torch.cat(mask)
    for i in torch.nonzero(trained).flatten().tolist():
        w = min(float(torch.exp(flat["old"][i] - flat["rollout"][i])), CAP)
        ratio = torch.exp(reference[i] - flat["old"][i])
        a = flat["adv"][i]
        expected_terms.append(w * torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)))
        weights.append(w)
    expected = torch.stack(expected_terms).sum() / 6
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-7)
    torch.testing.assert_close(leaf.grad, reference.grad, atol=1e-7, rtol=1e-6)
    assert weights == pytest.approx([1.0, float(torch.exp(torch.tensor(0.4))), CAP, 1.0, 1.0, 0.60653066])
    assert float(metrics["rollout_is_weight"]) == pytest.approx(sum(weights) / 6, rel=1e-6)
    assert float(metrics["rollout_is_capped"]) == pytest.approx(1 / 6)


def test_modes_and_the_correction_are_configured_with_clear_refusals() -> None:
    assert load_config().algorithm.rollout_is_cap is None  # sync: unchanged
    assert load_config(None, ["trainer.mode=one_step_off"]).algorithm.rollout_is_cap == 2.0
    explicit = ["trainer.mode=async", "algorithm.rollout_is_cap=null"]
    assert load_config(None, explicit).algorithm.rollout_is_cap is None
    for override, message in (
        ("trainer.mode=asynch", r"trainer.mode='asynch' is not known; did you mean 'async'\?"),
        ("trainer.mode=off", r"'False' is not known.*YAML read a boolean"),
        ("trainer.max_staleness=-1", r"trainer.max_staleness must be >= 0"),
        ("algorithm.rollout_is_cap=0.5", r"rollout_is_cap=0.5: the importance weight's cap must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])


def test_groups_with_tokens_older_than_allowed_leave_the_loss_and_are_counted() -> None:
    """A partial rollout: the responses of the second prompt began under version 1 and ended under 3."""
    examples = [
        Example(prompt_ids=[1, 2], response_ids=[], prompt_text="a", response_text="x"),
        Example(prompt_ids=[3], response_ids=[], prompt_text="b", response_text="y"),
    ]
    responses = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    output = RolloutOutput(
        responses=responses, log_probs=[-torch.ones(len(r)) for r in responses], version=3, n=2
    )
    generated = [torch.tensor([3, 3]), torch.tensor([2]), torch.tensor([1, 2, 3]), torch.tensor([3, 3])]
    versions = Versions(generated=generated, current=3, max_staleness=1)
    config = load_config(None, ["rollout.n=2"])
    samples = rollout_batch(examples, output, torch.tensor([1.0, 0.0, 1.0, 0.0]), config, versions=versions)
    masks = [m.tolist() for m in samples.batch["loss_mask"].unbind()]
    assert masks[:2] == [[False, False, True, True], [False, False, True]]
    assert not any(masks[2]) and not any(masks[3])  # the whole stale group
    assert samples.dropped_groups == 1
    assert [v.tolist() for v in samples.batch["token_versions"].unbind()] == [
        [3, 3, 3, 3],
        [2, 2, 2],
        [1, 1, 2, 3],
        [3, 3, 3],
    ]
    rollout_log_probs = [r.tolist() for r in samples.batch["rollout_log_probs"].unbind()]
    assert rollout_log_probs[1] == [0.0, 0.0, -1.0]
    # The stale group's responses are out of the loss, not out of the batch: their log-probs are placed too.
    assert rollout_log_probs[2:] == [[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, -1.0]]
    metrics = staleness_metrics(versions, dropped_sequences=samples.dropped_groups * 2)
    assert metrics == {
        "async/staleness_0": 2.0,
        "async/staleness_1": 1.0,
        "async/staleness_over": 1.0,
        "async/staleness_mean": 0.75,
        "async/staleness_max": 2.0,
        "async/dropped_samples": 2.0,
    }


class _CountingRollout:
    """Records the weight version each batch was generated with; fails on ``fail_step`` if given."""

    def __init__(self, fail_step: int | None = None) -> None:
        self.version, self.fail_step = 0, fail_step
        self.in_flight = threading.Event()

    def generate(self, prompts, sampling):
        step = prompts[0][0]
        if step == self.fail_step:
            raise RuntimeError("the rollout process died")
        self.in_flight.set()
        time.sleep(0.05)
        self.in_flight.clear()
        return RolloutOutput(responses=[torch.tensor([1])], log_probs=[torch.zeros(1)], version=None, n=1)


def _request(step):
    return [[step]], SamplingConfig(n=1, temperature=1.0, max_new_tokens=1)


def test_the_pipeline_generates_lag_versions_ahead_and_hands_off_between_batches() -> None:
    rollout = _CountingRollout()
    pipeline = RolloutPipeline(rollout, _request, version=0, first=0, last=4, lag=1)  # type: ignore[arg-type]
    try:
        versions, overlapped = [], 0.0
        for step in range(4):
            batch = pipeline.take(step)
            taken = time.perf_counter()
            versions.append(batch.version)
            time.sleep(0.3)  # "training": the next batch (0.05 s) is generated meanwhile

            def hand_off() -> bool:
                return rollout.in_flight.is_set()  # a hand-off never meets a batch in flight

            assert pipeline.update(hand_off, step + 1) is False
            overlapped += pipeline.overlap(taken, time.perf_counter())
        assert versions == [0, 0, 1, 2]  # batch k (k >= 1) by version k - 1
        assert 0.1 < overlapped < 0.3  # batches 1-3 generated during "training" (partly before take() for 1)
    finally:
        pipeline.close()


def test_a_failing_rollout_thread_is_named_with_its_step_and_version() -> None:
    pipeline = RolloutPipeline(
        _CountingRollout(fail_step=1),  # type: ignore[arg-type]
        _request,
        version=0,
        first=0,
        last=3,
        lag=1,
    )
    pipeline.take(0)
    started = time.perf_counter()
    with pytest.raises(
        RolloutThreadError,
        match=r"failed generating the batch of step 1 with weight version 0: RuntimeError: the rollout process died",
    ):
        pipeline.take(1)
    assert time.perf_counter() - started < 5
    pipeline.close()


def _run(tmp_path, name, *overrides, resume=False, total_steps=2):
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        write_model_dir(model_dir, seed=3)
        (tmp_path / "rewards.py").write_text(LENGTH_REWARD)
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "engine.micro_batch.micro_batch_size=4",
            "engine.micro_batch.max_tokens=null",
            "rollout.n=4",
            "rollout.max_new_tokens=4",
            f"algorithm.reward_function={tmp_path / 'rewards.py'}:length",
            "algorithm.kl_loss_coef=0.1",
            f"trainer.total_steps={total_steps}",
            "trainer.prompts_per_step=2",
            "trainer.eval_every=0",
            "trainer.eval_samples=4",
            "trainer.save_every=1",
            "trainer.progress_bar=false",
            *overrides,
        ],
    )
    GRPOTrainer(config, tmp_path / name, resume=resume).run()
    return _records(tmp_path / name)


@pytest.fixture
def trained(monkeypatch):
    """Each trained step's sequences and token versions, as the update received them."""
    seen: list[tuple[list[list[int]], list[list[int]]]] = []
    update = trainer_module.update

    def recording(actor, reference, samples):
        batch = samples.batch
        seen.append(
            (
                [s.tolist() for s in batch["input_ids"].unbind()],
                [v.tolist() for v in batch["token_versions"].unbind()],
            )
        )
        return update(actor, reference, samples)

    monkeypatch.setattr(trainer_module, "update", recording)
    return seen


def test_async_without_staleness_reproduces_sync_and_one_step_off_trains_older_samples(tmp_path, trained):
    cap = f"algorithm.rollout_is_cap={CAP}"
    sync = _run(tmp_path, "sync", cap)
    sync_samples = list(trained)
    trained.clear()
    exact = _run(tmp_path, "async0", "trainer.mode=async", "trainer.max_staleness=0")
    assert [s for s, _ in trained] == [s for s, _ in sync_samples]
    for a, b in zip(sync, exact, strict=True):
        for key in ("train/pg_loss", "train/kl", "train/grad_norm", "train/rollout_is_weight"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert all(r["async/staleness_0"] == 8 and r["async/dropped_samples"] == 0 for r in exact)
    assert len({round(r["train/pg_loss"], 6) for r in sync}) > 1  # the rewards differ: real updates

    trained.clear()
    off = _run(tmp_path, "off", "trainer.mode=one_step_off", "trainer.eval_samples=0", total_steps=2)
    # Step k's tokens (prompt and response) all carry the version that generated them, k - 1 from step 1 on;
    # the samples of step 0 are sync's (version 0), those of step 1 are sync's prompts at version 0.
    versions = [{v for row in rows for v in row} for _, rows in trained]
    assert versions == [{0}, {0}]
    assert trained[0][0] == sync_samples[0][0]
    assert off[1]["async/staleness_1"] == 8 and off[1]["train/rollout_is_weight"] != 1.0
    assert {"perf/overlapped_s", "perf/generating_s", "perf/training_s", "perf/wait_s"} <= set(off[0])


def _records(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/pg_loss" in r]


def test_a_rollout_failing_mid_run_is_named_and_the_run_resumes_from_its_checkpoint(
    tmp_path, trained, monkeypatch
):
    """The rollout thread dies generating step 1's batch while step 0 trains: the run stops with one error
    naming the step and version, after step 0's checkpoint; the resumed run generates step 1's batch again
    (from the checkpoint's weights) and trains it once."""
    from drivetrain_roles.rl.sampling import SEED_STRIDE
    from drivetrain_roles.rollout.hf import HFRollout

    generate = HFRollout._generate

    def dying(self, prompts, sampling):
        if sampling.seed == SEED_STRIDE:  # trainer.seed 0, step 1, rank 0
            raise RuntimeError("rollout worker killed")
        return generate(self, prompts, sampling)

    monkeypatch.setattr(HFRollout, "_generate", dying)
    with pytest.raises(
        RolloutThreadError, match=r"step 1 with weight version 0: RuntimeError: rollout worker killed"
    ):
        _run(tmp_path, "crash", "trainer.mode=one_step_off")
    assert [r["step"] for r in _records(tmp_path / "crash")] == [1]
    monkeypatch.setattr(HFRollout, "_generate", generate)
    trained.clear()
    _run(tmp_path, "crash", "trainer.mode=one_step_off", resume=True)
    assert [{v for row in rows for v in row} for _, rows in trained] == [{1}]
    assert [r["step"] for r in _records(tmp_path / "crash")] == [1, 2]
