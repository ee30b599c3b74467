"""The reward models of a job, built once per process and found by the reward functions' loader.

NOTE: a reward model's engine is process state, like the rollout: the job builds it in its setup
(:func:`build_reward_models`, collective) and the reward function :func:`model_reward` returns looks it up
when called, so that a reward model is one more named, weighted reward entry and the reward code needs no
engine of its own. A new job's models replace the previous job's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from drivetrain_engine_core.config import ConfigError, EngineConfig, ModelConfig
from drivetrain_engine_core.errors import DrivetrainError

from .config import RewardModelConfig
from .render import PromptColumns
from .scorer import RewardModel
from .spec import check_model_folder

_BUILT: dict[str, RewardModel] = {}


def make_reward_models(config: Any, held_out: int, world_size: int) -> dict[str, RewardModel]:
    """The reward models among an RL job's ``config.algorithm`` rewards, each on its own engine (collective;
    none: the previous job's are let go).

    Raises:
        ConfigError: held-out evaluation would leave a rank without prompts (each rank scores its own share
            with the reward model, together), or a folder that is not a reward model.
    """
    models = config.algorithm.rewards().models
    evaluated = min(config.trainer.eval_samples, held_out)
    if models and 0 < evaluated < world_size:
        raise ConfigError(
            f"trainer.eval_samples={config.trainer.eval_samples} held-out prompts ({held_out} in the data) leave "
            f"some of the {world_size} ranks without one, and every rank scores its share with the reward model "
            f"together; set trainer.eval_samples to at least {world_size}, or 0 (no held-out evaluation)."
        )
    return build_reward_models(
        models, model=config.model, engine=config.engine, section=config.reward_model, data=config.data
    )


def build_reward_models(
    specs: Sequence[str],
    *,
    model: ModelConfig,
    engine: EngineConfig,
    section: RewardModelConfig,
    data: PromptColumns,
) -> dict[str, RewardModel]:
    """Build the reward model of each folder in ``specs`` on its own inference-only engine (collective).

    Args:
        specs: the reward entries that name model folders (:func:`.spec.is_model_spec`).
        model: the policy's model section (its ``trust_remote_code``, padding and dropout settings apply; the
            weights are the folder's, without adapters).
        engine: the job's engine section (the reward model's backend and layout).
        section: the ``reward_model`` section.
        data: the job's ``data`` section (where the prompt messages are).

    Raises:
        ConfigError: a folder that is not a one-label sequence-classification model.
    """
    from drivetrain_engine_core.factory import create_engine
    from drivetrain_engine_core.plugins import plugins
    from transformers import AutoTokenizer

    from ..output_ranks import require_outputs_on_every_rank

    _BUILT.clear()
    for spec in specs:
        path = check_model_folder(spec)
        model_config = dataclasses.replace(
            model,
            path=str(path),
            model_type="value_model",
            from_config_only=False,
            lora=None,
            gradient_checkpointing=False,
        )
        backend = plugins().engines.get("value_model", engine.backend, engine.device)
        reward_engine = create_engine(
            model_config=model_config,
            engine_config=section.engine_config(engine, can_offload=backend.capabilities.offload),
        )
        reward_engine.initialize()
        require_outputs_on_every_rank(reward_engine, f"the reward model {spec!r}")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
        pad = json.loads((path / "config.json").read_text()).get("pad_token_id")
        _BUILT[spec] = RewardModel(reward_engine, tokenizer, data, pad)
    return dict(_BUILT)


def model_reward(spec: str) -> Callable[..., Any]:
    """The reward function of the model folder ``spec``: its :class:`.scorer.RewardModel`, looked up when
    called (the job builds it after the rewards are loaded and checked)."""

    def reward_model(**keywords: Any) -> list[float]:
        if spec not in _BUILT:
            raise DrivetrainError(
                f"the reward model {spec!r} has no engine in this process: drivetrain grpo and ppo build it at "
                "set-up (build_reward_models), the Ray controllers (ColocatedGRPO and its kin) do not yet; run "
                "the command (drivetrain grpo / drivetrain ppo), or score with a reward function there."
            )
        return _BUILT[spec](**keywords)

    return reward_model
