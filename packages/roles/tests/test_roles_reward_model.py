"""A reward model as a reward: a Hugging Face sequence-classification model on its own engine scores each
completion, its conversation rendered with its own chat template, equal to a plain single-process
``AutoModelForSequenceClassification`` forward (fp32, within 1e-5) on FSDP and on Megatron; mixed with a reward
function in the weighted sum; folders that are no reward model refused at the config check with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError, EngineConfig, ModelConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import make_tiny_model_dir
from drivetrain_roles.command_sections import DataConfig
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.reward_model import RewardModelConfig, build_reward_models
from drivetrain_roles.rl.reward_inputs import RewardInputs
from drivetrain_roles.rl.reward_settings import RewardSettings
from drivetrain_roles.rl.rewards import reward_metrics, score_completions

# The reward model's template is not the policy's ChatML: the conversation must be rendered again for it.
RM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}</s>"
    "{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
)
SYSTEM = "You answer sums; the answer is the sum alone, written as digits, with nothing after it."
PROMPTS = ["what is 2+3?", "what is 14+27? think step by step, then answer", "1+1"]
COMPLETIONS = ["5", "14+27=41; the answer is 41", "the answer is 3", "2", "hello world", "41"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama ``ForSequenceClassification`` (one label, random head, no bias) with its own template."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("rm")
    lm = make_tiny_model_dir(root / "lm", arch="llama", hidden_size=64)
    config = AutoConfig.from_pretrained(lm, num_labels=1)
    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    target = root / "sum_rm"
    model.save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(lm)
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(target)
    return target


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in PROMPTS]


def hf_scores(folder: Path, completions: list[str]) -> torch.Tensor:
    """The plain reference: the RM's template over prompt + completion, right-padded, one HF forward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    chats = [
        conversations()[i // 2] + [{"role": "assistant", "content": c}] for i, c in enumerate(completions)
    ]
    rows = [tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"] for chat in chats]
    width = max(len(r) for r in rows)
    pad = model.config.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0]


def inputs() -> RewardInputs:
    examples = [
        Example(
            prompt_ids=[1],
            response_ids=[],
            prompt_text=f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n",
            response_text=answer,
            columns={"messages": chat, "answer": answer},
        )
        for p, chat, answer in zip(PROMPTS, conversations(), ["5", "41", "2"], strict=True)
    ]
    return RewardInputs.of(examples, COMPLETIONS)


def engine_config(backend: str) -> EngineConfig:
    if backend == "megatron":
        from drivetrain_engine_megatron import MegatronEngineConfig

        return MegatronEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=1))
    from drivetrain_engine_fsdp import FSDPEngineConfig

    return FSDPEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=1))


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_reward_model_scores_equal_a_plain_hf_forward_and_mix_with_a_function(reward_model_dir, backend):
    """Six completions of three chat prompts (88-128 tokens in the RM's template, micro-batches of 2) on the
    backend's engine: each score equals HF's ``logits[:, 0]`` at the last non-padding token within 1e-5; the
    weighted sum with exact_match is ``1 x exact + 0.5 x score``, both logged by name."""
    spec = str(reward_model_dir)
    data = DataConfig(messages_key="messages", response_key=None)
    models = build_reward_models(
        [spec],
        model=ModelConfig(path="unused"),
        engine=engine_config(backend),
        section=RewardModelConfig(micro_batch_size=2),
        data=data,
    )
    expected = hf_scores(reward_model_dir, COMPLETIONS)
    settings = RewardSettings(functions=("exact_match", spec), weights=(1.0, 0.5))
    batch = inputs()
    batch.keywords["references"] = [r for r in ["5", "41", "2"] for _ in range(2)]  # type: ignore[index]
    scores = score_completions(settings, batch, models)
    torch.testing.assert_close(scores.values[:, 1].float(), expected, atol=1e-5, rtol=0)
    exact = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(scores.total.double(), exact + 0.5 * expected.double(), atol=1e-5, rtol=0)
    assert scores.names == ("exact_match", "sum_rm")
    assert reward_metrics(scores)["reward/sum_rm"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert float(expected.std()) > 1e-3  # the scores differ: a constant would hide a misread position


def _refusal(folder: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"algorithm.reward_functions=[exact_match,{folder}]"])
    return str(caught.value)


