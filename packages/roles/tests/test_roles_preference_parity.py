"""DPO, IPO, reference-free DPO and Bradley-Terry through the FSDP engine equal a plain single-process Hugging Face
computation of the papers' formulas (loss and gradient norm, fp32), for fixed and dynamic micro-batches, on
one rank and on two (pairs sharded by core, each pair on one rank and in one micro-batch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, engine_config_from_dict, shard_data
from drivetrain_engine_core.testing import make_tiny_model_dir, run_distributed
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.losses.preference import DPOLossConfig, bradley_terry_loss_fn, dpo_loss_fn
from drivetrain_roles.preference.batches import make_pair_batch
from drivetrain_roles.preference.data import PairExample
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

VOCAB = 100
BETA = 0.3
READOUT = 0
# (prompt, chosen, rejected) lengths of four pairs; uneven so that per-rank normalisation would show.
SHAPES = [(3, 4, 6), (5, 2, 3), (2, 7, 1), (4, 3, 5)]
DPO_LOSSES = {
    "sigmoid": DPOLossConfig(beta=BETA),
    "ipo": DPOLossConfig(beta=BETA, loss_type="ipo"),
    "reference_free": DPOLossConfig(beta=BETA, reference_free=True),
}
MICRO_BATCHES = {
    "fixed_one_pair": {"micro_batch_size": 2},
    "dynamic_20_tokens": {"micro_batch_size": None, "max_tokens": 20},
}


def make_pairs() -> list[PairExample]:
    generator = torch.Generator().manual_seed(11)
    tokens = lambda n: torch.randint(1, VOCAB, (n,), generator=generator).tolist()  # noqa: E731
    pairs = []
    for prompt, chosen, rejected in SHAPES:
        shared = tokens(prompt)
        sides = [Example(shared, tokens(n), "", "") for n in (chosen, rejected)]
        pairs.append(PairExample(chosen=sides[0], rejected=sides[1]))
    return pairs


REF_LOGPS = torch.tensor([-9.0, -11.5, -4.0, -3.5, -12.0, -2.0, -7.5, -8.0])


def batches() -> dict[str, object]:
    pairs = make_pairs()
    uids = list(range(len(pairs)))
    return {
        "dpo": make_pair_batch(pairs, uids, ref_logps=REF_LOGPS),
        "rm": make_pair_batch(pairs, uids, readout_token=READOUT),
    }


# ---------------------------------------------------------------------- the papers' formulas, in plain HF


def hf_response_logp(model, example: Example, mean: bool = False) -> torch.Tensor:
    """log pi(response | prompt): the sum of the response tokens' log-probs (their mean with ``mean``)."""
    ids = torch.tensor([example.prompt_ids + example.response_ids])
    log_probs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    token_lp = log_probs.gather(-1, ids[0, 1:, None])[:, 0][len(example.prompt_ids) - 1 :]
    return token_lp.mean() if mean else token_lp.sum()


def hf_dpo(model_dir, name: str) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    config, losses = DPO_LOSSES[name], []
    for i, pair in enumerate(make_pairs()):
        ref_c, ref_r = (0.0, 0.0) if config.reference_free else (REF_LOGPS[2 * i], REF_LOGPS[2 * i + 1])
        ipo = config.loss_type == "ipo"
        if ipo:  # TRL's IPO: per-token means of the policy's and the reference's log-probs
            ref_c, ref_r = ref_c / len(pair.chosen.response_ids), ref_r / len(pair.rejected.response_ids)
        h = (hf_response_logp(model, pair.chosen, ipo) - ref_c) - (
            hf_response_logp(model, pair.rejected, ipo) - ref_r
        )
        if ipo:  # Azar et al. 2023, eq. 17
            losses.append((h - 1 / (2 * BETA)) ** 2)
        else:  # Rafailov et al. 2023, eq. 7
            losses.append(-F.logsigmoid(BETA * h))
    return backward(model, torch.stack(losses).mean())


