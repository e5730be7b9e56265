"""The package's imports point one way, down the layers the README's Layout
table names, and no module imports itself back through another."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sqla_jobq"

# Top-level modules and subpackages of sqla_jobq, lowest layer first.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"schema", "db", "logs", "units"}),
    ("values", {"job", "traceparent"}),
    (
        "builders",
        {
            "statements",
            "queue_statements",
            "schedule_statements",
            "vacuum_statements",
            "reindex_statements",
            "presence",
            "migrations",
        },
    ),
    (
        "execution",
        {"client", "registry", "periodic", "driver", "direct", "notify", "waiting", "errors"},
    ),
    (
        "worker",
        {
            "worker",
            "attempt",
            "execute",
            "capture",
            "finisher",
            "joblog",
            "claim_cursor",
            "pickup",
            "vacuuming",
            "reindexing",
            "archiving",
            "leases",
            "loop_watch",
            "threads",
            "process",
            "ready",
            "transactions",
            "scheduler",
            "observe",
            "metrics",
            "otel",
            "instrument",
            "testing",
        },
    ),
    (
        "tools",
        {
            "doctor",
            "dashboard",
            "embedded",
            "demo",
            "demo_screen",
            "schedule_report",
            "worker_report",
        },
    ),
    ("command", {"cli", "loader", "__main__"}),
]
RANK = {name: rank for rank, (_, names) in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, *, top_level_only: bool) -> set[str]:
    """The sqla_jobq modules `path` imports (absolute names)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    # Module level includes `if TYPE_CHECKING:` blocks: a cycle only the type
    # checker walks is still a cycle in the design.
    top = [*tree.body, *(n for s in tree.body if isinstance(s, ast.If) for n in s.body)]
    nodes = top if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
                if node.module is None:
                    found |= {f"{target}.{alias.name}" for alias in node.names}
                else:
                    found.add(target)
            elif node.module and node.module.startswith("sqla_jobq"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sqla_jobq")}
    return found


def unit(module: str) -> str:
    """`sqla_jobq.x.y` -> `x`: the top-level module or subpackage it belongs to."""
    return module.split(".")[1]


def sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "versions" not in p.parts]


def test_every_module_has_a_layer() -> None:
    units = {unit(module_name(p)) for p in sources() if module_name(p) != "sqla_jobq"}
    assert units - set(RANK) == set(), "add the new modules to LAYERS and to the README"


def test_imports_never_point_up_a_layer() -> None:
    upward = []
    for path in sources():
        me = module_name(path)
        if me == "sqla_jobq":
            continue  # the package's __init__ re-exports the public names
        for target in imported(path, top_level_only=False):
            if target == "sqla_jobq" or unit(target) == unit(me):
                continue
            if RANK[unit(target)] > RANK[unit(me)]:
                upward.append(f"{me} -> {target}")
    assert upward == []


def test_no_module_imports_itself_back() -> None:
    graph = {module_name(p): imported(p, top_level_only=True) for p in sources()}
    modules = set(graph)

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in graph.items()}
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []
