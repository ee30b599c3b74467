"""The separate placement: a trainer in this Python (the workspace environment, with its own torch) drives a vLLM
server in the vLLM environment's Python (``$DRIVETRAIN_VLLM_PYTHON``, else the checkout's ``.venv-vllm``, built by
scripts/make-env); skipped where neither exists, and in the vLLM environment itself (its colocated tests cover
it there). Two servers, started side by side, serve the module's tests in order (the second on TCP at 127.0.0.1,
as a server on another node listens: :mod:`drivetrain_rollout_vllm.transport`): the function tests hand one
increasing versions, core's rollout conformance kit then takes both in turn (each of its fresh rollouts a new
trainer-side rollout on a server reset to the checkpoint: a reload, not a ten-second start), a three-step
``drivetrain grpo`` of the embedded chat task runs on its own server (as do vLLM's weight-transfer protocol and
multi-turn calculator episodes, each on a server of its own), and the last two tests kill one server each."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core._handoff import SentVersions
from drivetrain_engine_core.backend import ConfigError, EngineStateError
from drivetrain_engine_core.job import create_rollout
from drivetrain_engine_core.rollout import HandoffError, SamplingConfig
from drivetrain_engine_core.testing.policies import (
    actor_log_probs,
    base_state,
    moved,
    save_policy,
    stream,
)
from drivetrain_engine_core.testing.rollout_conformance import RolloutConformanceTests
from drivetrain_rollout_vllm import RequestDeadline, VLLMServerOptions, VLLMServerRollout
from drivetrain_rollout_vllm.launch import ServerCommand
from drivetrain_rollout_vllm.process import PYTHON_VARIABLE, ServerProcess
from drivetrain_rollout_vllm.wire import PROTOCOL, RolloutServerError

CHECKOUT_VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
VLLM_PYTHON = os.environ.get(PYTHON_VARIABLE) or str(CHECKOUT_VLLM_PYTHON)
if importlib.util.find_spec("vllm") is not None:
    pytest.skip(
        "the trainer side runs in the workspace environment (vLLM's own has the colocated tests)",
        allow_module_level=True,
    )
if not Path(VLLM_PYTHON).is_file():
    pytest.skip(
        f"no vLLM environment ({VLLM_PYTHON}); build it with scripts/make-env", allow_module_level=True
    )

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13]]
SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, seed=3)
DEADLINE_SECONDS = 60
# The servers' options: vLLM's context cut from the model's 512 positions (the test below sees it taken; the kit's
# long prompt still fits), a fixed request timeout instead of the derived one, and vLLM's LoRA support (the kit's
# adapter streams).
OPTIONS = VLLMServerOptions(max_model_len=448, request_timeout_s=300, enable_lora=True, max_lora_rank=8)


@pytest.fixture(scope="module")
def states(servable_model_dir):
    first = moved(base_state(servable_model_dir), seed=1)
    second = moved(first, seed=2)
    return {1: first, 2: second, 3: moved(second, seed=3)}


def on_tcp(model_dir):
    """A rollout on a server of its own listening on TCP at 127.0.0.1 (closed by closing its server)."""
    launch = functools.partial(ServerCommand.start, host="127.0.0.1")
    server = ServerProcess.start(python=VLLM_PYTHON, model_path=str(model_dir), device="cpu", launch=launch)
    return VLLMServerRollout(model_path=str(model_dir), server=server, options=OPTIONS)


@pytest.fixture(scope="module")
def servers(servable_model_dir):
    """Two servers, started side by side (each start is mostly waiting): the module's, and one to kill (on TCP)."""
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(2) as pool:
        patch.setenv(PYTHON_VARIABLE, VLLM_PYTHON)
        unix = pool.submit(create_rollout, "vllm-server", model_path=str(servable_model_dir), options=OPTIONS)
        tcp = pool.submit(on_tcp, servable_model_dir)
        started = [unix.result(), tcp.result()]
    assert isinstance(started[1].server.process.address(), tuple)
    yield started
    for served in started:
        served.close()
        served.server.close()
        shutil.rmtree(served.server.log.parent, ignore_errors=True)  # the killed ones' logs are kept


@pytest.fixture(scope="module")
def rollout(servers):
    return servers[0]


def assert_actor_log_probs(rollout, policy_dir):
    output = rollout.generate(PROMPTS, SAMPLED)
    expected = actor_log_probs(policy_dir, PROMPTS, output, SAMPLED.temperature)
    for rolled, actor in zip(output.log_probs, expected, strict=True):
        torch.testing.assert_close(rolled, actor, atol=1e-5, rtol=0)
    return output


def test_the_server_runs_its_own_torch_and_samples_as_hf(rollout, servable_model_dir):
    assert rollout.versions["torch"] != torch.__version__  # two environments, two torch builds
    assert rollout.weights_version is None
    assert_actor_log_probs(rollout, servable_model_dir)


def test_the_servers_vllm_runs_with_the_rollouts_options(rollout, servers, servable_model_dir):
    assert rollout.deadline == RequestDeadline(fixed_seconds=300.0)
    with pytest.raises(RolloutServerError, match="maximum context length is 448 tokens"):
        rollout.generate([[1] * 450], SamplingConfig(max_new_tokens=1))
    # vLLM takes its options at start: a rollout asking for others is refused the running server.
    with pytest.raises(ConfigError, match=r"this vLLM server started with VLLMOptions\(.*max_model_len=448"):
        VLLMServerRollout(model_path=str(servable_model_dir), server=servers[1].server)


def test_a_new_version_is_served_with_the_updated_models_log_probs(
    rollout, states, servable_model_dir, tmp_path
):
    assert rollout.update_weights(stream(SentVersions(), states[1], 1)) == 1
    assert rollout.last_sync.verified and rollout.last_sync.bytes_sent > 0
    output = assert_actor_log_probs(rollout, save_policy(servable_model_dir, states[1], tmp_path / "v1"))
    assert output.version == 1
    served = rollout.served_weights(sorted(states[1]))
    assert all(torch.equal(served[name], tensor) for name, tensor in states[1].items())


def corrupting(monkeypatch, *, index: int, times: int) -> list[int]:
    """Make the client's send path flip a byte of bucket ``index`` the first ``times`` times it is sent (after
    the sender took the digests: what a faulty transport does); returns the indices of the buckets sent."""
    from drivetrain_rollout_vllm import client

    sent, real = [], client.bucket_bytes

    def send(bucket):
        sent.append(bucket.index)
        raw = bytearray(real(bucket))
        if bucket.index == index and sent.count(index) <= times:
            raw[0] ^= 0x40
        return memoryview(raw)

    monkeypatch.setattr(client, "bucket_bytes", send)
    return sent


def test_a_bucket_corrupted_in_transport_every_time_is_refused_after_resends(rollout, states, monkeypatch):
    from drivetrain_rollout_vllm.client import RESENDS

    sent = corrupting(monkeypatch, index=0, times=RESENDS + 1)
    buckets = stream(SentVersions(), states[2], 2)
    with pytest.raises(HandoffError) as error:
        rollout.update_weights(buckets)
    assert str(error.value).startswith(
        f"weight bucket 0 of version 2: {buckets[0].specs[0].name} arrived with other bytes than were sent (its "
        "digest differs): the transport corrupted it. Nothing of this bucket was applied; send version 2 again. It "
        f"was sent {RESENDS + 1} times and arrived corrupted every time"
    )
    assert sent == [0] * (RESENDS + 1)  # that bucket only, then the stream failed
    assert_the_server_still_holds(rollout, states[1])


