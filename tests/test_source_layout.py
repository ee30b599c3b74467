"""Layout rules of the sources, read with ``ast``: small files, backends that import only core's backend
and kit faces, and no code outside the Engine that reaches into an Engine's private members."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path
    for root in [*REPO.glob("packages/*/src"), *REPO.glob("examples/*/src")]
    for path in root.rglob("*.py")
)
MAX_LINES = 420
CORE = REPO / "packages" / "engine-core" / "src" / "drivetrain_engine_core"
BACKENDS = [
    REPO / "packages" / "engine-fsdp" / "src",
    REPO / "packages" / "engine-megatron" / "src",
    REPO / "examples" / "drivetrain-toy-engine" / "src",
    CORE / "testing" / "tiny_engine.py",
]
ENGINE_CLASS_FILES = (CORE / "_engine.py", CORE / "_hooks.py")


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _python_files(root: Path) -> list[Path]:
    return [root] if root.is_file() else sorted(root.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_sources_are_found() -> None:
    assert len(SOURCES) > 100 and all(path.exists() for path in BACKENDS)


def test_no_source_file_is_over_420_lines() -> None:
    lengths = {_relative(path): len(path.read_text().splitlines()) for path in SOURCES}
    too_long = {path: lines for path, lines in lengths.items() if lines > MAX_LINES}
    assert not too_long, f"split these by concern (at most {MAX_LINES} lines a file): {too_long}"


def _core_imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import of ``drivetrain_engine_core`` (top level or inside a function)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name == "drivetrain_engine_core" or name.startswith("drivetrain_engine_core."):
                yield node.lineno, name


def test_backends_import_only_the_backend_and_kit_faces_of_core() -> None:
    """``drivetrain_engine_core.backend`` is the contract a backend builds on and ``kit`` what backends share;
    core's private modules may move."""
    faces = {"drivetrain_engine_core.backend", "drivetrain_engine_core.kit"}
    offenders = [
        f"{_relative(path)}:{line} imports {module}"
        for root in BACKENDS
        for path in _python_files(root)
        for line, module in _core_imports(_tree(path))
        if module not in faces
    ]
    assert not offenders, "import these from drivetrain_engine_core.backend or .kit:\n" + "\n".join(offenders)


def test_the_import_check_sees_a_deep_import() -> None:
    tree = ast.parse("def f():\n    from drivetrain_engine_core._config import ModelConfig\n")
    assert list(_core_imports(tree)) == [(2, "drivetrain_engine_core._config")]


def _engine_private_names() -> set[str]:
    """The ``_``-prefixed methods and attributes the Engine classes define (hooks and core's own state)."""
    names: set[str] = set()
    for path in ENGINE_CLASS_FILES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _private_uses(tree: ast.Module, private: set[str]) -> Iterator[tuple[int, str]]:
    """``obj._name`` where ``_name`` is an Engine private and ``obj`` is not ``self``, ``cls`` or ``super()``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in private:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        yield node.lineno, node.attr


def test_no_module_calls_an_engines_private_members() -> None:
    """Helpers get public hooks (``holding_state``, ``checkpoint_backend_info``, ``skips``, ``lr_schedule``) or
    the hooks handed in as callables; only the Engine classes themselves touch ``_``-prefixed members."""
    private = _engine_private_names()
    assert {"_load_to_device", "_save_checkpoint", "_initialized", "_meter"} <= private
    offenders = [
        f"{_relative(path)}:{line} uses .{name}"
        for path in SOURCES
        if path not in ENGINE_CLASS_FILES
        for line, name in _private_uses(_tree(path), private)
    ]
    assert not offenders, "\n".join(offenders)
