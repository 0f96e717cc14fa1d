"""The layer rule: a module imports only its own package and the layers below it, without
a cycle; cluster/ never imports mlx, node/ never paramiko (docs/architecture.md)."""

import ast
from pathlib import Path

from tests.support.processes import ROOT


def imports(path: Path) -> set[str]:
    """The absolute module names a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
                names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            else:
                names = [node.module]
            found.update(names)
    return found


LAYERS = (  # lowest first: a module imports its own package and the layers below it only
    ("cluster.core",),  # plain data and logic; node/ imports these and nothing else of cluster
    ("cluster.job",),  # running one job
    ("cluster.serve", "cluster.rig"),  # side by side: neither imports the other
    ("cluster.commands",),
)
NODE_LAYERS = (  # the rank's packages, lowest first (docs/architecture.md)
    ("node.rank",),  # the group, share_object, the watchdog, memory limits, links
    ("node.model",),  # this rank's share of the model
    ("node.cache",),  # the prompt cache: snapshots, the disk tier, handoffs, rollback
    ("node.decode",),  # one answer: template, loop, sampling, grammar, text
    ("node.jobs",),  # what a command does on a rank
    ("node.__main__",),  # one rank's life: a job from the table
)


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer, package) of a module; None for a package root."""
    for level, packages in enumerate(layers):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return level, package
    return None


def test_each_module_lives_in_a_layer_and_imports_only_down():
    for path in [*ROOT.glob("cluster/**/*.py"), *ROOT.glob("node/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = {d for d in imports(path) if d.startswith("cluster.")}
        if name.startswith("node"):
            wrong = [d for d in deps if not d.startswith("cluster.core")]
            assert not wrong, f"{name} imports {wrong}: node/ may import cluster.core only"
            if name in ("node", "node.__init__"):
                continue
            here = layer_of(name, NODE_LAYERS)
            assert here is not None, f"{name} is in no layer: put it in a package of NODE_LAYERS"
            for d in {d for d in imports(path) if d.startswith("node.")}:
                there = layer_of(d, NODE_LAYERS)
                if there is None or there[1] == here[1]:
                    continue
                assert there[0] < here[0], f"{name} ({here[1]}) imports {d} ({there[1]})"
            continue
        if name == "cluster":
            continue
        here = layer_of(name)
        assert here is not None, f"{name} is in no layer: put it in a package of LAYERS"
        for d in deps:
            there = layer_of(d)
            if there is None or there[1] == here[1]:
                continue
            assert there[0] < here[0], f"{name} (layer {here[1]}) imports {d} (layer {there[1]})"


def test_layers_import_only_down_and_without_a_cycle():
    modules = {}
    for path in [*ROOT.glob("cluster/**/*.py"), *ROOT.glob("node/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = imports(path)
    for name, deps in modules.items():
        if name.startswith("cluster"):
            assert not any(d == "mlx" or d.startswith(("mlx.", "mlx_lm", "node")) for d in deps), (
                name
            )
        else:
            assert not any(d.startswith("paramiko") for d in deps), name
    graph = {
        name: {m for d in deps for m in modules if d == m or d.startswith(m + ".")} - {name}
        for name, deps in modules.items()
    }
    # a package's __init__ may gather its submodules; the edges that matter run between modules
    graph = {n: {d for d in ds if not n.startswith(d + ".")} for n, ds in graph.items()}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph[n]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, n, d])
            if d not in state:
                visit(d, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
