"""The layout's rules, read from the tree itself: file sizes, the modules at the top of the
package, private names kept inside their package, function-local imports that say why, and
the import contract (lint-imports, whose contracts are in pyproject.toml)."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("trainyard", "flows", "tasks")
MAX_LINES = 500
# The vocabulary every floor may use, typed settings and project paths, and the two
# `python -m` names kept for one release (trainyard.worker, trainyard.guardian).
TOP_MODULES = {
    "__init__", "errors", "data_spec", "dist", "factories", "config", "project",
    "worker", "guardian",
}  # fmt: skip
# Names of the first-party packages and the one third-party package the rules name.
WATCHED_ROOTS = {*PRODUCT, "prefect"}


def product_files(suffix: str = ".py") -> list[Path]:
    return sorted(p for root in PRODUCT for p in (REPO / root).rglob(f"*{suffix}"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path) -> str:
    """The package a file's module belongs to (a package's __init__ belongs to itself)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1])


def imported_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of what `from ... import` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = package_of(path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def parsed() -> Iterator[tuple[Path, ast.Module]]:
    for path in product_files():
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_no_product_file_is_over_500_lines():
    too_long = {
        str(p.relative_to(REPO)): n
        for suffix in (".py", ".js", ".css", ".html")
        for p in product_files(suffix)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"


def test_only_the_vocabulary_modules_sit_at_the_top_of_the_package():
    top = {p.stem for p in (REPO / "trainyard").glob("*.py")}
    assert top <= TOP_MODULES, f"move into a room: {sorted(top - TOP_MODULES)}"


def test_every_room_is_on_a_floor_of_the_import_contract():
    """A new room (or top module) must be placed on a floor, else lint-imports never checks
    what it imports."""
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (floors,) = [c for c in settings["contracts"] if c["type"] == "layers"]
    placed = {name.strip() for layer in floors["layers"] for name in layer.split(":")}
    rooms = {
        f"trainyard.{p.stem if p.is_file() else p.name}"
        for p in (REPO / "trainyard").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert rooms | {"flows", "tasks"} <= placed, sorted(rooms - placed)
    namespace_folders = [
        str(p.relative_to(REPO))
        for p in (REPO / "trainyard").rglob("*")
        if p.is_dir() and any(p.glob("*.py")) and not (p / "__init__.py").is_file()
    ]
    assert not namespace_folders, f"not a package (no __init__.py): {namespace_folders}"


def is_first_party_module(name: str) -> bool:
    path = REPO / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_owning(module: str) -> str:
    """The package a module lives in: `pkg.mod` in pkg, a package `pkg` in itself."""
    return module if (REPO / module.replace(".", "/")).is_dir() else module.rpartition(".")[0]


def private_names_used(path: Path, tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, module, name) for each private name this file takes from a first-party module:
    `from m import _name`, a private module in the path, or `m._name` on an imported module."""
    modules: dict[str, str] = {}  # local alias -> first-party module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PRODUCT:
                    modules[alias.asname or alias.name] = alias.name
                    if any(is_private(part) for part in alias.name.split(".")):
                        yield node.lineno, alias.name, alias.name
        elif isinstance(node, ast.ImportFrom):
            source = imported_module(path, node)
            if source.split(".")[0] not in PRODUCT:
                continue
            for part in source.split("."):
                if is_private(part):
                    yield node.lineno, source, part
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, source, alias.name
                else:
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and is_first_party_module(modules[node.value.id])
            and is_private(node.attr)
        ):
            yield node.lineno, modules[node.value.id], node.attr


def test_no_private_name_crosses_a_package():
    crossing = []
    for path, tree in parsed():
        home = package_of(path)
        for line, module, name in private_names_used(path, tree):
            if package_owning(module) != home:
                crossing.append(f"{path.relative_to(REPO)}:{line} {module}.{name}")
    assert not crossing, "make it public, it is a seam:\n" + "\n".join(crossing)


def comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def watched(path: Path, node: ast.stmt) -> bool:
    """An import of a first-party module or of prefect."""
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in WATCHED_ROOTS for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return imported_module(path, node).split(".")[0] in WATCHED_ROOTS
    return False


def import_runs(function: ast.AST) -> Iterator[list[ast.stmt]]:
    """Consecutive import statements inside a function, as written (one comment above a
    run speaks for all of it)."""
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody", "handlers"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue  # a lambda's or an if-expression's body is an expression
            run: list[ast.stmt] = []
            for statement in statements:
                if isinstance(statement, (ast.Import, ast.ImportFrom)):
                    run.append(statement)
                    continue
                if run:
                    yield run
                run = []
            if run:
                yield run


def test_every_function_local_import_says_why():
    """A local import is only for start-up cost (never to dodge a circle), and says so on
    its line or on the comment line above it (or above the run of imports it is in)."""
    silent = set()
    for path, tree in parsed():
        source = path.read_text()
        lines, comments = source.splitlines(), comment_lines(source)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for run in import_runs(function):
                above = run[0].lineno - 1
                said_above = above in comments and lines[above - 1].lstrip().startswith("#")
                for node in run:
                    own_line = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if watched(path, node) and not (
                        said_above or any(n in comments for n in own_line)
                    ):
                        where = f"{path.relative_to(REPO)}:{node.lineno}"
                        silent.add(f"{where} {lines[node.lineno - 1].strip()}")
    assert not silent, "a function-local import without a comment saying why:\n" + "\n".join(
        sorted(silent)
    )


def test_lint_imports_keeps_every_contract():
    """The floors, prefect below the CLI, no circles: import-linter's own report."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
