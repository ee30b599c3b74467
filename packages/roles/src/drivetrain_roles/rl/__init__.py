"""The RL layer ``grpo`` and ``ppo`` share as siblings: neither command imports the other, both import this.

- the job: :mod:`.policy_trainer` (the template: setup; each step sample -> score -> update -> hand off; the
  command fills in its batch, update and metrics), :mod:`.hooks` (the sampler and scorer a job plugs in),
  :mod:`.step_record` (every step's metrics, built in one place), :mod:`.controller` (the single controllers'
  base over a Ray worker group);
- the step's parts: :mod:`.sampling` (seeds, sampling, the weight hand-off), :mod:`.pipeline` and
  :mod:`.versions` (generation ahead of training and its staleness), :mod:`.batch` (the actor's batch),
  :mod:`.policy_update` (old and reference log-probs, the policy update, the rollout statistics),
  :mod:`.scoring`; the advantages without a critic (:mod:`.advantage_estimators`, :mod:`.advantage_config`) and
  DAPO's reward shaping (:mod:`.reward_shaping`);
- rewards: :mod:`.rewards` (loading, weighting, ``reward/<name>``), :mod:`.reward_runner`,
  :mod:`.reward_settings`, :mod:`.reward_signatures`, :mod:`.reward_inputs` and the built-ins
  (:mod:`.builtin_rewards`, :mod:`.math_answers`, :mod:`.step_credit`);
- the shared config: :mod:`.job_config` (the sections as protocols, shared defaults and checks),
  :mod:`.rollout_config`, :mod:`.trainer_config`, :mod:`.algorithm_section`, :mod:`.router_replay`,
  :mod:`.rollout_plugin`; setup: :mod:`.warm_start`, :mod:`.prompt_checks`, :mod:`.actor_setup`.

Importing this package imports nothing else (config checks run without torch).
"""

from __future__ import annotations

__all__: list[str] = []
