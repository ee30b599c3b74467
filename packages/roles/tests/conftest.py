"""What the roles tests share: a local Ray cluster, the arithmetic prompts the RL tests sample from, the small
``grpo``/``ppo`` config their parity tests run on, the tiny ``drivetrain grpo`` job the launch tests compare
with its run on one node of two ranks, a run folder's state entry for entry, and the multi-turn tests'
tool-template tokenizer and the tiny model that leans towards ``i``, ``s`` and ``<|im_end|>``.

NOTE: the helpers are fixtures because under ``--import-mode=importlib`` a test module can import neither
conftest nor a sibling module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from drivetrain_engine_core.rollout import Rollout
from drivetrain_engine_core.testing import make_tiny_model_dir
from drivetrain_engine_core.testing.tokenizer import IM_END, build_tiny_tokenizer
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.jobs.default_assets import arithmetic_examples, write_model_dir

SMALL_RL = (
    "engine.micro_batch.micro_batch_size=3",
    "engine.micro_batch.max_tokens=null",
    "rollout.max_new_tokens=4",
)
"""Micro-batches of 3 sequences (no token budget) and 4 new tokens: small enough for parity tests on one CPU."""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster of 2 CPUs for one test module (skipped without Ray), whatever ``RAY_ADDRESS`` says."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


def _arithmetic_prompts(tokenizer: Any, count: int) -> list[Example]:
    return [
        Example(
            prompt_ids=tokenizer(e["prompt"])["input_ids"],
            response_ids=[],
            prompt_text=e["prompt"],
            response_text=e["response"],
        )
        for e in arithmetic_examples(count, seed=1)
    ]


@pytest.fixture(scope="session")
def arithmetic_prompts() -> Callable[[Any, int], list[Example]]:
    """``prompts(tokenizer, count)``: the first ``count`` arithmetic problems (seed 1) as prompts to sample from,
    the answer as ``response_text`` (what the exact-answer reward compares), no response ids."""
    return _arithmetic_prompts


def _small_rl_config(load_config: Callable[..., Any], model_path: str | Path, *overrides: str) -> Any:
    return load_config(None, [f"model.path={model_path}", *SMALL_RL, *overrides])


@pytest.fixture(scope="session")
def small_rl_config() -> Callable[..., Any]:
    """``config(load_config, model_path, *overrides)``: the config of ``grpo`` or ``ppo`` (the command's
    ``load_config``) for ``model_path`` with :data:`SMALL_RL`'s sizes, ``overrides`` on top."""
    return _small_rl_config


LENGTH_REWARD = """import os
import socket


def length(*, prompts, completions, references):
    # Graded: the completion's length. With DRIVETRAIN_TEST_PLACES set, also leaves rank<RANK> there holding
    # the rank's node in the rendezvous (GROUP_RANK) and its host name: where the rank ran.
    places = os.environ.get("DRIVETRAIN_TEST_PLACES")
    if places:
        with open(os.path.join(places, "rank" + os.environ["RANK"]), "w") as f:
            f.write(os.environ["GROUP_RANK"] + " " + socket.gethostname())
    return [float(len(c)) for c in completions]
"""
GRPO_METRICS = ("train/reward", "train/pg_loss", "train/kl", "train/grad_norm")


