"""drivetrain-engine-core: the backend-agnostic Engine contract, data format, plugins and CLI.

Plugins import core through its faces, each a page to read, and nothing else (every other module is private):

- :mod:`drivetrain_engine_core.backend`: the Engine contract a backend implements;
- :mod:`drivetrain_engine_core.kit`: what backends share by choice (attention, log-probs, router replay and
  balance, checkpoint readers);
- :mod:`drivetrain_engine_core.rollout`: the Rollout contract and the weight hand-off a rollout receives;
- :mod:`drivetrain_engine_core.job`: what command plugins (training jobs, checkpoint tools) build on;
- :mod:`drivetrain_engine_core.testing`: the conformance kits.

Importing the package is cheap: the faces load each name on first use, so listing plugins never imports torch.
"""

from __future__ import annotations

from ._upstream_noise import silence_upstream_noise

silence_upstream_noise()  # one known upstream log record, dropped at its logger (see _upstream_noise)

__all__: list[str] = []
