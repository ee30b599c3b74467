"""What the roles tests share: a local Ray cluster, real ``drivetrain`` launches, the arithmetic prompts the RL
tests sample from, the small ``grpo``/``ppo`` config their parity tests run on, the tiny ``drivetrain grpo`` job
the launch tests compare with its run on one node of two ranks, a run folder's state entry for entry, and the
multi-turn tests' tool-template tokenizer, the tiny model that leans towards ``i``, ``s`` and ``<|im_end|>``
and the scripted ``grpo`` job in the ``calculator`` environment that trains it.

NOTE: the helpers are fixtures because under ``--import-mode=importlib`` a test module can import neither
conftest nor a sibling module.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from drivetrain_engine_core.rollout import Rollout, VerifyConfig
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
def tiny_grpo_two_ranks(
    tiny_grpo_job: list[str], launches: Launches, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The run folder of :func:`tiny_grpo_job` on one node of two ranks (``--nproc 2``): the reference of the
    launches over several nodes, run once for every test that compares with it."""
    run = tmp_path_factory.mktemp("torchrun") / "run"
    done = launches.run("grpo", "--output-dir", str(run), *tiny_grpo_job, nproc=2)
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


DRIVETRAIN = Path(sys.executable).parent / "drivetrain"
"""The ``drivetrain`` console script of the environment the tests run in."""

TINY_SFT = (
    "data.generated_train_size=32",
    "data.generated_val_size=4",
    "trainer.batch_size=8",
    "trainer.eval_samples=4",
    "trainer.eval_every=0",
    "trainer.max_new_tokens=2",
    "trainer.progress_bar=false",
)
"""A tiny run of the embedded ``sft`` job: 32 generated examples in batches of 8, no held-out evaluation."""


@dataclass(frozen=True)
class Launches:
    """Real ``drivetrain`` launches in child processes (``--nproc`` ranks, ``--nnodes`` nodes on loopback,
    ``trainer.placement=ray``): their command line, and the process that runs one."""

    executable: Path = DRIVETRAIN
    tiny_sft: tuple[str, ...] = TINY_SFT

    def line(self, command: str, *arguments: str, nproc: int | None = None) -> list[str]:
        """``drivetrain <command> [--nproc N] <arguments>`` (launch flags, ``--output-dir``, overrides)."""
        ranks = ["--nproc", str(nproc)] if nproc is not None else []
        return [str(self.executable), command, *ranks, *arguments]

    def run(
        self,
        command: str,
        *arguments: str,
        nproc: int | None = None,
        cwd: Path | None = None,
        timeout_s: int = 300,
    ) -> subprocess.CompletedProcess[str]:
        """Run :meth:`line` to its end: its status and its output as text."""
        return subprocess.run(
            self.line(command, *arguments, nproc=nproc),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def start(
        self,
        command: str,
        *arguments: str,
        nproc: int | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start :meth:`line` in a session of its own (as a terminal's foreground job is in its own process
        group, what Ctrl-C reaches: ``os.killpg(process.pid, SIGINT)``), its output piped as text."""
        return subprocess.Popen(
            self.line(command, *arguments, nproc=nproc),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    @staticmethod
    def finish(process: subprocess.Popen[str], timeout_s: int = 120) -> tuple[int, str]:
        """The status and stderr of a :meth:`start` ed launch within ``timeout_s``; its process group is killed if
        it has not ended by then (or the wait is interrupted), so that no launch outlives its test."""
        try:
            _, err = process.communicate(timeout=timeout_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
        return process.returncode, err


@pytest.fixture(scope="session")
def launches() -> Launches:
    """The :class:`Launches` helper: ``launches.line/run/start("sft", "--output-dir", run, *launches.tiny_sft,
    nproc=2)``, ``launches.finish(process)``."""
    return Launches()


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
    """The tiny Qwen2 with :func:`tool_tokenizer` saved beside it, leaning (:func:`lean_model_dir`) towards ``i``,
    ``s`` and ``<|im_end|>`` whatever the context (turns end, and hold ``i``, ``s`` that the tokenizer would
    re-encode as ``is``). 1024 positions hold an episode of 700 tokens."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("agent"), arch="qwen2", max_position_embeddings=1024)
    # NOTE: imported here, not at the top: the conftest also serves the kits run against core's floor (0.3.1),
    # which has no lean_model_dir.
    from drivetrain_engine_core.testing import lean_model_dir

    lean_model_dir(path, tool_tokenizer, {"i": 0.9, "s": 0.9, IM_END: 0.75})
    tool_tokenizer.save_pretrained(path)
    return path


CALCULATOR_GRPO = (
    "algorithm.kl_loss_coef=0",
    "algorithm.ppo_mini_batches=1",
    "environment.name=calculator",
    "environment.max_turns=3",
    "environment.max_total_tokens=1000",
    "rollout.n=2",
    "rollout.max_new_tokens=120",
    "trainer.total_steps=2",
    "trainer.eval_every=0",
    "trainer.eval_samples=2",
    "trainer.save_every=0",
    "trainer.progress_bar=false",
)
"""Two ``grpo`` steps in the ``calculator`` environment (3 turns of 120 tokens), each question played twice, two
held-out questions evaluated before the first step and after the last; no KL term, one mini-batch, no saves."""

Plays = Mapping[str, tuple[int, str]]
"""Each question's expression: the calculator calls its episode makes before the answer, and the answer."""


def _calculator_play(plays: Plays, context: str) -> str:
    """Call the calculator until the question's number of calls is reached, then answer as ``plays`` says."""
    expression = re.search(r"What is (\S+)\?", context).group(1)  # type: ignore[union-attr]
    calls, answer = plays[expression]
    if context.count("<tool_response>") < calls:
        return (
            f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        )
    return answer


@pytest.fixture(scope="module")
def calculator_grpo(
    leaning_model_dir: Path, tool_tokenizer: Any, scripted_rollout: Callable[..., Rollout]
) -> Callable[..., list[dict[str, Any]]]:
    """``records = calculator_grpo(folder, plays, *overrides)``: ``drivetrain grpo`` of :data:`CALCULATOR_GRPO`
    (``overrides`` on top: the data and rewards) training :func:`leaning_model_dir` in ``folder / "run"``, every
    turn played by a scripted rollout as :data:`Plays` ``plays`` says; the run's metric records."""

    def run(folder: Path, plays: Plays, *overrides: str) -> list[dict[str, Any]]:
        from drivetrain_roles.grpo.config import load_config
        from drivetrain_roles.grpo.trainer import GRPOTrainer
        from drivetrain_roles.jobs.metrics import read_records
        from drivetrain_roles.rl import policy_trainer

        config = load_config(None, [f"model.path={leaning_model_dir}", *CALCULATOR_GRPO, *overrides])
        rollout = scripted_rollout(tool_tokenizer, functools.partial(_calculator_play, plays))
        rollout.verify = VerifyConfig(mode="never")  # it serves no weights to read back
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(policy_trainer, "build_rollout", lambda *args: rollout)
            GRPOTrainer(config, folder / "run").run()
        return read_records(folder / "run" / "metrics.jsonl")

    return run


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