@pytest.fixture(scope="session")
def tiny_grpo_job(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The overrides of a 2-step ``drivetrain grpo`` run of the tiny embedded model with graded (length) rewards
    and a KL loss, saved every step: what the launch tests run on two Ray nodes and two torchrun nodes."""
    folder = tmp_path_factory.mktemp("grpo_job")
    write_model_dir(folder / "model", seed=3)
    (folder / "rewards.py").write_text(LENGTH_REWARD)
    return [
        f"model.path={folder / 'model'}",
        "engine.micro_batch.micro_batch_size=4",
        "engine.micro_batch.max_tokens=null",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        f"algorithm.reward_function={folder / 'rewards.py'}:length",
        "algorithm.kl_loss_coef=0.1",
        "optimizer.lr=1e-3",
        "trainer.prompts_per_step=4",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "trainer.cpu_threads=1",
    ]


@pytest.fixture(scope="session")
def tiny_grpo_two_ranks(tiny_grpo_job: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of :func:`tiny_grpo_job` on one node of two ranks (``--nproc 2``): the reference of the
    launches over several nodes, run once for every test that compares with it."""
    run = tmp_path_factory.mktemp("torchrun") / "run"
    drivetrain = Path(sys.executable).parent / "drivetrain"
    done = subprocess.run(
        [str(drivetrain), "grpo", "--nproc", "2", "--output-dir", str(run), *tiny_grpo_job],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def _grpo_steps(run: Path) -> list[dict[str, float]]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if "train/reward" in r]


def _grpo_gaps(run: Path, reference: Path) -> dict[str, float]:
    got, expected = _grpo_steps(run), _grpo_steps(reference)
    assert len(got) == len(expected) == 2 and expected[0]["train/reward"] > 0
    return {
        key: max(abs(a[key] - b[key]) for a, b in zip(got, expected, strict=True)) for key in GRPO_METRICS
    }


@pytest.fixture(scope="session")
def grpo_gaps() -> Callable[[Path, Path], dict[str, float]]:
    """``gaps(run, reference)``: the largest gap over both steps of :func:`tiny_grpo_job` between two runs'
    reward, policy loss, KL and gradient norm, by metric."""
    return _grpo_gaps


FolderState = dict[str, tuple[int, int, int, bytes | str | None]]


def _folder_state(run: Path) -> FolderState:
    """Every entry under ``run``: its mode (kind), size, modification time and bytes (a link: its target)."""
    state = {}
    for path in sorted(run.rglob("*")):
        info = path.lstat()
        content = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else None
        state[str(path.relative_to(run))] = (info.st_mode, info.st_size, info.st_mtime_ns, content)
    return state


@pytest.fixture(scope="session")
def folder_state() -> Callable[[Path], FolderState]:
    """``state(run)``: every entry of the run folder ``run`` (mode, size, mtime, bytes or link target), what a
    refused ``--resume`` must leave as it was."""
    return _folder_state


def _plotted(curve: Path) -> dict[str, dict[str, Any]]:
    """The series ``curve`` (a run's PNG) holds, by metric, each checked against the run's ``metrics.jsonl``:
    as many points as finite records of that metric, the last the last recorded value."""
    import math

    from drivetrain_roles.jobs.curves import read_curve_series
    from drivetrain_roles.jobs.metrics import read_records

    records = read_records(curve.parent / "metrics.jsonl")
    series = {entry["key"]: entry for entry in read_curve_series(curve)}
    for key, entry in series.items():
        values = [r[key] for r in records if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        assert (entry["points"], entry["last"]) == (len(values), values[-1]), key
    return series


@pytest.fixture(scope="session")
def plotted() -> Callable[[Path], dict[str, dict[str, Any]]]:
    """``plotted(curve)``: ``{metric: {"panel", "key", "label", "points", "last"}}`` of a run's curve PNG, read
    from its metadata (not its pixels) and checked against the run's ``metrics.jsonl``."""
    return _plotted


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen2.5-style template: tools listed in a system turn, tool results as ``<tool_response>`` user turns."""


@pytest.fixture(scope="module")
def tool_tokenizer() -> Any:
    """The tiny character-level tokenizer (words such as ``is`` are single tokens) with :data:`TOOL_TEMPLATE`."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def leaning_model_dir(tmp_path_factory: pytest.TempPathFactory, tool_tokenizer: Any) -> Path:
    """The tiny Qwen2 with :func:`tool_tokenizer` saved beside it: every hidden state carries a large constant in
    dimension 0, and only ``i``, ``s`` and ``<|im_end|>`` read it, so they are the likely tokens whatever the
    context (turns end, and hold ``i``, ``s`` that the tokenizer would re-encode as ``is``). 1024 positions hold
    an episode of 700 tokens."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(tmp_path_factory.mktemp("agent"), arch="qwen2", max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 30.0
        model.lm_head.weight[:, 0] = 0.0
        for token, weight in {"i": 0.9, "s": 0.9, "<|im_end|>": 0.75}.items():
            model.lm_head.weight[tool_tokenizer.convert_tokens_to_ids(token), 0] = weight
    model.save_pretrained(path)
    tool_tokenizer.save_pretrained(path)
    return path


class _ScriptedRollout(Rollout):
    """Answers each context with ``script(context text)`` and the turn end (``IM_END``); log-probs 0 (nothing is
    sampled)."""

    name = "scripted"

    def __init__(self, tokenizer: Any, script: Callable[[str], str]) -> None:
        super().__init__(model_path="scripted")
        self.tokenizer, self.script = tokenizer, script

    def _generate(self, prompts: Any, sampling: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        texts = [self.script(self.tokenizer.decode(p)) + IM_END for p in prompts for _ in range(sampling.n)]
        ids = [torch.tensor(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        return ids, [torch.zeros(len(i)) for i in ids]

    def _load_bucket(self, bucket: Any) -> None: ...
    def _finish_update(self) -> None: ...
    def _abort_update(self) -> None: ...
    def _served_tensor(self, name: str) -> Any: ...
    def _sleep(self) -> None: ...
    def _wake(self) -> None: ...


@pytest.fixture(scope="session")
def scripted_rollout() -> Callable[[Any, Callable[[str], str]], Rollout]:
    """``scripted_rollout(tokenizer, script)``: a rollout that answers each context with ``script(context text)``
    and the turn end (what the multi-turn tests play episodes with, no model involved)."""
    return _ScriptedRollout
