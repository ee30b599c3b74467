"""A third-party drivetrain environment in two small files: the game, and the hook that registers it."""

__all__: list[str] = []
