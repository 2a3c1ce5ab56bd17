"""The layers of services/ (docs/architecture: common < {worker, prefix_index} < engine < processor
< gateway < {cli, inprocess, llm}), read from the source with `ast`: a package imports only from the
packages below it, or from itself; kvmesh_kernels imports nothing from services.

Every import counts: at module level, inside a function, and under `if TYPE_CHECKING:`. An import
only a type checker sees still ties the two packages together (one cannot be read, moved or
replaced without the other), and it is how a cycle hides; a Protocol in the lower package says what
it needs instead. The few imports the order does not allow are in ALLOWED, each with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICES = REPO_ROOT / "services"
KERNELS = REPO_ROOT / "kvmesh_kernels"

# The rank of each package (a directory or a module directly under services/): higher may import lower.
LAYERS: dict[str, int] = {
    "common": 0,
    "worker": 1, "prefix_index": 1,
    "engine": 2,
    "processor": 3,
    "gateway": 4,
    "cli": 5, "inprocess": 5, "llm": 5,
}
# services/__init__.py is the offline API's front door (`from services import LLM`): llm's layer.
ROOT_PACKAGE = "llm"

# (importing module, imported module) -> why the layer order does not apply.
ALLOWED: dict[tuple[str, str], str] = {
    ("services.llm", "services.inprocess"): "the offline LLM is the user's API over the stack inprocess wires; "
                                            "both are top-level entry points that nothing else in services imports",
}


class Import(NamedTuple):
    module: str  # the importing module, dotted
    path: Path
    line: int
    target: str  # the imported module (or package), dotted


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module `from ... import` names (its relative dots resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(path: Path, module: str | None = None) -> Iterator[Import]:
    """Every import in the file (the module `module`, by default its name under the repository),
    wherever it stands; `from pkg import name` is pkg.name when that is a module of ours (else pkg)."""
    module = module_name(path) if module is None else module
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node, module, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield Import(module, path, node.lineno, submodule if is_our_module(submodule) else base)


def is_our_module(dotted: str) -> bool:
    path = REPO_ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_of(dotted: str) -> str:
    """The layer package of a services module: services.engine.client -> engine, services -> llm."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ROOT_PACKAGE


def sources(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts)


def services_imports(root: Path) -> Iterator[Import]:
    for path in sources(root):
        for imported in imports_of(path):
            if imported.target == "services" or imported.target.startswith("services."):
                yield imported


def describe(imported: Import, why: str) -> str:
    where = imported.path.relative_to(REPO_ROOT) if imported.path.is_relative_to(REPO_ROOT) else imported.path
    return f"{where}:{imported.line}: {imported.module} imports {imported.target} ({why})"


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module_name(path)) for path in sources(SERVICES)}
    assert packages <= LAYERS.keys(), f"place these packages in LAYERS: {sorted(packages - LAYERS.keys())}"


def layer_offences(imports: Iterable[Import]) -> list[str]:
    offences = []
    for imported in imports:
        importer, target = package_of(imported.module), package_of(imported.target)
        if importer == target or LAYERS[target] < LAYERS[importer] or (imported.module, imported.target) in ALLOWED:
            continue
        below = sorted(p for p, rank in LAYERS.items() if rank < LAYERS[importer])
        offences.append(describe(imported, f"{importer} may import only from {', '.join(below) or 'itself'}"))
    return offences


def test_services_import_only_from_the_layers_below() -> None:
    offences = layer_offences(services_imports(SERVICES))
    assert not offences, "imports against the layer order:\n" + "\n".join(offences)


def test_the_kernels_import_nothing_from_services() -> None:
    offences = [describe(imported, "kvmesh_kernels stands apart from services")
                for imported in services_imports(KERNELS)]
    assert not offences, "\n".join(offences)


def test_each_allowed_import_is_still_there() -> None:
    """An exception whose import is gone goes too, so that the list stays the list of real ones."""
    found = {(imported.module, imported.target) for imported in services_imports(SERVICES)}
    assert ALLOWED.keys() <= found, f"no longer imported, remove from ALLOWED: {sorted(ALLOWED.keys() - found)}"


def test_an_import_upwards_is_named_wherever_it_hides(tmp_path: Path) -> None:
    """Under TYPE_CHECKING and inside a function, as much as at the top; same package is fine."""
    source = tmp_path / "fake.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "from services.engine import request\n"
                      "if TYPE_CHECKING:\n"
                      "    from services import gateway\n"
                      "def f():\n"
                      "    import services.processor.client\n")
    imports = list(imports_of(source, "services.engine.fake"))
    assert [(i.line, i.target) for i in imports] == [
        (1, "typing"), (2, "services.engine.request"), (4, "services.gateway"), (6, "services.processor.client")]
    offences = layer_offences(i for i in imports if i.target.startswith("services."))
    assert len(offences) == 2
    assert "fake.py:4: services.engine.fake imports services.gateway (engine may import only from common, " \
           "prefix_index, worker)" in offences[0]
    assert ":6: services.engine.fake imports services.processor.client" in offences[1]