def hf_bradley_terry(model_dir) -> tuple[float, float]:
    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    score = lambda e: model(input_ids=torch.tensor([e.prompt_ids + e.response_ids])).logits[0, -1, 0]  # noqa: E731
    losses = [-F.logsigmoid(score(p.chosen) - score(p.rejected)) for p in make_pairs()]
    return backward(model, torch.stack(losses).mean())


def backward(model, loss: torch.Tensor) -> tuple[float, float]:
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), float(norm)


# ---------------------------------------------------------------------- the engine


ALL_LOSSES = {"language_model": list(DPO_LOSSES), "value_model": ["bradley_terry"]}


def engine_results(
    model_dirs: dict[str, str],
    batches: dict,
    rank: int | None = None,
    world_size: int = 1,
    backend: str = "fsdp",
    losses: dict[str, list[str]] = ALL_LOSSES,
):
    """``{micro_batch: {loss_name: (loss, grad_norm)}}`` from ``train_batch`` with lr=0."""
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for mb_name, micro_batch in MICRO_BATCHES.items():
        results[mb_name] = {}
        for model_type, names in losses.items():
            engine = create_engine(
                model_config=ModelConfig(path=model_dirs[model_type], model_type=model_type),
                engine_config=engine_config_from_dict({"backend": backend, "micro_batch": micro_batch}),
                optimizer_config=OptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=None),
            )
            engine.initialize()
            batch = batches["dpo" if model_type == "language_model" else "rm"]
            if rank is not None:
                batch = shard_data(batch, rank, world_size)
            with engine.train_mode():
                for name in names:
                    loss_fn = (
                        bradley_terry_loss_fn() if name == "bradley_terry" else dpo_loss_fn(DPO_LOSSES[name])
                    )
                    output = engine.train_batch(batch, loss_fn)
                    results[mb_name][name] = (output.loss, output.metrics["grad_norm"])
    return results


def two_rank_worker(rank, world_size, model_dirs, batches):
    return engine_results(model_dirs, batches, rank, world_size)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pref")
    common = {"vocab_size": VOCAB, "with_tokenizer": False}
    return {
        "language_model": str(make_tiny_model_dir(root / "lm", **common)),
        # The reward model's layout: no score bias, no dropout before the head (as drivetrain rm writes it).
        "value_model": str(
            make_tiny_model_dir(
                root / "vm",
                model_type="value_model",
                token_classification_bias=False,
                classifier_dropout=0.0,
                **common,
            )
        ),
    }


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, tuple[float, float]]:
    expected = {name: hf_dpo(model_dirs["language_model"], name) for name in DPO_LOSSES}
    expected["bradley_terry"] = hf_bradley_terry(model_dirs["value_model"])
    return expected


def assert_matches(results, references) -> None:
    for mb_name, per_loss in results.items():
        assert set(per_loss) == set(references)
        for name, (loss, norm) in per_loss.items():
            ref_loss, ref_norm = references[name]
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), (mb_name, name, loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=1e-5, abs=1e-6), (mb_name, name, norm, ref_norm)


def test_one_rank_matches_the_papers_formulas(model_dirs, references) -> None:
    assert_matches(engine_results(model_dirs, batches()), references)


@pytest.mark.slow
def test_two_ranks_match_the_papers_formulas(model_dirs, references) -> None:
    per_rank = run_distributed(two_rank_worker, model_dirs, batches(), world_size=2, timeout_s=400)
    for results in per_rank:
        assert_matches(results, references)


@pytest.mark.slow
def test_megatron_matches_the_papers_formulas(model_dirs, references) -> None:
    # The DPO losses on Megatron's language model and Bradley-Terry on its value model (one process, TP = PP = 1;
    # the value head takes the config's token_classification_bias: false, as drivetrain rm's start sets).
    pytest.importorskip("drivetrain_engine_megatron")
    assert_matches(engine_results(model_dirs, batches(), backend="megatron"), references)
