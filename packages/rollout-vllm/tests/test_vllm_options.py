"""The vLLM rollouts' options (``rollout.options.*``): what they hand vLLM, how core checks them against the
plugin's declaration, and the ``vllm-server`` request timeout they set. No vLLM is needed: the arguments are
compared with the options written out, and the server's side is a recorder of the requests' waits (the real
server's waits are tested in test_vllm_server_deadline.py); runs in either environment in well under a second."""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import rollout_options
from drivetrain_engine_core.rollout import SamplingConfig
from drivetrain_rollout_vllm import RequestDeadline, VLLMOptions, VLLMServerOptions, VLLMServerRollout
from drivetrain_rollout_vllm.deadline import REQUEST_SECONDS_VARIABLE
from drivetrain_rollout_vllm.options import CPU_KV_CACHE_BYTES

GIB = 1 << 30
VLLM_ACCEPTS = (
    "gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None, max_model_len: "
    "int | None = None, max_num_seqs: int | None = None, enforce_eager: bool = True, enable_lora: bool = False, "
    "max_lora_rank: int = 16, max_loras: int | None = None, weight_transfer: str = 'drivetrain'"
)


def test_the_options_are_vllms_arguments_with_the_cpu_kv_cache_unless_memory_is_set(monkeypatch):
    """On CPU also whole prefills (test_vllm_rollout.py shows why)."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert CPU_KV_CACHE_BYTES == GIB
    whole = {"enable_chunked_prefill": False}
    assert VLLMOptions().engine_arguments("cpu") == {
        "enforce_eager": True,
        **whole,
        "kv_cache_memory_bytes": GIB,
    }
    assert VLLMOptions().engine_arguments("cuda") == {"enforce_eager": True}
    set_ = VLLMOptions(gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=64, enforce_eager=False)
    expected = {
        "enforce_eager": False,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 4096,
        "max_num_seqs": 64,
    }
    assert set_.engine_arguments("cpu") == {**set_.engine_arguments("cuda"), **whole} == {**expected, **whole}
    assert VLLMOptions(kv_cache_memory_bytes=GIB // 4).engine_arguments("cuda") == {
        "enforce_eager": True,
        "kv_cache_memory_bytes": GIB // 4,
    }
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own variable sizes the CPU cache then
    assert VLLMOptions().engine_arguments("cpu") == {"enforce_eager": True, **whole}


def test_core_builds_each_rollouts_options_from_plain_values():
    given = {"gpu_memory_utilization": "0.4", "max_model_len": 2048, "enforce_eager": "false"}
    expected = {"gpu_memory_utilization": 0.4, "max_model_len": 2048, "enforce_eager": False}
    assert rollout_options("vllm-server", {**given, "request_timeout_s": 900}) == VLLMServerOptions(
        **expected, request_timeout_s=900.0
    )
    assert VLLMServerOptions(**expected, request_timeout_s=9).vllm_fields() == {
        **expected,
        "kv_cache_memory_bytes": None,
        "max_num_seqs": None,
        "enable_lora": False,
        "max_lora_rank": 16,
        "max_loras": 2,  # unset: resolved for the server (DEFAULT_MAX_LORAS)
    }


def test_lora_options_set_vllms_lora_arguments_with_a_place_for_the_next_version():
    """vLLM evicts its least recently used adapter to add one beyond max_cpu_loras: one place more than the
    versions kept, so adding version k+1 never evicts a kept one before the oldest is removed."""
    lora = VLLMOptions(enable_lora=True, max_lora_rank=8, max_loras=3).engine_arguments("cuda")
    assert lora == {
        "enforce_eager": True,
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 3,
        "max_cpu_loras": 4,
    }
    with pytest.raises(
        ConfigError, match=r"max_lora_rank=4 is not a rank vLLM serves; set one of \[1, 8, 16"
    ):
        VLLMOptions(max_lora_rank=4)


def test_weight_transfer_vllm_starts_vllm_with_drivetrains_transfer_backend():
    """vLLM's worker builds its transfer engine from ``weight_transfer_config``; the default sends no key to a
    server (a 0.5.0 server, same protocol, does not know it)."""
    assert VLLMOptions(weight_transfer="vllm").engine_arguments("cuda") == {
        "enforce_eager": True,
        "weight_transfer_config": {"backend": "drivetrain"},
    }
    assert "weight_transfer" not in VLLMOptions().vllm_fields()
    assert VLLMOptions(weight_transfer="vllm").vllm_fields()["weight_transfer"] == "vllm"


@pytest.mark.parametrize(
    ("trainer", "kept"),
    [(["trainer.mode=sync"], 1), (["trainer.mode=one_step_off"], 2), (["trainer.max_staleness=3"], 4)],
)
def test_a_jobs_adapter_versions_kept_follow_its_trainer_unless_set(trainer, kept):
    """Unset, ``max_loras`` is the versions a job's trainer samples from at once (``max_staleness + 1``), and what
    vLLM sizes for (``max_cpu_loras`` one more); outside a job it stays 2 (an earlier release's fixed default)."""
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.rl.rollout_plugin import job_rollout_options

    lora = ["rollout.name=vllm-server", "rollout.options.enable_lora=true", "trainer.mode=async"]
    config = load_config(None, [*lora, *trainer])
    options = job_rollout_options(config.rollout, config.trainer)
    assert isinstance(options, VLLMServerOptions) and options.max_loras == kept
    arguments = options.engine_arguments("cuda")
    assert (arguments["max_loras"], arguments["max_cpu_loras"]) == (kept, kept + 1)
    assert options.vllm_fields()["max_loras"] == kept
    assert VLLMOptions().kept_loras == VLLMServerOptions(enable_lora=True).vllm_fields()["max_loras"] == 2
    more = load_config(None, [*lora, *trainer, "rollout.options.max_loras=5"])
    assert (
        job_rollout_options(more.rollout, more.trainer).max_loras == 5
    )  # set at least the trainer's: as set


def test_fewer_adapter_versions_kept_than_the_trainer_samples_from_are_refused():
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.rl.rollout_plugin import job_rollout_options

    given = ["rollout.name=vllm-server", "rollout.options.max_loras=2", "trainer.mode=async"]
    config = load_config(None, [*given, "trainer.max_staleness=2", "rollout.options.enable_lora=true"])
    with pytest.raises(ConfigError) as refused:
        job_rollout_options(config.rollout, config.trainer)
    assert str(refused.value) == (
        "rollout.options.max_loras=2 keeps fewer adapter versions than the trainer samples from at once: "
        "trainer.mode=async with trainer.max_staleness=2 needs 3 kept; set rollout.options.max_loras=3 (or more), "
        "or unset it to follow the trainer."
    )
    # Without LoRA support no adapter version is kept: the option is not read.
    merged = load_config(None, [*given, "trainer.max_staleness=2"])
    assert job_rollout_options(merged.rollout, merged.trainer).max_loras == 2


def test_max_model_len_is_the_length_limit_jobs_check_their_prompts_against():
    """vLLM refuses a prompt over max_model_len only when it is sampled; jobs check it when prompts load."""
    assert rollout_options("vllm-server", {"max_model_len": 64}).length_limit() == ("max_model_len", 64)
    assert VLLMOptions(max_model_len=64).length_limit() == ("max_model_len", 64)
    # Unset, vLLM serves the model's context length, which jobs check against the model.
    assert VLLMOptions().length_limit() is VLLMServerOptions().length_limit() is None


def test_an_unknown_option_names_the_plugin_and_every_option_it_takes():
    with pytest.raises(ConfigError) as error:
        rollout_options("vllm-server", {"request_timeout": 600})
    assert str(error.value) == (
        f"rollout 'vllm-server' (drivetrain-rollout-vllm {version('drivetrain-rollout-vllm')}) has no option "
        f"'request_timeout' (rollout.options.request_timeout); it accepts {VLLM_ACCEPTS}, request_timeout_s: "
        "float | None = None. Did you mean 'request_timeout_s'? Drop rollout.options.request_timeout, or write "
        "one of those keys."
    )


def test_the_colocated_rollout_takes_vllms_options_only():
    pytest.importorskip("vllm")  # looking the colocated rollout up needs vLLM
    assert rollout_options("vllm", {}) == VLLMOptions()
    with pytest.raises(
        ConfigError, match=f"has no option 'request_timeout_s' .* it accepts {VLLM_ACCEPTS}\\."
    ):
        rollout_options("vllm", {"request_timeout_s": 600})


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"gpu_memory_utilization": 1.5}, "rollout.options.gpu_memory_utilization=1.5 must be in (0, 1]"),
        ({"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": GIB}, "are both set"),
        ({"max_model_len": 0}, "rollout.options.max_model_len=0 must be >= 1"),
        (
            {"weight_transfer": "nccl"},
            "weight_transfer='nccl' is not one of ['drivetrain', 'vllm']; set drivetrain",
        ),
        (
            {"request_timeout_s": 0},
            "rollout.options.request_timeout_s=0.0 must be a positive number of seconds",
        ),
        (
            {"request_timeout_s": "an hour"},
            "rollout.options.request_timeout_s='an hour' is not a valid float",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_the_option(given, says):
    with pytest.raises(ConfigError) as error:
        rollout_options("vllm-server", given)
    assert str(error.value).startswith("rollout 'vllm-server' (drivetrain-rollout-vllm ")
    assert says in str(error.value)


class RecordingServer:
    """Answers every request at once and records how long the rollout would wait for it."""

    model_path, device = "model", "cpu"

    def __init__(self):
        self.waits: dict[str, float] = {}

    def call(self, op, *args, payload=None, what, seconds):
        self.waits[op] = seconds
        return {"start": {}, "generate": ([[3]], [[-0.5]])}.get(op)


PROMPTS = [[1, 2, 3], [4, 5]]
SAMPLING = SamplingConfig(n=1, max_new_tokens=64)


def test_every_request_waits_the_options_timeout(monkeypatch, caplog):
    monkeypatch.setenv(REQUEST_SECONDS_VARIABLE, "7200")  # deprecated: the option wins, and nothing is said
    server = RecordingServer()
    rollout = VLLMServerRollout(
        model_path="model", server=server, options=VLLMServerOptions(request_timeout_s=45)
    )
    rollout.generate(PROMPTS, SAMPLING)
    rollout.sleep()
    assert rollout.deadline == RequestDeadline(fixed_seconds=45.0)
    # The start waits at least the server's start-up allowance; every other request the option's seconds.
    assert server.waits == {"start": 600.0, "generate": 45.0, "sleep": 45.0}
    assert REQUEST_SECONDS_VARIABLE not in caplog.text


def test_unset_the_deprecated_variable_still_fixes_the_deadline_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(REQUEST_SECONDS_VARIABLE, "7200")
    with caplog.at_level(logging.WARNING, logger="drivetrain_rollout_vllm.deadline"):
        rollout = VLLMServerRollout(model_path="model", server=RecordingServer())
    assert rollout.deadline == RequestDeadline(fixed_seconds=7200.0)
    assert caplog.messages == [
        f"{REQUEST_SECONDS_VARIABLE} is deprecated and will be removed: set "
        "rollout.options.request_timeout_s=7200 instead (the option wins where both are set)."
    ]
    monkeypatch.delenv(REQUEST_SECONDS_VARIABLE)
    server = RecordingServer()
    VLLMServerRollout(model_path="model", server=server).generate(PROMPTS, SAMPLING)
    # Derived: 120 s, then every prompt token and n x max_new_tokens per prompt at 10 tokens/s.
    assert server.waits["generate"] == pytest.approx(120 + (3 + 2 + 2 * 1 * 64) / 10)
