"""Multi-turn GRPO on vLLM: ``grpo rollout.name=vllm`` in the ``calculator`` environment, with the embedded
calculator task's model, tokenizer and chat template and the data ``model.path=builtin:calculator`` writes.

The model leans towards ``<tool_call>``, ``</tool_call>`` and ``<|im_end|>`` whatever the context, so its turns
end and most hold a call the environment cannot read: the calculator answers each with an ``Error: ...`` tool
message, and episodes run for several turns (the task's warm start would need hundreds of SFT steps to call the
tool at all). The first prompts are about 110 tokens, a group of four episodes shares them, and every turn after
the first is a prompt that grows from the previous one (vLLM's prefix cache serves it). Two steps, the second
sampled from weights the first step changed (a reward by length, graded within every group).
"""

from __future__ import annotations

import json
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

LEANS = {"<tool_call>": 1.0, "<|im_end|>": 0.75}
"""The tokens the model leans towards (:func:`~drivetrain_engine_core.testing.lean_model_dir`): the likely ones."""


@pytest.fixture(scope="module")
def calling_model_dir(tmp_path_factory):
    """The calculator task's untrained model (:data:`LEANS`) and tokenizer."""
    from drivetrain_engine_core.testing import lean_model_dir
    from drivetrain_roles.jobs.calculator_task import build_calculator_tokenizer, write_calculator_model

    path = write_calculator_model(tmp_path_factory.mktemp("calling"), seed=0)
    return lean_model_dir(path, build_calculator_tokenizer(), LEANS)


@pytest.fixture(scope="module")
def episodes_run(tmp_path_factory, calling_model_dir):
    """Two GRPO steps on vLLM in the calculator environment: each step's batch (as the update got it) and the
    training records."""
    from drivetrain_roles.grpo import trainer as grpo_trainer
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.jobs.calculator_task import write_calculator_data

    folder = tmp_path_factory.mktemp("episodes")
    train, _ = write_calculator_data(folder / "data", train_size=2, val_size=2, seed=0)
    (folder / "reward.py").write_text(
        "def by_length(*, completions, references):\n    return [len(c) / 10 for c in completions]\n"
    )
    overrides = [
        f"model.path={calling_model_dir}",
        f"data.train_files=[{train}]",
        "data.messages_key=messages",
        "data.max_length=256",
        "rollout.name=vllm",
        "rollout.n=4",
        "rollout.max_new_tokens=24",
        "environment.name=calculator",
        "environment.max_turns=3",
        "environment.max_total_tokens=400",
        f"algorithm.reward_function={folder / 'reward.py'}:by_length",
        "algorithm.kl_loss_coef=0",
        "algorithm.ppo_mini_batches=1",
        "optimizer.lr=5e-3",
        "trainer.prompts_per_step=2",
        "trainer.total_steps=2",
        "trainer.eval_samples=0",
        "trainer.progress_bar=false",
    ]
    seen, update = [], grpo_trainer.update

    def spy(actor, reference, samples):
        batch = samples.batch.clone()
        metrics = update(actor, reference, samples)
        seen.append((batch, metrics))
        return metrics

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_trainer, "update", spy)
        grpo_trainer.GRPOTrainer(load_config(None, overrides), folder / "run").run()
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(seen=seen, records=[r for r in records if "train/reward" in r])


def model_turns(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of model tokens (loss mask 1) in one sequence."""
    edges = torch.diff(torch.cat([torch.zeros(1), mask.float(), torch.zeros(1)])).nonzero().squeeze(-1)
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_vllms_log_probs_of_every_turn_are_a_plain_forwards_and_the_actors(
    episodes_run, calling_model_dir, max_gap
):
    """Step 1 samples from the saved model: each model token's vLLM log-prob is a plain HF forward's of the
    whole episode (the tool messages before it included); each step's actor recomputes them (step 2 after a
    hand-off that changed the weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(calling_model_dir, dtype=torch.float32).eval()
    (first, _), (second, _) = episodes_run.seen
    gap, later_turns = (
        max_gap(model, first),
        sum(len(model_turns(m)) - 1 for m in first["loss_mask"].unbind()),
    )
    moved = max_gap(model, second)
    actor = [record["rollout/log_prob_diff_max"] for record in episodes_run.records]
    print(f"gap {gap:.3g}, actor {actor}, step 2 from the saved model {moved:.3g}; {later_turns} later turns")
    assert gap < 1e-5 and later_turns >= 8
    assert moved > 1e-3  # step 2's log-probs are the changed weights'
    assert len(episodes_run.records) == 2
    assert max(actor) < 1e-5
    assert episodes_run.records[1]["rollout/sync_fraction_changed"] > 0


def test_tool_messages_are_context_between_the_model_turns(episodes_run):
    """Between two model turns the batch holds the calculator's answer, rendered by the chat template, with loss
    mask 0 and no rollout log-prob; the metrics count the turns and the failed calls."""
    from drivetrain_roles.jobs.calculator_task import build_calculator_tokenizer

    tokenizer = build_calculator_tokenizer()
    for (batch, _), record in zip(episodes_run.seen, episodes_run.records, strict=True):
        observations = 0
        for ids, mask, rolled in zip(
            batch["input_ids"].unbind(),
            batch["loss_mask"].unbind(),
            batch["rollout_log_probs"].unbind(),
            strict=True,
        ):
            assert (rolled[~mask] == 0).all() and (rolled[mask] != 0).all()
            turns = model_turns(mask)
            for (_, stop), (start, _) in pairwise(turns):
                between = tokenizer.decode(ids[stop:start])
                assert between.startswith("\n<|im_start|>tool\nError: ") and between.endswith(
                    "<|im_end|>\n<|im_start|>assistant\n"
                ), between
                observations += 1
        print(record["rollout/turns"], record["rollout/tool_errors"], observations)
        assert record["rollout/turns"] > 1.5 and record["rollout/tool_errors"] > 0.5
        assert observations >= 4
