"""The TRL half of ``trl_comparison.py``, and the held-out scoring both halves share.

Run by the comparison in a subprocess (so that its CPU time is measured alone):

    python benchmarks/trl_worker.py train SPEC_JSON   # one TRL run, the trained model saved to spec["out"]
    python benchmarks/trl_worker.py score SPEC_JSON   # held-out metrics of model folders, JSON on stdout

``train`` reads the model and data a drivetrain run of the same case wrote (``<run>/initial_model`` or
``<run>/warm_start/final_model``, ``<run>/data/*.jsonl``), so both trainers start from the same weights on the
same examples, tokenised by drivetrain's own loader (SFT) or by TRL from the same text (DPO, GRPO). Needs
``trl`` (see benchmarks/README.md for the separate environment); ``score`` needs only transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def _examples(run: Path, split: str, model: Path) -> list[Any]:
    """drivetrain's tokenised examples of ``<run>/data/<split>.jsonl`` (the same token ids drivetrain trains on)."""
    from drivetrain_roles.command_sections import DataConfig
    from drivetrain_roles.jobs.assets import load_tokenizer
    from drivetrain_roles.jobs.data import load_examples

    tokenizer = load_tokenizer(str(model))
    return load_examples([run / "data" / f"{split}.jsonl"], tokenizer, DataConfig(max_length=4096))


