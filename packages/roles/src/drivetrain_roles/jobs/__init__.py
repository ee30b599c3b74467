"""The job layer every ``drivetrain`` command (``sft``, ``dpo``, ``rm``, ``grpo``) is built on: run folders,
launching ranks, the step loop and progress bar, the examples and their batches, the embedded assets, metrics,
held-out evaluation, the final model and the generated config reference pages."""