def assert_the_server_still_holds(rollout, state):
    """The refused stream reached nothing vLLM computes with (its first bucket was refused); the trainer's side
    refuses to generate until a complete version arrives (core's contract after a failed stream)."""
    served = rollout.served_weights(sorted(state))
    assert all(torch.equal(served[name], tensor) for name, tensor in state.items())
    with pytest.raises(EngineStateError, match="partial or wrong"):
        rollout.generate(PROMPTS, SAMPLED)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            lambda s: {**s, "model.layers.0.mlp.up_prog.weight": s.pop("model.layers.0.mlp.up_proj.weight")},
            r"holds 'model.layers.0.mlp.up_prog.weight', which the served model does not have \(closest: "
            r"'model.layers.0.mlp.up_proj.weight'\)",
        ),
        (
            lambda s: {**s, "model.norm.weight": s["model.norm.weight"][:-1]},
            r"sends model.norm.weight with shape \(127,\), the served model's is \(128,\)",
        ),
        (
            lambda s: {**s, "model.norm.weight": s["model.norm.weight"].long()},
            "sends model.norm.weight as torch.int64, the served model holds it as F32",
        ),
    ],
    ids=["name", "shape", "dtype"],
)
def test_an_incompatible_stream_is_refused_naming_what_differs(rollout, states, change, error):
    incompatible = change(dict(states[2]))
    # The refused tensor comes late in the stream: the server's vLLM loaded the layers of the buckets before it.
    with pytest.raises(HandoffError, match=error) as refused:
        rollout.update_weights(stream(SentVersions(), incompatible, 2))
    assert "were already loaded from this stream" in str(refused.value)
    assert str(refused.value).endswith("refuses to generate until a complete version arrives.")
    with pytest.raises(EngineStateError, match="partial or wrong"):
        rollout.generate(PROMPTS, SAMPLED)


def test_a_trainer_of_another_protocol_is_refused_naming_both(rollout):
    with pytest.raises(
        HandoffError, match=f"speaks weight-stream protocol {PROTOCOL + 1}, this vLLM server's"
    ):
        rollout.server.call("start", PROTOCOL + 1, "9.9.9", what="starting vLLM", seconds=60)


def test_after_refusals_a_complete_version_is_served(rollout, states, servable_model_dir, tmp_path):
    assert rollout.update_weights(stream(SentVersions(), states[2], 2)) == 2
    assert_actor_log_probs(rollout, save_policy(servable_model_dir, states[2], tmp_path / "v2"))


def test_a_bucket_corrupted_in_transport_once_is_sent_again_and_the_version_served(
    rollout, states, servable_model_dir, tmp_path, monkeypatch
):
    buckets = stream(SentVersions(), states[3], 3)
    sent = corrupting(monkeypatch, index=1, times=1)
    assert rollout.update_weights(buckets) == 3
    assert sent == [0, 1, 1, *range(2, len(buckets))]  # bucket 1 twice: refused on arrival, then taken
    served = rollout.served_weights(sorted(states[3]))
    assert all(torch.equal(served[name], tensor) for name, tensor in states[3].items())
    assert_actor_log_probs(rollout, save_policy(servable_model_dir, states[3], tmp_path / "v3"))


def test_a_server_of_another_model_is_not_shared(servers, tmp_path):
    with pytest.raises(ConfigError, match=r"serves .* on cpu, not .* on cpu; start a server for that model"):
        VLLMServerRollout(model_path=str(tmp_path), server=servers[1].server)


class TestVLLMServerConformance(RolloutConformanceTests):
    """Core's kit on ``vllm-server``, verification reading back the server's vLLM weights."""

    rollout_name = "vllm-server"
    keeps_adapter_version_after_failure = True  # adapter versions are added whole

    @pytest.fixture(scope="class")
    def model_dir(self, servable_model_dir):
        return servable_model_dir

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _shared(cls, servers):
        # In turn: a test that compares two fresh rollouts gets one on each server.
        cls.turns = itertools.cycle([served.server for served in servers])

    def rollout_factory(self, model_dir, *, verify):
        return VLLMServerRollout(
            model_path=str(model_dir), verify=verify, server=next(self.turns), options=OPTIONS
        )


