"""``drivetrain dpo`` and ``drivetrain rm``: tiny end-to-end runs (run folder, TRL-named metrics, exported models
that give the run's scores), reference modes that agree, pair data errors, configs, generated reference pages."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_roles.dpo.config import load_config as load_dpo_config
from drivetrain_roles.dpo.trainer import DPOTrainer
from drivetrain_roles.jobs.config_reference import reference_page
from drivetrain_roles.jobs.data import DataError
from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer
from drivetrain_roles.preference.config import PairDataConfig
from drivetrain_roles.preference.data import load_pairs
from drivetrain_roles.rm.config import load_config as load_rm_config
from drivetrain_roles.rm.trainer import RMTrainer
from drivetrain_roles.runtime.tracking import read_records
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "data.generated_train_size=64",
    "data.generated_val_size=16",
    "trainer.batch_size=8",
    "trainer.eval_every=0",
    "trainer.eval_samples=8",
    "trainer.progress_bar=false",
]


@pytest.mark.parametrize("command", ["dpo", "rm", "grpo", "ppo"])
def test_reference_pages_are_generated_from_the_dataclasses(command) -> None:
    assert (REPO / "docs" / f"{command}-config.md").read_text() == reference_page(command), (
        f'docs/{command}-config.md is stale; regenerate it with python -c "from drivetrain_roles.jobs.config_reference '
        f"import reference_page; open('docs/{command}-config.md', 'w').write(reference_page('{command}'))\""
    )


def test_example_files_hold_the_defaults() -> None:
    package = REPO / "packages" / "roles" / "src" / "drivetrain_roles"
    assert load_dpo_config(package / "dpo" / "example.yaml") == load_dpo_config()
    assert load_rm_config(package / "rm" / "example.yaml") == load_rm_config()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "dpo.loss_type=hinge",
            r"dpo.loss_type='hinge' is not supported; choose one of \['sigmoid', 'ipo'\]",
        ),
        ("dpo.reference=other", r"dpo.reference='other' is not supported"),
        ("dpo.beta=0", r"dpo.beta must be > 0"),
        # Failed with a traceback after the whole SFT warm start, when the reference was built.
        ("dpo.reference=lora_base", r"dpo.reference=lora_base .* model.lora is unset"),
    ],
)
def test_bad_dpo_settings_name_the_field(override, message) -> None:
    from drivetrain_engine_core.backend import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_dpo_config(overrides=[override])


@pytest.mark.parametrize(("load", "embedded_steps"), [(load_dpo_config, 800), (load_rm_config, 800)])
def test_only_the_embedded_model_gets_an_sft_warm_start_unless_asked(load, embedded_steps) -> None:
    """A user's model (an instruct model, from TRL) went through the embedded job's SFT warm start, a full
    fine-tune at lr 5e-3, before DPO or reward modelling; GRPO already warmed up the embedded model only."""
    assert load(None, []).warm_start.sft_steps == embedded_steps
    assert load(None, ["model.path=/models/instruct"]).warm_start.sft_steps == 0
    assert load(None, ["model.path=/models/instruct", "warm_start.sft_steps=7"]).warm_start.sft_steps == 7


@pytest.mark.parametrize(
    ("command", "overrides", "schedule"),
    [
        ("sft", [], (800, min(10, 800 // 10))),
        ("sft", ["trainer.total_steps=50"], (50, min(10, 50 // 10))),
        ("dpo", ["trainer.total_steps=40"], (40, 0)),
        ("rm", [], (1500, min(200, 1500 // 5))),
        ("rm", ["trainer.total_steps=300"], (300, min(200, 300 // 5))),
        ("rm", ["trainer.total_steps=300", "optimizer.warmup_steps=7"], (300, 7)),
    ],
)
def test_the_schedule_follows_the_run_from_one_source(command, overrides, schedule) -> None:
    """The engine's schedule spans ``trainer.total_steps`` with the command's warm-up (the values the copied
    ``derived_values`` gave), and the config holds no copy of the run's length."""
    from importlib import import_module

    config = import_module(f"drivetrain_roles.{command}.config").load_config(None, overrides)
    optimizer = config.run_optimizer()
    assert (optimizer.total_steps, optimizer.warmup_steps) == schedule
    assert type(optimizer).__name__ == "OptimizerConfig" and config.optimizer.total_steps is None


