"""``rollout.options``: the chosen rollout's own options, from the command line and YAML, refused before the warm
start when the rollout does not take them, handed to the rollout built as its plugin's dataclass."""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import ConfigError, hookimpl
from drivetrain_engine_core.job import plugins
from drivetrain_engine_core.rollout import RolloutOptions
from drivetrain_engine_core.testing import make_tiny_model_dir
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.trainer import GRPOTrainer
from drivetrain_roles.jobs.default_assets import write_model_dir
from drivetrain_roles.ppo.config import load_config as load_ppo_config
from drivetrain_roles.rl.rollout_plugin import build_rollout
from drivetrain_roles.rollout.hf import HFRollout
from drivetrain_roles.runtime.command_config import to_yaml
from transformers import AutoTokenizer


@dataclass(kw_only=True, frozen=True)
class PatientOptions(RolloutOptions):
    wait_s: float | None = None
    tags: tuple[str, ...] = ()
    max_len: int | None = None

    def length_limit(self) -> tuple[str, int] | None:
        return None if self.max_len is None else ("max_len", self.max_len)


class PatientHF(HFRollout):
    """``hf`` with options of its own, as a plugin would register it."""

    name = "patient-hf"
    options_class = PatientOptions

    def __init__(self, *, model_path, device="cpu", verify=None, options: PatientOptions | None = None):
        super().__init__(model_path=model_path, device=device, verify=verify)
        self.options = options


@hookimpl
def _register(registry):
    registry.register("patient-hf", PatientHF)


_ENTRY_POINT = InMemoryEntryPoint(
    name="patient",
    distribution="drivetrain-rollout-patient",
    plugin=SimpleNamespace(register_rollouts=_register),
)


@pytest.fixture
def patient_plugin():
    installed = list(importlib.metadata.entry_points(group="drivetrain"))
    reset_plugins()
    plugins(lambda: get_plugin_manager(entry_points=[*installed, _ENTRY_POINT]))
    yield
    reset_plugins()


OVERRIDES = ["rollout.name=patient-hf", "rollout.options.wait_s=600", "rollout.options.tags=[a, b]"]


def test_options_from_the_command_line_and_yaml_reach_the_rollout_as_its_dataclass(tmp_path, patient_plugin):
    config = load_config(None, OVERRIDES)
    assert config.rollout.options == {"wait_s": 600, "tags": ["a", "b"]}
    assert load_ppo_config(None, OVERRIDES).rollout.options == config.rollout.options
    file = tmp_path / "run.yaml"
    file.write_text("rollout:\n  name: patient-hf\n  options:\n    wait_s: 600\n    tags: [a, b]\n")
    assert load_config(str(file)) == config
    printed = tmp_path / "printed.yaml"  # what --print-config and a run's config.yaml hold, re-run as is
    printed.write_text(to_yaml(config))
    assert load_config(str(printed)) == config
    assert load_config(None).rollout.options == {}

    model_dir = make_tiny_model_dir(tmp_path / "lm")
    rollout = build_rollout(config.rollout, str(model_dir), "cpu", config.trainer)
    assert isinstance(rollout, PatientHF)
    assert rollout.options == PatientOptions(wait_s=600.0, tags=("a", "b"))


def test_an_option_the_rollout_does_not_take_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    from drivetrain_roles.rl import policy_trainer

    monkeypatch.setattr(policy_trainer, "start_model", lambda *a, **k: pytest.fail("the warm start ran"))
    config = load_config(None, ["rollout.options.request_timeout_s=600", "trainer.progress_bar=false"])
    version = importlib.metadata.version("drivetrain-roles")
    with pytest.raises(ConfigError) as error:
        GRPOTrainer(config, tmp_path / "run").run()
    assert str(error.value) == (
        f"rollout 'hf' (drivetrain-roles {version}) has no option 'request_timeout_s' "
        "(rollout.options.request_timeout_s); it takes no options: drop rollout.options.request_timeout_s."
    )


class _ActorBuilt(Exception):
    pass


def test_a_prompt_over_the_rollouts_length_limit_is_refused_when_the_prompts_load(
    tmp_path, monkeypatch, patient_plugin
):
    """vLLM refuses a prompt over its max_model_len only at the step that first samples it (a traceback hours
    into a run); a rollout's options now declare that limit, and the job checks its longest prompt plus
    rollout.max_new_tokens against it before any engine is built. The limit itself is accepted."""

    def actor_built(*args, **kwargs):
        raise _ActorBuilt

    monkeypatch.setattr(GRPOTrainer, "make_actor", actor_built)
    model = write_model_dir(tmp_path / "model")
    base = [
        f"model.path={model}",
        "rollout.name=patient-hf",
        "rollout.max_new_tokens=4",
        "data.generated_train_size=8",
        "data.generated_val_size=2",
        "trainer.progress_bar=false",
    ]
    with pytest.raises(ConfigError) as error:
        GRPOTrainer(load_config(None, [*base, "rollout.options.max_len=4"]), tmp_path / "short").run()
    # The reference: the prompts the run wrote, tokenised as plain `tokenizer(prompt)`, plus the 4 new tokens.
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    written = [(tmp_path / "short" / "data" / f"{split}.jsonl").read_text() for split in ("train", "val")]
    prompts = [json.loads(line)["prompt"] for text in written for line in text.splitlines()]
    longest = max(len(tokenizer(prompt)["input_ids"]) for prompt in prompts) + 4
    assert longest > 4 and str(error.value) == (
        f"the longest prompt plus rollout.max_new_tokens=4 is {longest} tokens, over rollout.options.max_len=4 of "
        "rollout 'patient-hf'; lower rollout.max_new_tokens or data.max_length (which bounds the prompts), or "
        "raise the limit."
    )
    with pytest.raises(_ActorBuilt):
        GRPOTrainer(load_config(None, [*base, f"rollout.options.max_len={longest}"]), tmp_path / "fits").run()
    with pytest.raises(
        ConfigError, match=f"is {longest} tokens, over rollout.options.max_len={longest - 1} "
    ):
        GRPOTrainer(
            load_config(None, [*base, f"rollout.options.max_len={longest - 1}"]), tmp_path / "over"
        ).run()
