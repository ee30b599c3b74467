"""What a job's prompts must fit, checked when they load: the longest prompt plus a response against every
length limit on the way (model, micro-batch, rollout), and answers a response cannot reach."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from drivetrain_engine_core.backend import ConfigError, TokenLimits
from drivetrain_engine_core.job import SECTION, rollout_options
from drivetrain_engine_core.kit import distributed

if TYPE_CHECKING:
    from ..jobs.data import Example
    from .job_config import RolloutJobConfig

logger = logging.getLogger(__name__)


def warn_unreachable_answers(examples: list[Example], max_new_tokens: int, eos_token_id: int | None) -> None:
    """Warn (rank 0) when reference answers are longer than a response may be: the exact-answer reward of their
    prompts is 0 whatever the policy does (``rollout.max_new_tokens`` is 6 for the embedded job's sums, and a
    user's model keeps it unless set)."""
    lengths = [len(e.response_ids) - (e.response_ids[-1:] == [eos_token_id]) for e in examples]
    unreachable = sum(length > max_new_tokens for length in lengths)
    if unreachable and distributed.rank() == 0:
        logger.warning(
            "%d of %d training answers are longer than rollout.max_new_tokens=%d tokens (the longest has %d): their "
            "prompts can never earn reward 1. Raise rollout.max_new_tokens.",
            unreachable,
            len(examples),
            max_new_tokens,
            max(lengths),
        )


def check_rollout_length(examples: list[Example], config: RolloutJobConfig, model_path: str) -> None:
    """The longest prompt plus ``rollout.max_new_tokens`` (in an environment: ``environment.max_total_tokens``)
    must fit the model's positions, the rollout's own limit (vLLM's ``rollout.options.max_model_len``) and, with
    dynamic batching, one micro-batch: checked when the prompts load, not at the step whose sample first grows
    that long (a ``BatchError``, or the rollout's refusal, hours into a run).

    Raises:
        ConfigError: the longest possible sequence exceeds a limit (names the setting).
    """
    from transformers import AutoConfig

    longest = max((len(e.prompt_ids) for e in examples), default=0) + config.rollout.max_new_tokens
    what = f"the longest prompt plus rollout.max_new_tokens={config.rollout.max_new_tokens}"
    fix = "lower rollout.max_new_tokens or data.max_length (which bounds the prompts)"
    if config.environment.enabled:  # an episode grows to its token limit, observations included
        longest = config.environment.max_total_tokens
        what, fix = "environment.max_total_tokens (an episode's longest sequence)", "lower it"
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    positions = TokenLimits.from_hf_config(hf_config, model_path).max_positions
    budget = config.engine.micro_batch.max_tokens
    limits = [
        (positions, f"the model's max_position_embeddings={positions}"),
        (budget, f"engine.micro_batch.max_tokens={budget}"),
    ]
    rollout_limit = rollout_options(config.rollout.name, config.rollout.options).length_limit()
    if rollout_limit is not None:
        option, value = rollout_limit
        limits.append((value, f"{SECTION}.{option}={value} of rollout {config.rollout.name!r}"))
    for limit, setting in limits:
        if limit is not None and longest > limit:
            raise ConfigError(f"{what} is {longest} tokens, over {setting}; {fix}, or raise the limit.")
