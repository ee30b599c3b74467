"""drivetrain's :class:`~drivetrain_engine_core.rollout.SamplingConfig` as vLLM ``SamplingParams``."""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.rollout import SamplingConfig

PROMPT_SEED_STRIDE = 1_000_003
"""A call's prompt ``i`` samples with seed ``sampling.seed + i * PROMPT_SEED_STRIDE``.

NOTE: vLLM seeds each request on its own, so equal prompts under one seed sampled equal responses (a group's
episodes at their first turn, a prompt a data set repeats), where the ``hf`` rollout draws the whole batch from
one generator. A seed per prompt keeps a call reproducible and its prompts independent; the stride keeps the
seeds of a request's ``n`` samples apart from the next prompt's.
"""


def sampling_params(sampling: SamplingConfig, *, end_ids: tuple[int, ...], prompt: int = 0) -> Any:
    """vLLM's ``SamplingParams`` for prompt number ``prompt`` of a call with ``sampling``, asking for the sampled
    token's log-prob at every step.

    vLLM's defaults that would change the distribution are pinned off (penalties 1/0, no bad words), and the
    model's generation config is not read (``LLM(generation_config="vllm")``), so the distribution sampled
    from is drivetrain's: temperature, then ``top_k``/``top_p``/``min_p``. Greedy decoding (temperature 0)
    reports log-probs at temperature 1, as the ``hf`` rollout does.

    Args:
        sampling: drivetrain's sampling options.
        end_ids: the model's end-of-sequence ids; a response ends after one (kept in the response).
        prompt: the prompt's place in the call (its seed, :data:`PROMPT_SEED_STRIDE`).
    """
    from vllm import SamplingParams

    greedy = sampling.temperature == 0
    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_k=0 if greedy else sampling.top_k,
        top_p=1.0 if greedy else sampling.top_p,
        min_p=0.0 if greedy else sampling.min_p,
        seed=sampling.seed + prompt * PROMPT_SEED_STRIDE,
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(dict.fromkeys((*end_ids, *sampling.stop_token_ids))),
        ignore_eos=False,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logprobs=0,
        detokenize=False,
    )
