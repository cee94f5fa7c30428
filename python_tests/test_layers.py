"""The layer order of ``moe_dispatch`` (:data:`LAYERS`, drawn in docs/development.md), read from the
source with ``ast``: no module imports a layer above its own, the two transports do not import each
other, no modules import each other in a circle, and no module is longer than :data:`MAX_LINES`.

What counts as an import: every ``import`` and ``from ... import`` of a moe_dispatch module, at
module level or inside a function, relative or absolute (``from . import x`` names the module ``x``
when there is one, else the package's ``__init__``). The implicit import of a module's parent
packages does not count (``transport/base.py`` is below the transports that
``transport/__init__.py`` registers), nor does an import by string (``importlib.import_module``:
the package's lazy exports in ``moe_dispatch/__init__.py``).

An import under ``if TYPE_CHECKING:`` never runs: it must still respect the order (an annotation
depends on what it names) but may close a circle. A deferred import that loads an optional part on
first use is allowed only as listed in :data:`ON_DEMAND`, with its reason.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moe_dispatch"
MAX_LINES = 900

# Bottom to top: a module may import its own layer and the layers below. An entry is a module file
# or, ending in "/", a folder; the longest entry that matches a file gives its layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Imports no other layer. __init__ names its exports as strings (loaded on first use); _autoload
    # runs at interpreter start-up (the standard library only); overlap is torch autograd only.
    ("base", ("__init__.py", "_autoload.py", "errors.py", "topology.py", "overlap.py")),
    # Pure Python: the kernels' mirrored limits and layouts, the cost model, Config.
    ("kernel config", ("kernel_layout.py", "costmodel.py", "config.py")),
    ("semantics", ("semantics/", "reference.py")),  # reference.py: the oracle's public path
    ("extension", ("_ext.py",)),  # _C's loader and tensor wrappers
    ("ops", ("ops/",)),
    ("control", ("control/",)),
    ("transport contract", ("transport/base.py",)),
    ("transports", ("transport/torch_dist/", "transport/kernels/")),  # each other: see INDEPENDENT
    ("transport registry", ("transport/",)),  # transport/__init__.py: TRANSPORTS, the "auto" choice
    ("runtime", ("runtime/",)),
    ("buffer", ("buffer.py",)),
    # The Megatron backend, bottom to top: the version table, configure, the manager, the package's
    # wgrad deferral, what installs them (patches, Bridge); the package, cpu and schedule on top.
    ("megatron compat", ("megatron/compat.py",)),
    ("megatron config", ("megatron/config.py",)),
    ("megatron manager", ("megatron/manager.py",)),
    ("megatron delayed wgrad", ("megatron/delayed_wgrad.py",)),
    ("megatron backend", ("megatron/backend.py",)),
    ("megatron", ("megatron/",)),
    # Test helpers, above what they test (never tools); launch.py: testing.launch's public path.
    ("testing", ("testing/", "launch.py")),
    # The command-line tools run worlds (testing) with Megatron; env.py: tools.env's public path.
    ("tools", ("tools/", "env.py")),
)

# Entries of one layer that must not import each other.
INDEPENDENT = ({"transport/torch_dist/", "transport/kernels/"},)

# Deferred imports that load an optional part on first use (the import inside the function is the
# point): allowed against the order and left out of the circle check. (importer, imported): reason.
ON_DEMAND: dict[tuple[str, str], str] = {
    ("_autoload.py", "megatron/backend.py"): (
        "the start-up hook loads the backend when a MoELayer or Bridge first names it; nothing else of "
        "moe_dispatch (nor torch) is imported at start-up"
    ),
}


@dataclasses.dataclass(frozen=True)
class Import:
    """``source`` (a file under moe_dispatch/) imports ``target`` (another one) at ``line``."""

    source: str
    line: int
    target: str
    type_only: bool

    def __str__(self) -> str:
        return f"moe_dispatch/{self.source}:{self.line} imports moe_dispatch/{self.target}"


def modules() -> list[str]:
    """Every module file under moe_dispatch/, relative to it."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def module_file(parts: list[str]) -> str | None:
    """The file of the module ``moe_dispatch.<parts>`` (``[]``: the package), or None."""
    base = "/".join(parts)
    for candidate in (f"{base}/__init__.py" if base else "__init__.py", f"{base}.py"):
        if (PACKAGE / candidate).is_file():
            return candidate
    return None