def test_an_adapter_version_is_served_on_the_server_as_peft_does(servers, servable_model_dir):
    """An adapter-only stream of a LoRA engine to the server: verified by reading the server's adapter back
    (lora_B against what arrived times alpha / rank = 3, bit for bit), sampled as transformers + PEFT sample with
    the base model and the engine's adapters."""
    peft = pytest.importorskip("peft")
    from drivetrain_engine_core.backend import LoraConfig, ModelConfig, OptimizerConfig
    from drivetrain_engine_core.job import create_engine, engine_config_from_dict
    from drivetrain_engine_core.rollout import VerifyConfig
    from drivetrain_engine_core.testing import random_batch, token_mean_nll
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(rank=4, alpha=12.0, target_modules=("q_proj", "v_proj", "up_proj"))
    engine = create_engine(
        model_config=ModelConfig(path=str(servable_model_dir), lora=lora),
        engine_config=engine_config_from_dict({"backend": "fsdp", "device": "cpu"}),
        optimizer_config=OptimizerConfig(lr=5e-2),
    )
    engine.initialize()
    with engine.train_mode():
        batch = random_batch(vocab_size=20, prompt_lengths=[3], response_lengths=[4], seed=0)
        engine.train_batch(batch, token_mean_nll)
    buckets = list(engine.weight_buckets(version=1, bucket_bytes=1024, lora="adapter"))
    served = VLLMServerRollout(
        model_path=str(servable_model_dir),
        verify=VerifyConfig(mode="every"),
        server=servers[0].server,
        options=OPTIONS,
    )
    assert served.update_weights(buckets) == 1 and served.last_sync.verified
    output = served.generate(PROMPTS, SAMPLED)
    base = AutoModelForCausalLM.from_pretrained(servable_model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=12.0, target_modules=list(lora.target_modules))
    model = peft.get_peft_model(base, config)
    peft.set_peft_model_state_dict(model, {n: t for b in buckets for n, t in b.tensors()})
    for index, (response, rolled) in enumerate(zip(output.responses, output.log_probs, strict=True)):
        prompt = PROMPTS[index // output.n]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response.tolist()])).logits[0, len(prompt) - 1 : -1] / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)
        torch.testing.assert_close(rolled, expected, atol=1e-5, rtol=0)


def test_an_update_through_vllms_protocol_on_the_server_serves_the_weights_sent(
    servable_model_dir, states, tmp_path, monkeypatch
):
    """``weight_transfer=vllm`` on a server of its own: the server's vLLM takes each version through its own
    update window (start/update/finish); the weights served equal those sent, byte for byte and in log-probs."""
    monkeypatch.setenv(PYTHON_VARIABLE, VLLM_PYTHON)
    options = VLLMServerOptions(max_model_len=448, request_timeout_s=300, weight_transfer="vllm")
    rollout, sender = (
        create_rollout("vllm-server", model_path=str(servable_model_dir), options=options),
        SentVersions(),
    )
    try:
        # vLLM's own factory built drivetrain's transfer engine in the server's worker (vLLM's log line).
        assert (
            "Creating weight transfer engine: DrivetrainWeightTransferEngine"
            in rollout.server.log.read_text()
        )
        assert rollout.delta_base is None  # vLLM reloads the whole model each version
        for version in (1, 2):
            assert rollout.update_weights(stream(sender, states[version], version)) == version
            policy = save_policy(servable_model_dir, states[version], tmp_path / f"v{version}")
            assert assert_actor_log_probs(rollout, policy).version == version
            served = rollout.served_weights(sorted(states[version]))
            assert all(torch.equal(served[name], tensor) for name, tensor in states[version].items())
        delta = stream(sender, states[3], 3, base_version=2)
        with pytest.raises(HandoffError, match=r"as a delta on version 2.*weight_transfer=drivetrain"):
            rollout.update_weights(delta)
        assert rollout.weights_version == 2
    finally:
        rollout.close()


def test_episodes_on_a_server_keep_the_sampled_tokens_at_a_plain_forwards_log_probs(
    tmp_path, monkeypatch, max_gap
):
    """Multi-turn episodes in the ``calculator`` environment sampled by a server (its own: another model): the
    calculator task's model leaning towards ``<tool_call>`` and ``<|im_end|>`` calls the tool wrongly, so every
    turn is answered by a tool message (context, loss mask 0) and episodes run several turns on prompts of about
    110 tokens that four episodes share. Each model token's log-prob from the server equals a plain HF forward
    of the whole episode, and the tokens between the turns are the chat template's rendering of the replies."""
    import json

    from drivetrain_engine_core.job import environment_factory
    from drivetrain_engine_core.testing import lean_model_dir
    from drivetrain_roles.jobs.calculator_task import (
        build_calculator_tokenizer,
        write_calculator_data,
        write_calculator_model,
    )
    from drivetrain_roles.rollout.multi_turn import run_episodes
    from drivetrain_roles.rollout.trajectory import trajectory_batch
    from drivetrain_roles.rollout.turn_limits import TurnLimits
    from transformers import AutoModelForCausalLM

    tokenizer = build_calculator_tokenizer()
    model_dir = lean_model_dir(
        write_calculator_model(tmp_path / "model"), tokenizer, {"<tool_call>": 1.0, "<|im_end|>": 0.75}
    )
    train, _ = write_calculator_data(tmp_path / "data", train_size=2, val_size=2, seed=0)
    examples = [json.loads(line) for line in train.read_text().splitlines()]
    monkeypatch.setenv(PYTHON_VARIABLE, VLLM_PYTHON)
    rollout = create_rollout(
        "vllm-server", model_path=str(model_dir), options=VLLMServerOptions(max_model_len=448)
    )
    try:
        sampling = SamplingConfig(
            n=4,
            temperature=1.0,
            max_new_tokens=24,
            seed=3,
            stop_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),),
        )
        limits = TurnLimits(max_turns=3, max_total_tokens=400)
        trajectories = run_episodes(
            rollout, tokenizer, environment_factory("calculator"), examples, sampling, limits
        )
    finally:
        rollout.close()
    assert len(trajectories) == 8 and all(t.prompt_length > 100 for t in trajectories)
    assert sum(t.num_turns - 1 for t in trajectories) >= 4  # turns sampled on grown prompts
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gap = max_gap(model, trajectory_batch(trajectories))
    for trajectory in trajectories:
        assert int(trajectory.loss_mask.sum()) == sum(stop - start for start, stop in trajectory.turn_spans)
        for (_, stop), (start, _) in pairwise(trajectory.turn_spans):
            between = tokenizer.decode(trajectory.input_ids[stop:start])
            assert between.startswith("\n<|im_start|>") and "<|im_start|>assistant" in between, between
    print(f"server episodes: {sum(t.num_turns for t in trajectories)} turns, largest log-prob gap {gap:.2g}")
    assert gap <= 1e-5, gap


