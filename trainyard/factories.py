"""`model.name`, checked without importing anything: a registered model or a user's factory.

Importing runs module code (`this` prints a poem, `antigravity` opens a browser), and the
standard library holds callables such as os.system that are not model factories. So a
user's module is found on the path and its source parsed, never executed. No torch here:
settings are validated before torch is imported.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import sysconfig
from importlib.machinery import BuiltinImporter, FrozenImporter, ModuleSpec, PathFinder
from pathlib import Path

# trainyard.models.zoo.SPEC_FACTORIES's names, here so that settings are checked without importing torch.
REGISTERED_MODELS = ("mlp", "linear", "cnn", "transformer")
_OTHER_FACTORY = (
    "use mlp, linear, cnn, transformer or package.module:factory from your project or an "
    "installed package"
)


def locate_factory(name: str) -> ModuleSpec | None:
    """Check, without importing anything, that `name` is a registered model or
    `package.module:factory` whose module (in the project or an installed package, not the
    standard library) defines `factory` at top level. Returns the module's spec, or None
    for a registered model; raises ValueError saying what to write instead."""
    if name in REGISTERED_MODELS:
        return None
    module_name, sep, attr = name.partition(":")
    parts = module_name.split(".")
    if not sep or not attr.isidentifier() or not all(p.isidentifier() for p in parts):
        raise ValueError(
            f"unknown model; use one of {', '.join(REGISTERED_MODELS)} "
            "or an import path package.module:factory"
        )
    spec = _find_module(module_name)
    if not _defines(spec, attr, depth=0):
        raise ValueError(
            f"'{module_name}' ({spec.origin}) has no top-level def, class or assignment "
            f"named '{attr}'; {_OTHER_FACTORY}"
        )
    return spec


def _find_module(module_name: str) -> ModuleSpec:
    """Find each package on the way down (`pkg`, then `pkg.mod` in pkg's folders), which
    locates files without running any package's __init__."""
    spec: ModuleSpec | None = None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        if spec is not None and spec.submodule_search_locations is None:
            raise ValueError(f"'{spec.name}' is a module, not a package: it has no '{name}'")
        spec = _find_spec(name, spec.submodule_search_locations if spec else None)
        if spec is None:
            raise ValueError(
                f"no module '{name}' on the Python path; put it in your project (on PYTHONPATH) "
                "or install its package"
            )
        if _in_standard_library(spec):
            raise ValueError(
                f"'{name}' is part of Python's standard library, not a model factory; "
                + _OTHER_FACTORY
            )
    assert spec is not None
    return spec


def _find_spec(name: str, locations: list[str] | None) -> ModuleSpec | None:
    if locations is None:
        for importer in (BuiltinImporter, FrozenImporter):  # as the import system's order
            found = importer.find_spec(name)
            if found is not None:
                return found
    spec = PathFinder.find_spec(name, locations)
    if spec is None and locations is None:
        # Editable installs (`pip install -e`) bring their own finders; they only locate.
        for finder in sys.meta_path:
            if finder not in (BuiltinImporter, FrozenImporter, PathFinder) and hasattr(
                finder, "find_spec"
            ):
                spec = finder.find_spec(name, None)
                if spec is not None:
                    break
    return spec


def _in_standard_library(spec: ModuleSpec) -> bool:
    loader: object = spec.loader  # the importer class itself for built-in and frozen modules
    if spec.origin in ("built-in", "frozen") or loader in (BuiltinImporter, FrozenImporter):
        return True
    places = [spec.origin] if spec.has_location and spec.origin else []
    places += list(spec.submodule_search_locations or [])
    return any(_stdlib_path(Path(place).resolve()) for place in places)


def _stdlib_path(place: Path) -> bool:
    paths = sysconfig.get_paths()
    # A virtual environment's site-packages can lie inside platstdlib.
    if any(place.is_relative_to(Path(paths[key]).resolve()) for key in ("purelib", "platlib")):
        return False
    for key in ("stdlib", "platstdlib"):
        root = Path(paths[key]).resolve()
        if place.is_relative_to(root):
            return place.relative_to(root).parts[:1] not in {("site-packages",), ("dist-packages",)}
    return False


def _defines(spec: ModuleSpec, attr: str, depth: int) -> bool:
    """Whether the module's source binds `attr` at top level, following `from x import *`
    (a few levels, as package __init__ files re-export)."""
    tree = _parse_source(spec)
    names, star_modules = _top_level_names(tree.body)
    if attr in names or "__getattr__" in names:  # a module __getattr__ makes names lazily
        return True
    package = spec.name if spec.submodule_search_locations is not None else spec.parent
    for level, module in star_modules if depth < 3 else []:
        try:
            target = _find_module(importlib.util.resolve_name("." * level + module, package))
        except (ValueError, ImportError):
            continue
        if _defines(target, attr, depth + 1):
            return True
    return False


def _parse_source(spec: ModuleSpec) -> ast.Module:
    origin = spec.origin if spec.has_location else None
    if not origin or not origin.endswith(".py"):
        what = f"its file {Path(origin).name} is not" if origin else "it has no"
        raise ValueError(
            f"'{spec.name}' cannot be checked without importing it: {what} Python source; "
            "name a module written in Python that defines the factory"
        )
    source = importlib.util.decode_source(Path(origin).read_bytes())
    try:
        return _parse(source, origin)
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"'{spec.name}' ({origin}) cannot be parsed: {exc}") from None


def _parse(source: str, origin: str, tries: int = 3) -> ast.Module:
    """ast.parse, again where CPython 3.11 raised its spurious "AST constructor recursion
    depth mismatch" SystemError (python/cpython gh-106905, seen here in a Prefect flow run's
    process, which runs several threads): the ast module's depth counter is interpreter-wide
    state, left off by another parse. The parse itself is pure, so parsing again gives the
    real tree."""
    for _ in range(tries - 1):
        try:
            return ast.parse(source, origin)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(source, origin)


def _top_level_names(body: list[ast.stmt]) -> tuple[set[str], list[tuple[int, str]]]:
    """Names bound at module level (also inside if/try/with blocks), and star imports."""
    names: set[str] = set()
    stars: list[tuple[int, str]] = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*" and isinstance(node, ast.ImportFrom):
                    stars.append((node.level, node.module or ""))
                else:
                    names.add(alias.asname or alias.name.split(".")[0])
        for block in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, ast.If | ast.Try | ast.TryStar | ast.With | ast.ExceptHandler):
                inner = _top_level_names(getattr(node, block, []))
                names |= inner[0]
                stars += inner[1]
    return names, stars
