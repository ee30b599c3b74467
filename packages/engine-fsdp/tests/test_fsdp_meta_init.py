"""Meta-device build and sharded loading (``engine.meta_init``) against a plain Hugging Face + PEFT reference.

The reference is what a user would write without drivetrain: ``torch.manual_seed(seed)``, ``from_pretrained``
in float32 and ``get_peft_model``. Every parameter and buffer the engine ends up with (gathered to full
tensors) must equal the reference's bit for bit, whatever the architecture, tying, model type, LoRA, on-disk
dtype or world size; log-probs must equal those of the full path (``meta_init=False``) exactly. One 2-rank
launch runs every 2-rank check.
"""

from __future__ import annotations

import json

import pytest
import torch
from drivetrain_engine_core.backend import CheckpointError, LoraConfig, ModelConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, run_distributed
from drivetrain_engine_core.testing.device import device_under_test
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))
SEED = 3
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Language-model directories; a value model built from one gets a fresh (seeded) value head."""
    root = tmp_path_factory.mktemp("models")
    dirs = {
        (arch, tied): make_tiny_model_dir(root / f"{arch}_{tied}", arch=arch, tie_word_embeddings=tied)
        for arch in ("qwen2", "llama")
        for tied in (False, True)
    }
    dirs["critic"] = make_tiny_model_dir(root / "critic", arch="llama", model_type="value_model")
    return dirs


def make_engine(path, *, model_type="language_model", lora=None, optimizer=None, **engine):
    engine.setdefault("device", device_under_test())
    model = ModelConfig(path=str(path), model_type=model_type, lora=lora)
    instance = FSDPEngine(
        model_config=model,
        engine_config=FSDPEngineConfig(seed=SEED, **engine),
        optimizer_config=optimizer,
    )
    instance.initialize()
    return instance


def full_state(module):
    """Every parameter and buffer as a full tensor (a collective when sharded over several ranks)."""
    return {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }


def reference_state(path, model_type, lora):
    """Parameters and buffers of the plain Hugging Face (+ PEFT) model, built as a user would."""
    torch.manual_seed(SEED)
    if model_type == "value_model":
        model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32, num_labels=1)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora is not None:
        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                target_modules=list(lora.target_modules),
                modules_to_save=["score"] if model_type == "value_model" else None,
            ),
        )
    return {name: tensor.detach() for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


def assert_bit_equal(produced, reference):
    assert sorted(produced) == sorted(reference)
    for name, tensor in reference.items():
        assert produced[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(produced[name], tensor), name


def log_probs(engine, batch):
    with engine.eval_mode():
        outputs = engine.infer_batch(batch).outputs
    field = "values" if engine.model_config.model_type == "value_model" else "log_probs"
    return outputs[field].values().cpu()


def make_batch():
    return random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=1)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("model_type", ["language_model", "value_model"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_one_rank_equals_from_pretrained_bit_for_bit(model_dirs, arch, tied, model_type, lora):
    path = model_dirs[arch, tied]
    engine = make_engine(path, model_type=model_type, lora=lora)
    assert_bit_equal(full_state(engine.module), reference_state(path, model_type, lora))


def test_log_probs_equal_the_full_path_and_values_load_a_saved_head(model_dirs):
    batch = make_batch()
    path = model_dirs["qwen2", True]
    meta, full = make_engine(path, lora=LORA), make_engine(path, lora=LORA, meta_init=False)
    assert torch.equal(log_probs(meta, batch), log_probs(full, batch))
    critic = make_engine(model_dirs["critic"], model_type="value_model")  # the head comes from the checkpoint
    assert_bit_equal(full_state(critic.module), reference_state(model_dirs["critic"], "value_model", None))
    full_critic = make_engine(model_dirs["critic"], model_type="value_model", meta_init=False)
    assert torch.equal(log_probs(critic, batch), log_probs(full_critic, batch))


def test_bf16_on_disk_becomes_the_same_fp32_master_weights(model_dirs, tmp_path):
    AutoModelForCausalLM.from_pretrained(model_dirs["llama", False], dtype=torch.bfloat16).save_pretrained(
        tmp_path
    )
    (tmp_path / "config.json").write_text((model_dirs["llama", False] / "config.json").read_text())
    assert {t.dtype for t in load_file(tmp_path / WEIGHTS).values()} == {torch.bfloat16}
    for lora in (None, LORA):
        engine = make_engine(tmp_path, lora=lora, cpu_offload_policy=True)
        assert_bit_equal(full_state(engine.module), reference_state(tmp_path, "language_model", lora))


def test_initialize_records_time_and_peak_memory(model_dirs):
    usage = make_engine(model_dirs["qwen2", False]).init_usage
    assert usage is not None and usage.seconds > 0
    assert usage.host_peak_rss_bytes >= usage.host_rss_before_bytes > 0
    assert not usage.host_peak_is_lifetime  # Linux: the peak is reset at the start of initialize()
    assert usage.as_metrics("initialize")["initialize/host_peak_rss_gib"] > 0


def copy_model_dir(source, target, transform=None):
    """``source``'s config and weights in ``target``, the weights passed through ``transform``."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    weights = load_file(source / WEIGHTS)
    save_file(transform(weights) if transform else weights, target / WEIGHTS)
    return target