def test_grpo_trains_on_a_vllm_server(chat_task_beside, chat_task_steps):
    """Three steps of ``drivetrain grpo model.path=builtin:multistep rollout.name=vllm-server`` from this
    environment: the first hand-off is the whole model (verified against its digests, read back from the server's
    vLLM), the next a delta that changes it; the task's prompts share a 368-token system prefix (over two KV
    blocks) and come back every step, and the server's log-probs stay the actor's (its prefix cache keeps no KV of
    the old weights); the run checkpoints."""
    run = chat_task_beside
    steps = chat_task_steps(run)
    model_bytes = sum(
        t.numel() * t.element_size() for t in base_state(run / "warm_start" / "final_model").values()
    )
    assert (steps[0]["rollout/sync_bytes"], steps[0]["rollout/sync_verified"]) == (model_bytes, 1.0)
    for step in steps:
        assert step["rollout/log_prob_diff_max"] <= 1e-5 and step["rollout/mismatch_kl"] <= 1e-10, step
    assert (run / "checkpoints").is_dir() and (run / "final_model" / "config.json").is_file()


def test_a_server_killed_mid_generation_is_named_at_once(rollout):
    send = rollout.server.connection.send

    def send_then_kill(message):
        send(message)
        os.kill(rollout.server.process.pid, signal.SIGKILL)

    rollout.server.connection.send = send_then_kill
    started = time.monotonic()
    with pytest.raises(
        RolloutServerError, match=r"the vLLM server \(pid \d+, .*\) exited while generating with exit code -9"
    ):
        rollout.generate(PROMPTS, SAMPLED)
    assert time.monotonic() - started < DEADLINE_SECONDS


def test_a_server_killed_mid_update_is_named_at_once(servers, states, servable_model_dir):
    # A rollout of its own on the second server: attaching resets the server to the checkpoint, whatever the
    # tests before left it serving (the kit's adapter versions, say).
    rollout = VLLMServerRollout(model_path=str(servable_model_dir), server=servers[1].server, options=OPTIONS)

    def buckets():
        for bucket in stream(SentVersions(), states[1], 1):
            if bucket.index == 1:
                os.kill(rollout.server.process.pid, signal.SIGKILL)
            yield bucket

    started = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"while receiving bucket 1 of version 1"):
        rollout.update_weights(buckets())
    assert time.monotonic() - started < DEADLINE_SECONDS
    assert rollout.weights_version is None
    with pytest.raises(EngineStateError, match="failed midway"):
        rollout.generate(PROMPTS, SAMPLED)