@pytest.mark.parametrize(
    ("command", "embedded", "user"),
    [("sft", 3e-3, 1e-5), ("dpo", 1e-4, 1e-6), ("rm", 2e-3, 1e-5), ("grpo", 2e-4, 1e-6), ("ppo", 1e-4, 1e-6)],
)
def test_a_users_model_gets_the_learning_rate_its_users_know(command, embedded, user) -> None:
    """The embedded job's learning rates applied to a user's model too: ``drivetrain sft model.path=<a real
    model>`` ran a full fine-tune at 3e-3 (DPO at 1e-4 with beta 0.5), which ruins a real model. Another model
    gets verl's and TRL's defaults unless the rate is set."""
    from importlib import import_module

    load = import_module(f"drivetrain_roles.{command}.config").load_config
    assert load(None, []).optimizer.lr == embedded
    assert load(None, ["model.path=/models/instruct"]).optimizer.lr == user
    assert load(None, ["model.path=/models/instruct", "optimizer.lr=3e-6"]).optimizer.lr == 3e-6
    if command == "ppo":  # the critic's too (verl's critic.optim.lr)
        assert load(None, ["model.path=/models/instruct"]).critic.optimizer.lr == 1e-5
    if command == "dpo":
        assert load(None, []).dpo.beta == 0.5 and load(None, ["model.path=/models/instruct"]).dpo.beta == 0.1


@pytest.mark.parametrize("command", ["sft", "dpo", "rm", "grpo", "ppo"])
def test_a_users_model_gets_lengths_that_hold_real_text(command) -> None:
    """The embedded job's 32-token ``data.max_length`` refused nearly any real data, and GRPO's 6-token responses
    could never hold a real answer (reward 0 everywhere, no warning). A user's model gets TRL's lengths unless set."""
    from importlib import import_module

    load = import_module(f"drivetrain_roles.{command}.config").load_config
    embedded, user = load(None, []), load(None, ["model.path=/models/instruct"])
    budget = (
        (lambda c: c.rollout.max_new_tokens)
        if command in ("grpo", "ppo")
        else (lambda c: c.trainer.max_new_tokens)
    )
    assert (embedded.data.max_length, user.data.max_length, budget(user)) == (32, 1024, 256)
    assert budget(embedded) < 10
    assert load(None, ["model.path=/models/instruct", "data.max_length=77"]).data.max_length == 77


def test_answers_longer_than_a_response_may_be_are_warned_about(caplog) -> None:
    from drivetrain_roles.jobs.data import Example
    from drivetrain_roles.rl.prompt_checks import warn_unreachable_answers

    def example(answer_tokens: int) -> Example:
        return Example(
            prompt_ids=[1, 5], response_ids=[7] * answer_tokens + [2], prompt_text="", response_text=""
        )

    with caplog.at_level("WARNING"):
        warn_unreachable_answers([example(6), example(3)], max_new_tokens=6, eos_token_id=2)
        assert not caplog.text  # an answer of exactly max_new_tokens fits (the eos is not needed)
        warn_unreachable_answers([example(9), example(7), example(3)], max_new_tokens=6, eos_token_id=2)
    assert (
        "2 of 3 training answers are longer than rollout.max_new_tokens=6 tokens (the longest has 9)"
        in caplog.text
    )


@pytest.mark.parametrize(
    ("command", "disabled"), [("sft", False), ("dpo", True), ("rm", True), ("grpo", False)]
)
def test_pairwise_commands_build_their_models_without_dropout(command, disabled) -> None:
    """TRL's DPO and reward trainers turn dropout off by default (``disable_dropout=True``), its SFT and GRPO
    trainers do not; a user's model keeps the command's choice, and the option overrides it."""
    from importlib import import_module

    load = import_module(f"drivetrain_roles.{command}.config").load_config
    assert load(None, ["model.path=/models/instruct"]).model.disable_dropout is disabled
    assert load(None, [f"model.disable_dropout={not disabled}"]).model.disable_dropout is not disabled


