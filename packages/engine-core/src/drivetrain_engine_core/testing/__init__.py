"""Test helpers for drivetrain engines: tiny models and tokenizer, a local launcher, references, conformance.

Needs the ``testing`` extra (``pip install drivetrain-engine-core[testing]``). Names are imported lazily so
that a launcher child, which imports this package to find its entry point, does not pay for transformers.
"""

from __future__ import annotations

from drivetrain_engine_core._lazy import lazy_getattr

_EXPORTS = {
    "build_tiny_tokenizer": "tokenizer",
    "make_tiny_model_dir": "models",
    "lean_model_dir": "models",
    "run_distributed": "launcher",
    "free_port": "launcher",
    "random_batch": "batches",
    "token_mean_nll": "losses",
    "value_mse": "losses",
    "load_reference_model": "reference",
    "reference_outputs": "reference",
    "reference_log_probs": "reference",
    "reference_entropy": "reference",
    "reference_values": "reference",
    "reference_loss_and_grad_norm": "reference",
    "reference_train_losses": "reference",
    "grad_norm": "reference",
    "EngineConformanceTests": "conformance",
    "RolloutConformanceTests": "rollout_conformance",
    "TinyTorchEngine": "tiny_engine",
    "TinyEngineConfig": "tiny_engine",
    "formula_routes": "routing",
    "forced_log_probs": "routing",
    "forced_routing": "routing",
    "plain_hf_top_k": "routing",
    "with_routes": "routing",
    "train_history": "training",
    "InMemoryEntryPoint": "plugins",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
