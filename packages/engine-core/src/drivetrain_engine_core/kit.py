"""What plugins share by choice: kernels and readers a backend may use instead of writing its own.

None of it is required by the Engine contract (:mod:`drivetrain_engine_core.backend`); using it keeps a
backend's numbers equal to the others'. By topic:

- attention over packed rows: :func:`packed_causal_attention` (:class:`SequenceLengths`), with
  :func:`flash_kernel_applies` / :func:`flash_kernel_missing` saying whether the fused kernel serves a call;
- log-probs and entropy from the last hidden states in chunks: :func:`linear_log_probs`;
- dropout off for training, the same way on every backend: :func:`disable_dropout_in_config`,
  :func:`disable_dropout_modules`;
- router replay (record a rollout's routed experts, replay them in training): :data:`ROUTED_EXPERTS`,
  :data:`NOT_RECORDED`, :func:`hf_routers`, :func:`routers_of`, :func:`recording_routes`,
  :func:`replaying_routes`, :func:`micro_batch_routes`, :func:`check_routes_shape`, :func:`refuse_routes`;
- router balance (the auxiliary load-balancing loss): :class:`RouterLoss`, :func:`router_loss_of`,
  :data:`ROUTER_AUX_METRIC`;
- checkpoint readers: Hugging Face safetensors indexes (:func:`read_checkpoint_index`), DCP shards
  (:class:`DCPTensorReader`, :func:`check_saved_shapes`), a step's manifest (:func:`read_manifest`), the
  folders inside a step (:data:`MODEL_DIR`, :data:`OPTIMIZER_DIR`), Hugging Face-named training state for
  mergers (:class:`HFTrainingState`, :data:`WEIGHT`, :data:`ADAM_MOMENTS`) and LoRA names
  (:data:`PEFT_PREFIX`, :func:`split_peft_name`, :func:`peft_target_modules`);
- process groups: the :mod:`distributed` module; cheap package imports: :func:`lazy_getattr`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._face import face

if TYPE_CHECKING:
    from . import _distributed as distributed
    from ._checkpoint import (
        MODEL_DIR,
        OPTIMIZER_DIR,
        PEFT_PREFIX,
        DCPTensorReader,
        check_saved_shapes,
        read_manifest,
        split_peft_name,
    )
    from ._checkpoint.hf_state import ADAM_MOMENTS, WEIGHT, HFTrainingState
    from ._checkpoint.peft import peft_target_modules
    from ._dropout import disable_dropout_in_config, disable_dropout_modules
    from ._hf_checkpoint import CheckpointIndex, read_checkpoint_index
    from ._lazy import lazy_getattr
    from ._linear_log_probs import linear_log_probs
    from ._packed_attention import (
        SequenceLengths,
        flash_kernel_applies,
        flash_kernel_missing,
        packed_causal_attention,
    )
    from ._router_balance import ROUTER_AUX_METRIC, RouterLoss, router_loss_of
    from ._router_replay import (
        NOT_RECORDED,
        ROUTED_EXPERTS,
        check_routes_shape,
        hf_routers,
        micro_batch_routes,
        recording_routes,
        refuse_routes,
        replaying_routes,
        routers_of,
    )

__all__, __getattr__ = face(__name__)
