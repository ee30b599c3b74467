"""Machinery the ``drivetrain`` job commands (``sft``, ``grpo``) share: run folders and launching ranks."""
