"""The Hugging Face ``generate`` rollout: exact per-token log-probs of what it samples, CPU-testable.

Prompts are left-padded into one batch, each repeated ``n`` times; ``generate`` samples with the temperature
and the sampling's own ``top_k``/``top_p``/``min_p`` only (no other warper changes the distribution). Without
truncation the log-prob of each sampled token is ``log_softmax(logits / temperature)`` at it: the same value
the actor computes for that token (docs/architecture.md §8); with it, the log-softmax of the processed scores
``generate`` sampled from. The model's own ``generation_config.json`` is
set aside (its ``repetition_penalty``, ``no_repeat_ngram_size``, ... would otherwise fill every field left
unset and sample from another distribution than the reported log-probs), except its end-of-sequence ids. A
response ends after its first end-of-sequence token: any of the model config's and generation config's
(Llama 3 lists several; Gemma's chat models end turns with one only the generation config names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from drivetrain_engine_core.kit import recording_routes, routers_of
from drivetrain_engine_core.rollout import (
    RecordsRoutedExperts,
    Rollout,
    SamplingConfig,
    VerifyConfig,
    WeightBucket,
    end_of_sequence_ids,
)

from .routes import sequence_routes
from .weights import ServedWeights


class HFRollout(Rollout, RecordsRoutedExperts):
    """``transformers`` ``generate`` over the model at ``model_path``, updated in place by weight buckets; on a
    mixture-of-experts model it records each token's routed experts when asked (router replay).

    It keeps nothing across requests (each ``generate`` call builds its own KV cache, and nothing is compiled),
    so it leaves core's ``_drop_caches`` hook as it is: there is no cache of old weights to drop.
    """

    name = "hf"

    def __init__(self, *, model_path: str, device: str = "cpu", verify: VerifyConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        super().__init__(model_path=model_path, device=device, verify=verify)
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = model.to(device).eval()
        self._eos_ids = end_of_sequence_ids(self.model.config, self.model.generation_config)
        pad_id = self.model.config.pad_token_id
        self._pad_id = pad_id if pad_id is not None else (self._eos_ids[0] if self._eos_ids else 0)
        # NOTE: generate fills every field our config leaves unset from the model's generation config.
        self.model.generation_config = GenerationConfig()
        self._weights = ServedWeights(self.model)
        self._routes: list[torch.Tensor] = []

    def _load_bucket(self, bucket: WeightBucket) -> None:
        self._weights.load(bucket)

    def _finish_update(self) -> None:
        self._weights.finish()

    def _abort_update(self) -> None:
        self._weights.forget_stream()

    def _served_tensor(self, name: str) -> torch.Tensor | None:
        return self._weights.served(name)

    @torch.no_grad()
    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for index, prompt in enumerate(prompts):
            input_ids[index, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[index, width - len(prompt) :] = 1
        # Each prompt's row repeated n times (prompt-major), built once per prompt, not once per sample.
        input_ids = input_ids.repeat_interleave(sampling.n, dim=0)
        attention_mask = attention_mask.repeat_interleave(sampling.n, dim=0)
        # The sampling seed seeds every generator (manual_seed), so the device's is forked too: it seeded the
        # colocated engines' CUDA generator (their dropout) for the rest of the run.
        devices = [self.device] if torch.device(self.device).type == "cuda" else []
        routers = routers_of(self.model, "the hf rollout") if sampling.record_routed_experts else []
        with torch.random.fork_rng(devices=devices), recording_routes(routers) as calls:
            torch.manual_seed(sampling.seed)
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=self._generation_config(sampling),
            )
        sampled = output.sequences[:, width:]
        # NOTE: truncated sampling draws from the processed scores (tempered, top-k/top-p/min-p removed as -inf),
        # so their log-softmax is the distribution sampled from; otherwise the raw logits at the temperature
        # give exactly the actor's values.
        if sampling.truncates and sampling.temperature > 0:
            log_probs = sampled_log_probs(output.scores, sampled, 1.0).cpu()
        else:
            log_probs = sampled_log_probs(output.logits, sampled, sampling.temperature or 1.0).cpu()
        del output  # the per-step logits
        tokens = sampled.cpu()
        lengths = response_lengths(tokens, (*self._eos_ids, *sampling.stop_token_ids))
        if routers:
            prompt_lengths = [len(prompt) for prompt in prompts for _ in range(sampling.n)]
            self._routes = sequence_routes(calls, prompt_lengths, lengths, width)
        kept = torch.arange(tokens.shape[1]) < torch.tensor(lengths)[:, None]
        return list(tokens[kept].split(lengths)), list(log_probs[kept].split(lengths))

    def _take_routed_experts(self) -> list[torch.Tensor]:
        routes, self._routes = self._routes, []
        return routes

    def _generation_config(self, sampling: SamplingConfig) -> Any:
        from transformers import GenerationConfig

        sample = sampling.temperature > 0
        return GenerationConfig(
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_k=sampling.top_k if sample else None,
            top_p=sampling.top_p if sample else None,
            min_p=(sampling.min_p or None) if sample else None,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self._pad_id,
            eos_token_id=list(dict.fromkeys((*self._eos_ids, *sampling.stop_token_ids))) or None,
            return_dict_in_generate=True,
            output_logits=True,
            output_scores=sampling.truncates,
        )

    def _sleep(self) -> None:
        # NOTE: on CPU nothing is worth freeing (generate keeps no cache between calls); on an accelerator the
        # weights go to host memory so training can use the device.
        if self.device != "cpu":
            self.model.to("cpu")
            self._weights.move_base("cpu")
            torch.cuda.empty_cache()

    def _wake(self) -> None:
        if self.device != "cpu":
            self.model.to(self.device)
            self._weights.move_base(self.device)


def response_lengths(tokens: torch.Tensor, end_ids: Sequence[int]) -> list[int]:
    """Each row's tokens up to and including its first of ``end_ids`` (the whole row when it has none)."""
    if tokens.shape[1] == 0:
        return [0] * len(tokens)
    ends = torch.isin(tokens, torch.tensor(end_ids, dtype=tokens.dtype))
    first = ends.int().argmax(dim=1) + 1  # argmax: the first maximum, i.e. the first end
    return torch.where(ends.any(dim=1), first, tokens.shape[1]).tolist()


def sampled_log_probs(
    step_logits: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``(rows, steps)`` log-probs of the sampled ``tokens`` under the per-step logits at ``temperature``.

    NOTE: one step at a time on the logits' device: stacking every step's logits and taking the log-softmax
    of the whole in float32 on the host made about three host copies of ``rows x steps x vocab`` floats (some
    300 GB at 512 rows, 1,024 steps and a 152k vocabulary) beside a stacked one on the device.
    """
    return torch.stack(
        [
            torch.log_softmax(step.float() / temperature, dim=-1).gather(-1, tokens[:, t, None]).squeeze(-1)
            for t, step in enumerate(step_logits)
        ],
        dim=1,
    )