def _targets(path: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The moe_dispatch module files ``node`` in ``path`` imports."""
    if isinstance(node, ast.Import):
        names = [alias.name.split(".") for alias in node.names]
        return {f for n in names if n[0] == "moe_dispatch" and (f := module_file(n[1:]))}
    if node.level:  # relative: from the package of path (a package's __init__ is in its package)
        package = path.split("/")[:-1]
        parts = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
    elif node.module and node.module.split(".")[0] == "moe_dispatch":
        parts = node.module.split(".")[1:]
    else:
        return set()
    found = {module_file([*parts, alias.name]) or module_file(parts) for alias in node.names}
    return {f for f in found if f is not None}


def _type_checking(test: ast.expr) -> bool:
    """Whether ``test`` is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
    return name == "TYPE_CHECKING"


def imports(path: str) -> list[Import]:
    """Every import of another moe_dispatch module in ``path``, in source order."""
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.extend(Import(path, node.lineno, t, type_only) for t in sorted(_targets(path, node)) if t != path)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse((PACKAGE / path).read_text(), filename=path), False)
    return found


def entry_of(path: str) -> tuple[int, str] | None:
    """``(layer index, entry)`` of the longest :data:`LAYERS` entry matching ``path``, or None."""
    matches = [
        (len(entry), index, entry)
        for index, (_, entries) in enumerate(LAYERS)
        for entry in entries
        if path == entry or (entry.endswith("/") and path.startswith(entry))
    ]
    return max(matches)[1:] if matches else None


def layer_of(path: str) -> int:
    return entry_of(path)[0]


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """Every import of a moe_dispatch module by another, by importer and line."""
    return tuple(i for path in modules() for i in imports(path))


def shortest_circle(edges: list[Import]) -> list[Import]:
    """One shortest circle through the first importer of ``edges`` (the imports of one strongly
    connected component), found breadth first."""
    start = edges[0].source
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for i in edges:
                if i.source == node and i.target not in came:
                    came[i.target] = i
                    following.append(i.target)
        if start in came:
            break
        frontier = following
    path = [came[start]]
    while path[-1].source != start:
        path.append(came[path[-1].source])
    return path[::-1]


def circles(edges: tuple[Import, ...]) -> list[list[Import]]:
    """Each circle among the modules: a strongly connected component of the imports that run (less
    :data:`ON_DEMAND`), as the imports inside it."""
    runs = [i for i in edges if not i.type_only and (i.source, i.target) not in ON_DEMAND]
    graph: dict[str, list[str]] = {}
    for i in runs:
        graph.setdefault(i.source, []).append(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, []):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component, member = set(), None
            while member != node:
                member = stack.pop()
                component.add(member)
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [[i for i in runs if i.source in c and i.target in c] for c in components]


def test_every_module_has_a_layer():
    assert [path for path in modules() if entry_of(path) is None] == []


def test_no_import_runs_up_a_layer():
    wrong = [
        f"{i} ({LAYERS[layer_of(i.target)][0]} is above {LAYERS[layer_of(i.source)][0]})"
        for i in all_imports()
        if layer_of(i.target) > layer_of(i.source) and (i.source, i.target) not in ON_DEMAND
    ]
    assert wrong == [], "imports against the layer order (docs/development.md):\n" + "\n".join(wrong)


def test_independent_entries_do_not_import_each_other():
    wrong = [
        str(i)
        for i in all_imports()
        for group in INDEPENDENT
        if entry_of(i.source)[1] in group and entry_of(i.target)[1] in group - {entry_of(i.source)[1]}
    ]
    assert wrong == [], "imports between independent parts of one layer:\n" + "\n".join(wrong)


def test_no_circles():
    found = circles(all_imports())
    text = "\n\n".join(
        "\n".join(["a circle:", *map(str, shortest_circle(c)), "the imports among its modules:", *map(str, c)])
        for c in found
    )
    assert found == [], f"modules that import each other in a circle (move code down a layer):\n{text}"


def test_on_demand_imports_exist():
    edges = {(i.source, i.target) for i in all_imports()}
    assert [pair for pair in ON_DEMAND if pair not in edges] == [], "stale ON_DEMAND entries: remove them"


def test_module_sizes():
    long = {p: n for p in modules() if (n := len((PACKAGE / p).read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by concern"
