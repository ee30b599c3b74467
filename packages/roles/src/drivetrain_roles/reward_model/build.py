"""The reward models of a job, built in its set-up and handed to what scores with them.

A reward model's engine belongs to the job that builds it (:func:`build_reward_models`, collective), as its
actor and rollout do: the job passes the models, by their ``algorithm.reward_functions`` entry, to its scorer
(``rl.scoring.RewardScorer``), whose reward loader binds each model entry to its model
(``rl.rewards.load_rewards``). A reward model is so one more named, weighted reward entry, the reward code needs
no engine of its own, and two jobs in one process score with their own models.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from drivetrain_engine_core.backend import ConfigError, EngineConfig, ModelConfig

from .config import RewardModelConfig
from .render import PromptColumns
from .scorer import RewardModel
from .spec import check_model_folder


def make_reward_models(config: Any, held_out: int, world_size: int) -> dict[str, RewardModel]:
    """The reward models among an RL job's ``config.algorithm`` rewards, each on its own engine, by entry
    (collective; empty without any).

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
    """Build the reward model of each folder in ``specs`` on its own inference-only engine (collective); the
    models by their entry in ``specs``.

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
    from drivetrain_engine_core.job import create_engine, plugins
    from transformers import AutoTokenizer

    from ..output_ranks import require_outputs_on_every_rank

    built = {}
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
        built[spec] = RewardModel(reward_engine, tokenizer, data, pad)
    return built
