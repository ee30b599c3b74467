"""drivetrain-roles' job runtime: what a command needs around the engines, none of it part of the contract.

- :mod:`.command_config`: one layered config per command (YAML file + dotted overrides, on OmegaConf).
- :mod:`.tracking`: metrics trackers (the run's ``metrics.jsonl``, TensorBoard, W&B, MLflow).
- :mod:`.heartbeat`: each rank's last step and phase, so a collective timeout names the rank behind.
- :mod:`.descendants`: a launch that leaves no helper process of its ranks behind.
- :mod:`.environment`: the ``drivetrain env`` report for bug reports.

These moved here from drivetrain-engine-core, so a backend author's install carries neither OmegaConf nor psutil.
"""