def test_pair_files_in_text_and_chat_form_and_their_errors(tmp_path) -> None:
    tokenizer = build_arithmetic_tokenizer()
    text = tmp_path / "pairs.jsonl"
    text.write_text(json.dumps({"prompt": "1+2=", "chosen": "3", "rejected": "4"}) + "\n")
    (pair,) = load_pairs([text], tokenizer, PairDataConfig())
    assert pair.chosen.prompt_ids == pair.rejected.prompt_ids and pair.chosen.response_text == "3"
    with pytest.raises(DataError, match=r"row 0 has no column 'worse'.*Set data.rejected_key=<column>"):
        load_pairs([text], tokenizer, PairDataConfig(rejected_key="worse"))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "1+2=", "chosen": "3"}) + "\n")
    with pytest.raises(DataError, match=r"row 0 has no column 'rejected'.*Set data.rejected_key=<column>"):
        load_pairs([missing], tokenizer, PairDataConfig())
    chat = tmp_path / "chat.jsonl"
    user = {"role": "user", "content": "1+2="}
    chat.write_text(
        json.dumps(
            {
                "chosen": [user, {"role": "assistant", "content": "3"}],
                "rejected": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "4"}],
            }
        )
        + "\n"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(
        DataError, match=r"differ before their last assistant turn; a pair must share its prompt"
    ):
        load_pairs([chat], tokenizer, PairDataConfig(chat=True))


def test_a_pair_with_an_overlong_side_is_dropped_whole_under_data_overlong_drop(tmp_path, caplog) -> None:
    """A pair is kept only when both sides fit: training on its chosen side alone is not a preference."""
    tokenizer = build_arithmetic_tokenizer()
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
        {"prompt": "1+2=", "chosen": "3", "rejected": "33333"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    longest = (
        len(tokenizer("1+2=")["input_ids"]) + len(tokenizer.encode("33333", add_special_tokens=False)) + 1
    )
    config = PairDataConfig(max_length=longest - 1, overlong="drop")
    assert [
        p.chosen.prompt_text + p.rejected.response_text for p in load_pairs([path], tokenizer, config)
    ] == [
        "1+2=4",
        "2+2=5",
    ]
    assert f"1 of 3 pairs of ['{path}'] are longer than data.max_length={longest - 1} tokens" in caplog.text
    with pytest.raises(DataError, match=rf"row 1 has {longest} tokens .*set data.overlong=drop"):
        load_pairs([path], tokenizer, PairDataConfig(max_length=longest - 1))


def test_trls_explicit_prompt_chat_pairs_take_their_prompt_turns_from_the_prompt_column(tmp_path) -> None:
    """TRL's conversational format with an explicit prompt (``prompt`` a list of messages, chosen/rejected the
    assistant turns alone) passed the checks, then failed in transformers on an empty conversation, naming no
    row. The prompt turns now lead each side, exactly as the same pair with whole conversations (implicit)."""
    from drivetrain_engine_core.testing import build_tiny_tokenizer
    from drivetrain_roles.preference.data import check_pair_rows, write_sft_rows

    tokenizer = build_tiny_tokenizer()
    user = {"role": "user", "content": "hello"}
    good, bad = {"role": "assistant", "content": "world"}, {"role": "assistant", "content": "the"}
    explicit, implicit, text_prompt = (tmp_path / f"{n}.jsonl" for n in ("explicit", "implicit", "text"))
    explicit.write_text(json.dumps({"prompt": [user], "chosen": [good], "rejected": [bad]}) + "\n")
    implicit.write_text(json.dumps({"chosen": [user, good], "rejected": [user, bad]}) + "\n")
    text_prompt.write_text(json.dumps({"prompt": "hello", "chosen": [good], "rejected": [bad]}) + "\n")
    config = PairDataConfig(chat=True, max_length=256)
    expected = load_pairs([implicit], tokenizer, config)
    assert (
        load_pairs([explicit], tokenizer, config) == load_pairs([text_prompt], tokenizer, config) == expected
    )
    assert check_pair_rows([explicit], config) == 1
    sft_rows = write_sft_rows(explicit, tmp_path / "sft.jsonl", config).read_text()
    assert json.loads(sft_rows) == {"messages": [user, good]}
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"chosen": [good], "rejected": [bad]}) + "\n")
    with pytest.raises(
        DataError, match=r"row 0 column 'chosen' holds only assistant turns .* no prompt column"
    ):
        check_pair_rows([bare], config)