def test_a_directory_without_safetensors_names_what_it_holds(model_dirs, tmp_path):
    (tmp_path / "config.json").write_text((model_dirs["qwen2", False] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin.*meta_init=False"):
        make_engine(tmp_path)


def test_sharded_checkpoints_load_and_a_stale_file_outside_the_index_is_refused(model_dirs, tmp_path):
    source = model_dirs["qwen2", False]
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(
        tmp_path, max_shard_size="40KB"
    )
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_bit_equal(
        full_state(make_engine(tmp_path).module), reference_state(source, "language_model", None)
    )
    (tmp_path / WEIGHTS).write_bytes((source / WEIGHTS).read_bytes())
    with pytest.raises(CheckpointError, match=r"index\.json does not list: \['model\.safetensors'\]"):
        make_engine(tmp_path)


def test_shards_that_disagree_with_the_config_name_the_tensor(model_dirs, tmp_path):
    source = model_dirs["qwen2", False]
    narrow = copy_model_dir(source, tmp_path / "narrow")
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(
        CheckpointError, match=r"gate_proj\.weight: config gives \[48, 32\], checkpoint holds \[64, 32\]"
    ):
        make_engine(narrow)
    dropped = copy_model_dir(
        source, tmp_path / "dropped", lambda w: {k: v for k, v in w.items() if k != "model.norm.weight"}
    )
    with pytest.raises(
        CheckpointError, match=r"1 of its \d+ weights are missing \(\['model\.norm\.weight'\]\)"
    ):
        make_engine(dropped)


def test_weights_of_another_architecture_name_missing_and_found(model_dirs, tmp_path):
    def gpt2_names(weights):
        return {name.replace("model.layers.", "transformer.h."): tensor for name, tensor in weights.items()}

    path = copy_model_dir(model_dirs["llama", False], tmp_path / "other", gpt2_names)
    with pytest.raises(
        CheckpointError, match=r"missing \(\['model\.layers\.0\..*match no weight: \['transformer\.h\.0\."
    ):
        make_engine(path)


# ---------------------------------------------------------------------------------------------- two ranks

TWO_RANK_CASES = {
    "qwen2_tied_lm_lora": ("qwen2", True, "language_model", LORA, {}),
    "llama_untied_value_lora": ("llama", False, "value_model", LORA, {}),
    "qwen2_untied_value": ("qwen2", False, "value_model", None, {}),
    "llama_tied_lm_hybrid": ("llama", True, "language_model", None, {"fsdp_size": 1}),
}


def two_rank_device():
    """``cuda`` when the GPU lane has a GPU per rank, else ``cpu`` (gloo), whatever ``DRIVETRAIN_TEST_DEVICE`` says.

    Two ranks cannot share one GPU (each selects ``cuda:LOCAL_RANK`` and gathers over nccl), and what this
    launch checks (sharded loading equals ``from_pretrained`` bit for bit) holds on any device, so with fewer
    GPUs than ranks it runs on the CPU, as the other 2-rank tests do, rather than being skipped.
    """
    if device_under_test() == "cuda" and torch.cuda.device_count() >= 2:
        return "cuda"
    return "cpu"


def two_rank_worker(rank, world_size, paths, device):
    results = {}
    for name, (arch, tied, model_type, lora, engine) in TWO_RANK_CASES.items():
        meta = make_engine(paths[f"{arch}_{tied}"], model_type=model_type, lora=lora, device=device, **engine)
        full = make_engine(
            paths[f"{arch}_{tied}"],
            model_type=model_type,
            lora=lora,
            meta_init=False,
            device=device,
            **engine,
        )
        local = sum(p.to_local().numel() for p in meta.module.parameters())
        results[name] = {
            "state": full_state(meta.module),
            "local_fraction": local / sum(p.numel() for p in meta.module.parameters()),
            "same_outputs": bool(torch.equal(log_probs(meta, make_batch()), log_probs(full, make_batch()))),
        }
    return results


@pytest.fixture(scope="module")
def two_ranks(model_dirs):
    paths = {
        f"{arch}_{tied}": str(model_dirs[arch, tied]) for arch in ("qwen2", "llama") for tied in (False, True)
    }
    device = two_rank_device()
    return run_distributed(two_rank_worker, paths, device, world_size=2, timeout_s=600, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TWO_RANK_CASES))
def test_two_ranks_equal_from_pretrained_and_hold_half(model_dirs, two_ranks, case):
    arch, tied, model_type, lora, engine = TWO_RANK_CASES[case]
    reference = reference_state(model_dirs[arch, tied], model_type, lora)
    for rank_result in two_ranks:
        assert_bit_equal(rank_result[case]["state"], reference)
        assert rank_result[case]["same_outputs"]
        # Sharded over both ranks (halves, up to uneven rows), or whole on each rank under hybrid sharding.
        expected = 1.0 if engine.get("fsdp_size") == 1 else 0.5
        assert rank_result[case]["local_fraction"] == pytest.approx(expected, abs=0.05)
