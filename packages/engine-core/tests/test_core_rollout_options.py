"""A rollout plugin's own options: declared as a frozen dataclass on its rollout class, built and checked by core
from a job's plain ``rollout.options`` values, passed to the rollout by ``create_rollout``.

The reference is the toy plugin's dataclass itself: what ``create_rollout`` hands the rollout must equal the
dataclass built by hand from the same values."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import pytest
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import ConfigError, hookimpl
from drivetrain_engine_core.job import create_rollout, plugins, rollout_options
from drivetrain_engine_core.rollout import Rollout, RolloutOptions
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint


@dataclass(kw_only=True, frozen=True)
class ToyOptions(RolloutOptions):
    wait_s: float | None = None
    mode: Literal["fast", "exact"] = "exact"
    slots: int = 4
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ConfigError(f"rollout.options.slots must be >= 1, got {self.slots}.")


class _Hooks(Rollout):
    """The backend hooks, never called here: these tests stop at construction."""

    def _load_bucket(self, bucket): ...
    def _finish_update(self): ...
    def _abort_update(self): ...
    def _served_tensor(self, name): ...
    def _generate(self, prompts, sampling): ...
    def _sleep(self): ...
    def _wake(self): ...


class ToyRollout(_Hooks):
    name = "toy"
    options_class = ToyOptions

    def __init__(self, *, model_path, device="cpu", verify=None, options: ToyOptions | None = None):
        super().__init__(model_path=model_path, device=device, verify=verify)
        self.options = options


class PlainRollout(_Hooks):
    """A plugin written before options existed: its constructor takes no ``options``."""

    name = "plain"

    def __init__(self, *, model_path, device="cpu", verify=None):
        super().__init__(model_path=model_path, device=device, verify=verify)


@hookimpl
def _register(registry):
    registry.register("toy", ToyRollout)
    registry.register("plain", PlainRollout)


_ENTRY_POINT = InMemoryEntryPoint(
    name="toy", distribution="drivetrain-rollout-toy", plugin=SimpleNamespace(register_rollouts=_register)
)


@pytest.fixture(autouse=True)
def toy_plugins():
    reset_plugins()
    plugins(lambda: get_plugin_manager(entry_points=[_ENTRY_POINT], disabled=[]))
    yield
    reset_plugins()


ACCEPTED = "wait_s: float | None = None, mode: 'fast' | 'exact' = 'exact', slots: int = 4, tags: tuple[str, ...] = ()"


def test_defaults_and_given_values_reach_the_rollout_as_the_plugins_dataclass():
    assert create_rollout("toy", model_path="m").options == ToyOptions()
    # Values as a command line or YAML file gives them: strings for numbers, lists for tuples.
    given = {"wait_s": "600", "mode": "fast", "slots": 2, "tags": ["a", "b"]}
    rollout = create_rollout("toy", model_path="m", options=given)
    assert rollout.options == ToyOptions(wait_s=600.0, mode="fast", slots=2, tags=("a", "b"))
    built = ToyOptions(slots=3)
    assert create_rollout("toy", model_path="m", options=built).options is built


def test_a_rollout_without_options_is_built_as_before_and_refuses_any():
    assert isinstance(create_rollout("plain", model_path="m", options={}), PlainRollout)
    with pytest.raises(ConfigError) as error:
        create_rollout("plain", model_path="m", options={"slots": 2})
    assert str(error.value) == (
        "rollout 'plain' (drivetrain-rollout-toy 0.1.0) has no option 'slots' (rollout.options.slots); it takes no "
        "options: drop rollout.options.slots."
    )


def test_an_unknown_key_names_the_rollout_its_plugin_every_option_and_the_fix():
    with pytest.raises(ConfigError) as error:
        rollout_options("toy", {"slot": 2})
    assert str(error.value) == (
        "rollout 'toy' (drivetrain-rollout-toy 0.1.0) has no option 'slot' (rollout.options.slot); it accepts "
        f"{ACCEPTED}. Did you mean 'slots'? Drop rollout.options.slot, or write one of those keys."
    )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (
            {"wait_s": "soon"},
            "rollout.options.wait_s='soon' is not a valid float | None; write a number, e.g. ",
        ),
        ({"mode": "quick"}, "rollout.options.mode='quick' is not a valid 'fast' | 'exact'"),
        ({"slots": 2.5}, "rollout.options.slots=2.5 is not a valid int; write a whole number"),
        ({"slots": 0}, "rollout.options.slots must be >= 1, got 0."),
    ],
)
def test_a_wrong_type_or_value_names_the_key_the_rollout_and_every_option(given, says):
    with pytest.raises(ConfigError) as error:
        create_rollout("toy", model_path="m", options=given)
    message = str(error.value)
    assert message.startswith(f"rollout 'toy' (drivetrain-rollout-toy 0.1.0): {says}")
    assert message.endswith(f" Its options: {ACCEPTED}.")


def test_options_of_another_rollout_are_refused():
    @dataclass(kw_only=True, frozen=True)
    class OtherOptions(RolloutOptions):
        slots: int = 4

    with pytest.raises(
        ConfigError, match=r"rollout 'toy' .* takes options of type ToyOptions, got a .*OtherOptions"
    ):
        rollout_options("toy", OtherOptions())
