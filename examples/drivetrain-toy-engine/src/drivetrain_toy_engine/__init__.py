"""A third-party drivetrain backend in a few small files: register it, implement the hooks, run the kit."""

__all__: list[str] = []
