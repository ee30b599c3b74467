"""``python -m drivetrain_engine_core``: the ``drivetrain`` CLI where no console script is on ``PATH``
(packages installed with ``pip --target``, as on a machine without network)."""

from drivetrain_engine_core._cli import run

run()