def _common(spec: dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments both trainers share with drivetrain's run of the case."""
    return {
        "output_dir": spec["out"],
        "max_steps": spec["steps"],
        "learning_rate": spec["lr"],
        "warmup_steps": spec["warmup"],
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "logging_steps": max(1, spec["steps"]),
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": spec.get("seed", 0),
        "bf16": False,
    }


def train(spec: dict[str, Any]) -> None:
    """One TRL run of ``spec["kind"]`` (sft, dpo or grpo); saves the model to ``spec["out"]``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # as drivetrain's trainer.cpu_threads=1
    run, model_dir = Path(spec["run"]), Path(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kind = spec["kind"]
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        rows = [
            {"input_ids": e.token_ids, "completion_mask": [0] * len(e.prompt_ids) + [1] * len(e.response_ids)}
            for e in _examples(run, "train", model_dir)
        ]
        args = SFTConfig(
            **_common(spec),
            per_device_train_batch_size=spec["batch"],
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1},
            completion_only_loss=True,
            padding_free=spec.get("padding_free", False),
            max_length=None,
        )
        trainer: Any = SFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
        )
    elif kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        rows = [json.loads(line) for line in (run / "data" / "train.jsonl").read_text().splitlines()]
        args = DPOConfig(
            **_common(spec),
            per_device_train_batch_size=spec["batch"],
            lr_scheduler_type="constant_with_warmup",
            beta=spec["beta"],
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            disable_dropout=True,
        )
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
        )
    else:
        trainer = _grpo(spec, model, tokenizer, run)
    trainer.train()
    trainer.save_model(spec["out"])


def _grpo(spec: dict[str, Any], model: Any, tokenizer: Any, run: Path) -> Any:
    """TRL's GRPOTrainer on drivetrain's GRPO step: ``prompts`` x ``n`` samples per generation, updated in
    ``mini_batches`` optimizer steps (TRL's ``steps_per_generation``), k3 KL to the start model at ``beta``.

    Optional keys: ``reward`` (``exact_match``, the default, or ``checksum``: ``grpo_generation_reward.py``'s),
    ``vllm`` (generate with vLLM colocated, TRL's ``vllm_mode="colocate"``, instead of ``model.generate``) and
    ``timings`` (a path: each generation's seconds and each optimizer step's end, see :class:`_StepClock`)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in (run / "data" / "train.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["response"]} for r in rows])

    def exact_match(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    reward = exact_match
    if spec.get("reward") == "checksum":
        sys.path.insert(0, str(Path(__file__).parent))
        from grpo_generation_reward import checksum_reward as reward  # TRL passes completion_ids too

    samples = spec["prompts"] * spec["n"]
    vllm = {"use_vllm": True, "vllm_mode": "colocate"} if spec.get("vllm") else {}
    args = GRPOConfig(
        **{**_common(spec), "max_steps": spec["steps"] * spec["mini_batches"]},
        per_device_train_batch_size=samples // spec["mini_batches"],
        steps_per_generation=spec["mini_batches"],
        num_generations=spec["n"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=spec["beta"],
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        lr_scheduler_type="constant_with_warmup",
        disable_dropout=True,
        **vllm,
    )
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer
    )
    if spec.get("timings"):
        _StepClock(Path(spec["timings"])).attach(trainer)
    return trainer


class _StepClock:
    """Times a GRPOTrainer's steps for ``grpo_generation_bound.py``: the clock at the first step's start and
    at each optimizer step's end, and each generation's seconds (``_generate_single_turn``: the prompts'
    completions, and with vLLM the weight sync before them) and mean completion length, written to ``path``
    as JSON at the end of training."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record: dict[str, list[float]] = {"step_ends": [], "generation_s": [], "completion_length": []}

    def attach(self, trainer: Any) -> None:
        import time

        from transformers import TrainerCallback

        clock = self
        generate = trainer._generate_single_turn

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            completion_ids, logprobs = generate(*args, **kwargs)
            clock.record["generation_s"].append(time.perf_counter() - started)
            lengths = [len(ids) for ids in completion_ids]
            clock.record["completion_length"].append(sum(lengths) / max(len(lengths), 1))
            return completion_ids, logprobs

        trainer._generate_single_turn = timed_generate

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                clock.record.setdefault("first_step_start", [time.perf_counter()])

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                clock.record["step_ends"].append(time.perf_counter())

            def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                clock.path.write_text(json.dumps(clock.record))

        trainer.add_callback(Callback())


@torch.no_grad()
def score(spec: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Held-out metrics of each model folder in ``spec["models"]`` on ``spec["run"]``'s held-out split, the same
    plain Hugging Face computation for drivetrain's and TRL's models: greedy exact-match accuracy and the mean
    response-token loss (SFT, GRPO); for DPO also the preference accuracy against ``spec["reference"]``."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    run, scores = Path(spec["run"]), {}
    reference = spec.get("reference")
    for name, folder in spec["models"].items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if spec["kind"] == "dpo":
            ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
            scores[name] = {"val/preference_accuracy": _preference_accuracy(model, ref, run, Path(folder))}
            continue
        examples = _examples(run, "val", Path(folder))[: spec.get("limit", 200)]
        scores[name] = {
            "val/accuracy": _greedy_accuracy(model, examples, spec.get("max_new_tokens", 8)),
            "val/loss": _response_loss(model, examples),
        }
    return scores


def _response_logp(model: Any, prompt: list[int], response: list[int]) -> tuple[float, int]:
    """Sum of the response tokens' log-probabilities after ``prompt``, and their number."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    picked = logp.gather(-1, targets[:, None])[:, 0][len(prompt) - 1 :]
    return float(picked.sum()), len(response)


def _response_loss(model: Any, examples: list[Any]) -> float:
    total, count = 0.0, 0
    for e in examples:
        logp, n = _response_logp(model, e.prompt_ids, e.response_ids)
        total, count = total - logp, count + n
    return total / max(count, 1)


def _greedy_accuracy(model: Any, examples: list[Any], max_new_tokens: int) -> float:
    eos = model.config.eos_token_id
    hits = 0
    for e in examples:
        out = model.generate(
            torch.tensor([e.prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        hits += out[0, len(e.prompt_ids) :].tolist()[: len(e.response_ids)] == e.response_ids
    return hits / max(len(examples), 1)


def _preference_accuracy(model: Any, ref: Any, run: Path, folder: Path) -> float:
    """Fraction of held-out pairs whose implicit DPO reward margin is positive (``rewards/accuracies``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in (run / "data" / "val.jsonl").read_text().splitlines()]
    wins = 0
    for r in rows:
        prompt = tokenizer(r["prompt"])["input_ids"]
        sides = [
            tokenizer(r["prompt"] + r[k] + tokenizer.eos_token)["input_ids"][len(prompt) :]
            for k in ("chosen", "rejected")
        ]
        margin = [_response_logp(model, prompt, s)[0] - _response_logp(ref, prompt, s)[0] for s in sides]
        wins += margin[0] > margin[1]
    return wins / max(len(rows), 1)


if __name__ == "__main__":
    mode, spec_json = sys.argv[1], sys.argv[2]
    spec = json.loads(spec_json)
    if mode == "train":
        train(spec)
    else:
        print(json.dumps(score(spec)))