def test_a_margin_column_is_trained_as_trls_reward_trainer(tmp_path) -> None:
    """TRL's RewardTrainer trains ``-log sigmoid(r_chosen - r_rejected - margin)`` when the data has a margin;
    the column was dropped without a word. ``data.margin_key`` names it (reward models only)."""
    import torch.nn.functional as F
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_engine_core.job import LossContext, jagged
    from drivetrain_engine_core.testing import build_tiny_tokenizer
    from drivetrain_roles.losses.preference import RewardLossConfig, bradley_terry_loss_fn
    from drivetrain_roles.preference.batches import make_pair_batch
    from tensordict import TensorDict

    tokenizer = build_tiny_tokenizer()
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "hello ", "chosen": "world", "rejected": "the", "score_gap": 0.5},
        {"prompt": "the answer ", "chosen": "is 42", "rejected": "is", "score_gap": 2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_pairs([path], tokenizer, PairDataConfig(margin_key="score_gap", max_length=256))
    assert [p.margin for p in pairs] == [0.5, 2.0]
    batch = make_pair_batch(
        pairs, [0, 1], readout_token=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    offsets = batch["input_ids"].offsets()
    values = torch.randn(int(offsets[-1]), generator=torch.Generator().manual_seed(0))
    output = TensorDict({"values": jagged(values, offsets)}, batch_size=[4])
    loss, _ = bradley_terry_loss_fn()(
        output, batch, LossContext(global_token_count=4, global_sequence_count=4)
    )
    scores = values[
        offsets[1:] - 1
    ]  # the readout token ends each sequence: chosen, rejected, chosen, rejected
    expected = -F.logsigmoid(scores[0::2] - scores[1::2] - torch.tensor([0.5, 2.0])).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    centred, _ = bradley_terry_loss_fn(RewardLossConfig(center_rewards_coefficient=0.01))(
        output, batch, LossContext(global_token_count=4, global_sequence_count=4)
    )
    # TRL's RewardTrainer: loss + coefficient * mean((r_chosen + r_rejected)^2)
    centring = 0.01 * ((scores[0::2] + scores[1::2]) ** 2).mean()
    assert float(centred) == pytest.approx(float(expected + centring), rel=1e-6)
    with pytest.raises(ConfigError, match=r"rm\.center_rewards_coefficient must be >= 0, got -0\.1"):
        load_rm_config(overrides=["rm.center_rewards_coefficient=-0.1"])
    path.write_text(json.dumps({**rows[0], "score_gap": "big"}) + "\n")
    with pytest.raises(DataError, match=r"row 0 column 'score_gap' holds 'big', not a finite number"):
        load_pairs([path], tokenizer, PairDataConfig(margin_key="score_gap", max_length=256))
    with pytest.raises(ConfigError, match=r"data\.margin_key='score_gap' is a reward-model option"):
        load_dpo_config(overrides=["data.margin_key=score_gap"])


def test_generated_pairs_give_training_questions_several_near_misses_and_hold_out_other_questions(
    tmp_path,
) -> None:
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_roles.preference.data import write_sft_rows
    from drivetrain_roles.preference.default_pairs import write_arithmetic_pairs

    train_path, val_path = write_arithmetic_pairs(
        tmp_path, train_size=50, val_size=30, seed=3, rejected_per_prompt=4
    )
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    val = [json.loads(line) for line in val_path.read_text().splitlines()]
    by_prompt: dict[str, list[dict[str, str]]] = {}
    for pair in train:
        by_prompt.setdefault(pair["prompt"], []).append(pair)
    assert len(by_prompt) == 50 and len(val) == len({p["prompt"] for p in val}) == 30
    assert not set(by_prompt) & {p["prompt"] for p in val}
    for prompt, pairs in by_prompt.items():
        a, b = map(int, prompt.rstrip("=").split("+"))
        wrong = {int(p["rejected"]) for p in pairs}
        assert {p["chosen"] for p in pairs} == {str(a + b)} and len(wrong) == 4
        assert all(0 < abs(w - a - b) <= 10 and w >= 0 for w in wrong)
    # One near miss per question is the data a one-pair run sees, so held-out pairs do not change.
    _, single_val = write_arithmetic_pairs(tmp_path / "single", train_size=50, val_size=30, seed=3)
    assert single_val.read_text() == val_path.read_text()
    sft_rows = write_sft_rows(train_path, tmp_path / "sft.jsonl", PairDataConfig()).read_text().splitlines()
    assert len(sft_rows) == 50
    with pytest.raises(ConfigError, match=r"data\.generated_rejected_per_prompt must be between 1 and 10"):
        PairDataConfig(generated_rejected_per_prompt=11)


def test_reward_model_run_exports_a_sequence_classifier_with_the_runs_scores(tmp_path, plotted) -> None:
    config = load_rm_config(overrides=[*TINY, "warm_start.sft_steps=10", "trainer.total_steps=4"])
    result = RMTrainer(config, tmp_path / "rm").run()
    run = tmp_path / "rm"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "loss_curve.png", "warm_start/final_model"):
        assert (run / name).exists(), name
    last = result.evaluations[-1]
    assert {"val/loss", "val/accuracy", "val/margin", "val/scores/chosen"} <= set(last)
    records = read_records(run / "metrics.jsonl")
    assert {"train/rm_loss", "train/accuracy", "train/grad_norm"} <= set(records[1])
    # The curve names the Bradley-Terry loss (it read "NLL per response token") and plots pairwise accuracy.
    series = plotted(run / "loss_curve.png")
    assert series["val/loss"]["panel"].startswith("Bradley-Terry loss")
    assert series["train/accuracy"]["panel"] == series["val/accuracy"]["panel"]
    assert series["val/accuracy"]["panel"].startswith("pairwise accuracy")
    assert {"train/margin", "val/margin"} <= set(series)
    # Every run reports its speed (issue #15): the engine's perf/* metrics, as sft's records hold them.
    speed = records[1]
    assert speed["perf/tokens_per_s"] == pytest.approx(speed["perf/tokens"] / speed["perf/step_time_s"])
    assert speed["perf/tflops_per_device"] > 0
    # The loop beats (a collective timeout names the ranks behind, as in sft); it ended saving step 4.
    beat = json.loads((run / "heartbeat" / "rank0.json").read_text())
    assert (beat["step"], beat["phase"]) == (4, "save")
    # The start's weights are linked, its tokenizer copied: a checkpoint merge copies only regular side files
    # (regression: every file was a link, so `drivetrain ckpt merge` wrote a reward model without tokenizer).
    start = run / "initial_model"
    assert (start / "model.safetensors").is_symlink()
    assert (start / "tokenizer.json").is_file() and not (start / "tokenizer.json").is_symlink()

    model = AutoModelForSequenceClassification.from_pretrained(run / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(run / "final_model")
    rows = [json.loads(line) for line in (run / "data" / "val.jsonl").read_text().splitlines()]
    with torch.no_grad():
        score = lambda text: float(model(**tokenizer(text, return_tensors="pt")).logits[0, 0])  # noqa: E731
        chosen = torch.tensor([score(r["prompt"] + r["chosen"]) for r in rows])
        rejected = torch.tensor([score(r["prompt"] + r["rejected"]) for r in rows])
    # The run's held-out scores (engine, value head at the last response token) are the exported model's.
    assert float(chosen.mean()) == pytest.approx(last["val/scores/chosen"], abs=1e-5)
    assert float(rejected.mean()) == pytest.approx(last["val/scores/rejected"], abs=1e-5)
    assert float((chosen > rejected).float().mean()) == last["val/accuracy"]


def _fake_model(directory: Path, name: str) -> Path:
    """A model folder whose weights and tokenizer are the text ``weights of <name>``, ``tokenizer of <name>``."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    (directory / "model.safetensors").write_text(f"weights of {name}")
    (directory / "tokenizer.json").write_text(f"tokenizer of {name}")
    return directory


def test_the_reward_models_start_is_rebuilt_from_this_runs_model(tmp_path) -> None:
    """Files a previous run left in ``initial_model`` were kept (only config.json was rewritten), so a run in
    the same folder with another ``model.path`` (after --overwrite, or a crash before its first checkpoint)
    trained the previous model's weights and tokenizer under the new config."""
    from drivetrain_roles.rm.export import write_value_model_start

    sources = {}
    for name in ("a", "b"):
        sources[name] = _fake_model(tmp_path / name, name)
        (sources[name] / f"only_in_{name}.txt").write_text(name)
    target = tmp_path / "run" / "initial_model"
    write_value_model_start(str(sources["a"]), target)
    write_value_model_start(str(sources["b"]), target)
    assert (target / "model.safetensors").resolve() == (sources["b"] / "model.safetensors").resolve()
    assert (target / "tokenizer.json").read_text() == "tokenizer of b"
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "model.safetensors",
        "only_in_b.txt",
        "tokenizer.json",
    ]
    assert json.loads((target / "config.json").read_text())["num_labels"] == 1
    # The embedded model's untrained start is written to the folder itself: kept, given the reward config.
    write_value_model_start(str(target), target)
    assert (target / "tokenizer.json").read_text() == "tokenizer of b"
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 8


def test_a_resumed_reward_models_start_is_checked_not_rewritten(tmp_path, folder_state) -> None:
    """``--resume`` rebuilt ``initial_model`` before its checkpoint was checked (a refused resume wrote into the
    run folder); keeping it unchecked would train the run's model under another ``model.path``. A resumed start
    is left as it is when it is the asked model's (in a run folder moved whole too: its links into the run are
    relative), else one error names both models."""
    from drivetrain_engine_core.backend import CheckpointError
    from drivetrain_roles.rm.export import write_value_model_start

    old, run = tmp_path / "old", tmp_path / "run"
    warm = _fake_model(old / "warm_start" / "final_model", "warm")
    write_value_model_start(str(warm), old / "initial_model")
    assert (
        os.readlink(old / "initial_model" / "model.safetensors")
        == "../warm_start/final_model/model.safetensors"
    )
    before = folder_state(old)
    old.rename(run)
    start = run / "initial_model"
    write_value_model_start(str(run / "warm_start" / "final_model"), start, resume=True)
    assert folder_state(run) == before
    other = _fake_model(tmp_path / "other", "other")
    with pytest.raises(
        CheckpointError, match=rf"{start} was made from another model \({run}/warm_start/final"
    ):
        write_value_model_start(str(other), start, resume=True)
    assert folder_state(run) == before

    # A user's model outside the run is linked by its absolute path; another one with the same files is refused.
    user, start = _fake_model(tmp_path / "model", "user"), tmp_path / "user" / "initial_model"
    write_value_model_start(str(user), start)
    assert os.readlink(start / "model.safetensors") == str(user / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=rf"another model \({user}\) than this --resume starts from \({other}"
    ):
        write_value_model_start(str(other), start, resume=True)

    # The embedded model's untrained start, given the reward config in place, is kept; another model is refused.
    embedded = _fake_model(tmp_path / "embedded" / "initial_model", "embedded")
    write_value_model_start(str(embedded), embedded)
    before = folder_state(embedded)
    write_value_model_start(str(embedded), embedded, resume=True)
    assert folder_state(embedded) == before
    with pytest.raises(CheckpointError, match=r"another model \(its own files, the embedded model\)"):
        write_value_model_start(str(other), embedded, resume=True)
    assert folder_state(embedded) == before


def test_dpo_run_reports_trl_metrics_and_its_reference_modes_agree(tmp_path, plotted) -> None:
    # A reward function reused by name as a held-out measure (trainer.eval_metrics): val/exact_match.
    common = [*TINY, "warm_start.sft_steps=0", "trainer.total_steps=2", "trainer.eval_metrics=[exact_match]"]
    precomputed = DPOTrainer(load_dpo_config(overrides=common), tmp_path / "pre").run()
    engine = DPOTrainer(load_dpo_config(overrides=[*common, "dpo.reference=engine"]), tmp_path / "eng").run()
    assert engine.train_losses == pytest.approx(precomputed.train_losses, rel=1e-5)
    assert engine.evaluations[-1]["val/loss"] == pytest.approx(
        precomputed.evaluations[-1]["val/loss"], rel=1e-5
    )
    first = precomputed.evaluations[0]
    # Before any step the policy is the reference: log-ratios, rewards and margins are 0, the loss is log 2.
    assert first["val/loss"] == pytest.approx(0.693147, abs=1e-5)
    assert first["val/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    records = read_records(tmp_path / "pre" / "metrics.jsonl")
    names = {
        "train/rewards/chosen",
        "train/rewards/rejected",
        "train/rewards/margins",
        "train/rewards/accuracies",
    }
    assert names <= set(records[1])
    assert "val/accuracy" in first  # greedy exact match of the chosen answers
    # The curve leads with the DPO loss by its name and TRL's preference accuracy and margins; exact match is
    # a side panel (the curve called the loss "NLL per response token" and plotted only exact match).
    series = plotted(tmp_path / "pre" / "loss_curve.png")
    assert [series[k]["panel"] for k in ("val/loss", "val/rewards/accuracies", "val/rewards/margins")] == [
        "DPO loss (sigmoid, beta=0.5)",
        "preference accuracy: chosen reward > rejected reward",
        "reward margin: beta * (chosen - rejected log-ratio to the reference)",
    ]
    assert {"train/rewards/accuracies", "train/rewards/margins"} <= set(series)
    assert "exact match" in series["val/accuracy"]["panel"]
    assert [e["val/exact_match"] for e in precomputed.evaluations] == [
        e["val/accuracy"] for e in precomputed.evaluations
    ]
    assert series["val/exact_match"]["panel"] == "held-out answers: your measures (trainer.eval_metrics)"
    AutoModelForCausalLM.from_pretrained(tmp_path / "pre" / "final_model")


def test_commands_are_registered_and_spawn_two_ranks(tmp_path) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(
        drivetrain_cli,
        [
            "rm",
            "--nproc",
            "2",
            "--output-dir",
            str(tmp_path / "rm2"),
            *TINY,
            "warm_start.sft_steps=0",
            "trainer.total_steps=2",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "rm2" / "summary.json").read_text())
    assert summary["evaluations"][-1]["step"] == 2
    bad = CliRunner().invoke(
        drivetrain_cli,
        ["dpo", "--nproc", "2", "--output-dir", str(tmp_path / "d"), "model.path=/nonexistent"],
    )
    assert bad.exit_code == 1 and "model.path=/nonexistent does not exist" in bad.output


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_a_batch_the_ranks_cannot_split_is_refused_before_the_warm_start(
    command, tmp_path, monkeypatch
) -> None:
    """Regression: ``drivetrain rm --nproc 2 trainer.batch_size=3`` ran the whole SFT warm start, then failed."""
    from drivetrain_engine_core.kit import distributed
    from drivetrain_roles.preference import trainer as pair_trainer

    monkeypatch.setattr(distributed, "world_size", lambda group=None: 2)
    monkeypatch.setattr(pair_trainer, "run_warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    load, trainer = (load_dpo_config, DPOTrainer) if command == "dpo" else (load_rm_config, RMTrainer)
    config = load(None, [*TINY, "trainer.batch_size=3"])
    with pytest.raises(DataError, match=r"trainer.batch_size=3 is not divisible by the data-parallel size 2"):
        trainer(config, tmp_path / "run").run()
    assert not (tmp_path / "run").exists()  # nothing written either


def test_pair_data_the_steps_cannot_use_is_refused_before_the_warm_start(tmp_path, monkeypatch) -> None:
    """A file without the rejected column, or one pair per micro-batch impossible (``micro_batch_size=1``), was
    refused only after the SFT warm start (250 steps by default); the missing column even as a bare KeyError on
    rank 0 alone, while the other ranks waited for it to write the warm start's rows."""
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_roles.preference import trainer as pair_trainer

    monkeypatch.setattr(pair_trainer, "run_warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "1+2=", "chosen": "3"}) + "\n")
    config = load_dpo_config(None, [*TINY, f"data.train_files=[{missing}]", "data.val_files=[]"])
    with pytest.raises(DataError, match=r"missing.jsonl row 0 has no column 'rejected'"):
        DPOTrainer(config, tmp_path / "run").run()
    config = load_dpo_config(None, [*TINY, "engine.micro_batch.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=r"micro_batch_size=1, but the chosen and rejected sides"):
        DPOTrainer(config, tmp_path / "run2").run()


def test_a_pair_over_the_token_budget_is_refused_when_the_pairs_load(tmp_path) -> None:
    """With dynamic batching a pair longer than ``max_tokens`` failed at the step that drew it."""
    config = load_dpo_config(
        None, [*TINY, "warm_start.sft_steps=0", "engine.micro_batch.max_tokens=12", "data.max_length=12"]
    )
    with pytest.raises(
        DataError, match=r"a pair has \d+ tokens .* engine.micro_batch.max_tokens=12; raise it"
    ):
        DPOTrainer(config, tmp_path / "run").run()


def test_a_rank_without_pairs_in_the_last_precompute_chunk_still_joins_the_forward(monkeypatch) -> None:
    """257 pairs on 2 ranks left rank 1 without a pair in the last chunk of 256: it raised "input_ids is
    empty" while rank 0 waited in the collective forward. It now scores the chunk's first pair and keeps
    nothing (here rank 1 of 2, chunks of 3, 4 pairs: the second chunk is pair 3 alone)."""
    from types import SimpleNamespace

    import torch
    from drivetrain_roles.dpo import trainer as dpo_trainer

    scored_uids: list[list[int]] = []

    def reference_sums(reference, batch):
        uids = batch["uid"][::2].tolist()
        scored_uids.append(uids)
        return torch.tensor([float(-u) for u in uids for _ in range(2)])

    monkeypatch.setattr(dpo_trainer, "PRECOMPUTE_CHUNK", 3)
    monkeypatch.setattr(dpo_trainer, "reference_sums", reference_sums)
    monkeypatch.setattr(dpo_trainer.distributed, "rank", lambda group=None: 1)
    monkeypatch.setattr(dpo_trainer.distributed, "world_size", lambda group=None: 2)
    # This process stands for rank 1 alone (a process group another test left in place has one rank).
    monkeypatch.setattr(dpo_trainer.distributed, "all_gather_objects", lambda obj, group=None: [obj])
    from drivetrain_roles.jobs.data import Example
    from drivetrain_roles.preference.data import PairExample

    example = Example([1, 2], [3], "", "")
    trainer = SimpleNamespace(
        uids={u: PairExample(chosen=example, rejected=example) for u in range(4)}, ref_logps={}
    )
    dpo_trainer.DPOTrainer._precompute(trainer, reference=None)  # type: ignore[arg-type]
    assert scored_uids == [[1], [3]]
    assert trainer.ref_logps == {1: (-1.0, -1.0)}


def test_a_warm_start_batch_larger_than_the_data_names_the_commands_own_setting(tmp_path) -> None:
    """The warm start is an SFT run, whose error named ``trainer.batch_size=64``: DPO's trainer.batch_size is 32
    and the 64 was ``warm_start.batch_size`` (GRPO's warm-start batch could not be set at all)."""
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_roles.grpo.config import load_config as load_grpo_config
    from drivetrain_roles.grpo.trainer import GRPOTrainer

    config = load_dpo_config(None, [*TINY, "data.generated_train_size=16", "warm_start.sft_steps=2"])
    with pytest.raises(
        DataError, match=r"^warm_start.batch_size=64 is larger than the 16 training examples; lower "
    ):
        DPOTrainer(config, tmp_path / "dpo").run()
    config = load_grpo_config(None, ["data.generated_train_size=16", "trainer.progress_bar=false"])
    with pytest.raises(DataError, match=r"^trainer.warm_start_batch_size=64 is larger than the 16 training"):
        GRPOTrainer(config, tmp_path / "grpo").run()
    with pytest.raises(ConfigError, match=r"trainer.warm_start_steps=0 with model.path=builtin:arithmetic"):
        load_grpo_config(None, ["trainer.warm_start_steps=0"])
