"""A PPO run's folder: every checkpoint of the actor has the critic's, and the KL coefficient, beside it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import step_dir_name

from ..advantages import AdaptiveKLController, FixedKLController
from ..critic import Critic
from ..jobs.run_folder import RunFolder

if TYPE_CHECKING:
    from ..jobs.metrics import MetricsWriter

CRITIC_DIR = "critic"
"""Inside ``<run>/checkpoints``: the critic's own checkpoint root (its steps, its ``latest``)."""
KL_COEF_KEY = "kl_coef"


@dataclass(kw_only=True, frozen=True)
class PPORunFolder(RunFolder):
    """The run folder of :class:`~drivetrain_roles.jobs.run_folder.RunFolder`, saving and resuming the critic too.

    The critic's step is written first, the actor's last: the actor's ``latest`` (what ``--resume`` reads)
    names a step only once both are complete, and the resumed run, once the actor's step has loaded and
    matched the run, loads the critic's step of the same number (:meth:`resume_critic`). ``--overwrite``
    clears both (the critic's root is inside the checkpoint root).

    Attributes:
        critic: the critic role (its engine and update count).
        kl_control: the KL coefficient's controller, whose value an adaptive one changes every step.
    """

    critic: Critic
    kl_control: FixedKLController | AdaptiveKLController

    @classmethod
    def around(
        cls, folder: RunFolder, critic: Critic, kl_control: FixedKLController | AdaptiveKLController
    ) -> PPORunFolder:
        """``folder`` (its paths, options and data) with the critic and the KL controller."""
        fields = {f.name: getattr(folder, f.name) for f in dataclasses.fields(RunFolder)}
        return cls(**fields, critic=critic, kl_control=kl_control)

    @property
    def critic_root(self) -> Path:
        return self.checkpoint_root / CRITIC_DIR

    def resume_critic(self, step: int) -> None:
        """Load the critic and the KL coefficient of the actor's resumed ``step`` (see
        :meth:`RunFolder.start_step`); nothing at step 0."""
        if step:
            state = self.critic.load_checkpoint(self.critic_root / step_dir_name(step))
            self.kl_control.value = float(state[KL_COEF_KEY])

    def save(self, engine: Engine, step: int, metrics: MetricsWriter) -> None:
        """The critic's checkpoint (with the KL coefficient), then the actor's (collective)."""
        self.critic.save_checkpoint(self.critic_root, step, extra_state={KL_COEF_KEY: self.kl_control.value})
        super().save(engine, step, metrics)
