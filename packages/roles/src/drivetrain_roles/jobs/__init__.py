"""Machinery the ``drivetrain`` job commands (``sft``, ``dpo``, ``rm``, ``grpo``) share: run folders, launching
ranks, the progress bar."""