def test_folders_that_are_no_reward_model_are_refused_with_the_fix(reward_model_dir, tmp_path):
    """A missing folder, a causal language model, a two-label classifier: one config error each, naming the
    folder and what to give instead (the config check, before any engine or warm start)."""
    assert "has no config.json" in _refusal(tmp_path / "nowhere")
    assert "drivetrain rm" in _refusal(tmp_path / "nowhere")
    lm = make_tiny_model_dir(tmp_path / "lm", arch="llama", hidden_size=64)
    assert "not a *ForSequenceClassification model" in _refusal(lm)
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    config = json.loads((reward_model_dir / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (classifier / "config.json").write_text(json.dumps(config))
    assert "num_labels=2" in _refusal(classifier)
    with pytest.raises(
        ConfigError, match=r"reward_model.enable \(verl's name\); did you mean algorithm.reward_functions"
    ):
        load_config(None, ["reward_model.enable=true", f"reward_model.model.path={reward_model_dir}"])
    settings = load_config(None, [f"algorithm.reward_functions=[exact_match,{reward_model_dir}]"])
    assert settings.algorithm.rewards().models == (str(reward_model_dir),)
    assert settings.algorithm.rewards().names == ("exact_match", "sum_rm")


RECORDER = """
import json


def seen(prompts, completions):
    with open({log!r}, "a") as log:
        log.write(json.dumps({{"prompts": list(prompts), "completions": list(completions)}}) + "\\n")
    return [0.0] * len(completions)
"""


def arithmetic_reward_model(model_dir: Path, target: Path) -> Path:
    """A one-label sequence classifier on the arithmetic model's config and tokenizer (random weights)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    torch.manual_seed(11)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return target


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_a_run_rewards_with_the_reward_model_as_hugging_face_scores(tmp_path, command):
    """``drivetrain grpo``/``ppo`` with ``[recorder, reward model]`` weighted ``[1, 0.5]`` on plain arithmetic
    prompts: each step's ``reward/<model>`` is the mean of a plain HF forward of ``tokenizer(prompt +
    completion)`` over the completions the recorder saw, and ``train/reward`` half of it."""
    from click.testing import CliRunner
    from drivetrain_engine_core._cli import main as drivetrain_cli
    from drivetrain_roles.jobs.default_assets import write_model_dir
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    rm = arithmetic_reward_model(model_dir, tmp_path / "judge")
    log = tmp_path / "seen.jsonl"
    (tmp_path / "recorder.py").write_text(RECORDER.format(log=str(log)))
    rows = "".join(json.dumps({"prompt": f"{a}+{a}=", "response": str(2 * a)}) + "\n" for a in range(1, 9))
    (tmp_path / "train.jsonl").write_text(rows)
    overrides = [
        f"model.path={model_dir}",
        f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'train.jsonl'}]",
        f"algorithm.reward_functions=[{tmp_path / 'recorder.py'}:seen,{rm}]",
        "algorithm.reward_weights=[1.0,0.5]",
        "reward_model.micro_batch_size=3",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "trainer.eval_every=0",
        "trainer.eval_samples=2",
        "trainer.save_every=0",
        "trainer.progress_bar=false",
        *(["trainer.critic_warmup=0"] if command == "ppo" else []),
    ]
    run = tmp_path / "run"
    result = CliRunner().invoke(drivetrain_cli, [command, "--output-dir", str(run), *overrides])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward" in r]
    batches = [json.loads(line) for line in log.read_text().splitlines()]
    training = [b for b in batches if len(b["completions"]) == 16]
    assert [r["step"] for r in steps] == [1, 2] and len(training) == 2
    tokenizer = AutoTokenizer.from_pretrained(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    for record, batch in zip(steps, training, strict=True):
        with torch.no_grad():
            scores = [
                float(model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0])
                for p, c in zip(batch["prompts"], batch["completions"], strict=True)
            ]
        assert record["reward/judge"] == pytest.approx(sum(scores) / 16, abs=1e-5)
        assert record["train/reward"] == pytest.approx(0.5 * sum(scores) / 16, abs=1e-5)
    assert any("val/reward" in r for r in records)


class StandIn:
    """A reward model's stand-in (a built model is called with every keyword): ``scale x characters - 4``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, **keywords) -> list[float]:
        return [self.scale * len(c) - 4.0 for c in keywords["completions"]]


def test_two_jobs_in_one_process_score_with_their_own_reward_models(reward_model_dir):
    """Two jobs name the same folder (a reward model retrained in place between them) and each holds its own
    built model: scored in turn, A, B, A, each job's weighted sum is ``exact + 0.5 x its model`` (a process-wide
    slot gave A the model B built last). Without a built model (the Ray controllers) the entry raises one error
    naming the commands that build it; ``trainer.eval_metrics`` refuses a model folder before any work."""
    from drivetrain_engine_core.backend import DrivetrainError
    from drivetrain_roles.held_out_metrics import HeldOutMetrics

    spec = str(reward_model_dir)
    settings = RewardSettings(functions=("exact_match", spec), weights=(1.0, 0.5))
    batch = RewardInputs.of_texts(["1+1="] * 3, ["2", "two", "11"], ["2"] * 3)
    job_a, job_b = {spec: StandIn(1.0)}, {spec: StandIn(-2.0)}
    model_a, model_b = [1 - 4, 3 - 4, 2 - 4], [-2 - 4, -6 - 4, -4 - 4]  # scale x (1, 3, 2 characters) - 4
    for job, model in [(job_a, model_a), (job_b, model_b), (job_a, model_a)]:
        scores = score_completions(settings, batch, job)
        expected = [exact + 0.5 * value for exact, value in zip([1, 0, 0], model, strict=True)]
        assert scores.total.tolist() == pytest.approx(expected, abs=1e-6)
        assert reward_metrics(scores)["reward/sum_rm"] == pytest.approx(sum(model) / 3)
    with pytest.raises(DrivetrainError, match=r"no engine in this job: drivetrain grpo and ppo build it"):
        score_completions(settings, batch)
    with pytest.raises(ConfigError, match=r"'.*sum_rm' is a reward model's folder, and sft and dpo build no"):
        HeldOutMetrics.load(["exact_match", spec])
