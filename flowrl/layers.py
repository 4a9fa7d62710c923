"""The layer order of flowrl: a module may import only from its own layer or a layer below.

``LAYERS`` lists the layers bottom to top; each is a name and the module-name prefixes it owns.
A module belongs to the layer of its most specific (longest) matching prefix (a prefix such as
``flowrl.data.x`` would file that module apart from the rest of ``flowrl.data``).
``tests/test_layers.py`` walks every module's imports (module level and inside functions) and
fails on any import from a higher layer.
Registry targets (``"module:attr"`` strings) are data, not imports, and are not checked.

Why this order: the bottom layers are pure helpers and math that any part may use; components
(models, rewards, data) implement the seams; above them, a prompt's split into what the policy and
the rewards take (``flowrl.conditions``) and the reward call (``flowrl.scoring``), which read the
data's prompt items (the offline dataset is handed its reward call, as its sampler); the trained
model (trained parameters, EMA and reference, checkpoint formats) works on any model, and the
distribution strategy (``flowrl.distributed``) prepares, saves and loads it; samplers drive
components; builders and updates assemble them from a config; the trainers run everything; the
application layer is the command line and the benchmarks. Every package sits whole in one layer.

Besides the order, the module graph has no cycles (:func:`import_cycles`), counting imports inside
functions too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("utils", ("flowrl.utils", "flowrl.faults", "flowrl.registry", "flowrl.seeding", "flowrl.layers",
               "flowrl.errors", "flowrl.options")),
    ("math", ("flowrl.schedules", "flowrl.sde", "flowrl.noise", "flowrl.ode_solvers", "flowrl.types",
              "flowrl.diagnostics", "flowrl.losses", "flowrl.advantages", "flowrl.structures", "flowrl.media")),
    ("components", ("flowrl.pipelines", "flowrl.rewards", "flowrl.data", "flowrl.quant", "flowrl.recipes")),
    ("scoring", ("flowrl.conditions", "flowrl.scoring")),
    ("training", ("flowrl.trainable", "flowrl.checkpoints")),
    ("distributed", ("flowrl.distributed",)),
    ("rollout", ("flowrl.rollout",)),
    ("builders", ("flowrl.builders", "flowrl.updates")),
    ("trainers", ("flowrl.trainers",)),
    ("application", ("flowrl.cli", "flowrl.sampling_cli", "flowrl.dataset_cli", "flowrl.export", "flowrl.bench",
                     "flowrl.digits_report", "flowrl.shapes_report", "flowrl.pretrain_cli", "flowrl.__main__",
                     "flowrl.plan", "flowrl.smoke", "flowrl.command_line", "flowrl.eval")),
]
ROOT = "flowrl"  # the bare package (only __version__): importable from every layer


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> Optional[int]:
    """Index in ``LAYERS`` of the layer owning ``module`` (most specific prefix wins), or None
    for modules outside flowrl (stdlib, torch, ...)."""
    if module == ROOT:
        return 0
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _matches(module, p) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def layer_name(index: int) -> str:
    return LAYERS[index][0]


# ---------------------------------------------------------------- the import walker (used by tests/test_layers.py)
# source folder (relative to the repository root) -> the package it is installed as
SOURCE_ROOTS = {"flowrl": "flowrl", "pipelines": "flowrl.pipelines", "rewards": "flowrl.rewards"}


@dataclass(frozen=True)
class Edge:
    """``module`` imports ``target`` at ``line``."""

    module: str
    target: str
    line: int


def discover(repo_root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under the source roots: dotted name -> (file, is_package)."""
    out: dict[str, tuple[Path, bool]] = {}
    for folder, package in SOURCE_ROOTS.items():
        base = Path(repo_root) / folder
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base).with_suffix("").parts
            is_pkg = rel[-1] == "__init__"
            parts = rel[:-1] if is_pkg else rel
            out[".".join((package, *parts))] = (f, is_pkg)
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, is_package: bool = False,
               known: Optional[set[str]] = None) -> Iterator[Edge]:
    """All imports in ``source`` (module level, in functions, in ``if`` / ``try`` blocks) as edges.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a known module
    (``known``), else of ``pkg``."""
    known = known or set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield Edge(module, sub if sub in known else base, node.lineno)


def upward_imports(edges: Iterator[Edge]) -> list[str]:
    """One message per edge that goes from a layer to a higher one (or touches an unlayered flowrl module)."""
    bad = []
    for e in edges:
        src, dst = layer_of(e.module), layer_of(e.target)
        if src is None:
            bad.append(f"{e.module} is in no layer: add its prefix to flowrl.layers.LAYERS")
        elif dst is None and (e.target == ROOT or e.target.startswith(ROOT + ".")):
            bad.append(f"{e.module}:{e.line} imports {e.target}, which is in no layer: add it to flowrl.layers.LAYERS")
        elif dst is not None and dst > src:
            bad.append(f"{e.module}:{e.line} (layer {layer_name(src)}) imports {e.target} "
                       f"(layer {layer_name(dst)}, above it)")
    return bad


def module_graph(repo_root: Path) -> dict[str, set[str]]:
    """Every flowrl module -> the flowrl modules it imports (module level and inside functions). An
    import of a name resolves to the longest known module it names (``flowrl.rollout.ode``, or the
    package ``flowrl.rollout`` for ``from flowrl.rollout import GroupSampler``); self-imports drop out."""
    mods = discover(repo_root)
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        for e in imports_of(path.read_text(), name, is_pkg, known):
            target = e.target
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def adapter_imports(graph: dict[str, set[str]], adapters: set[str], package: str = "flowrl.pipelines") -> list[str]:
    """One message per module of ``package`` that imports one of the ``adapters`` (the modules the
    pipelines registry points at) other than itself: adapters share code only through modules of the
    package that no adapter owns (packing, published components, family bases), so neither an adapter
    nor such a shared module depends on an adapter."""
    return [f"{m} imports the adapter {t}" for m in sorted(graph) if m == package or m.startswith(package + ".")
            for t in sorted(graph[m] & adapters) if t != m]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (each sorted): every
    set of modules that import each other, directly or around a loop. Empty when the graph is a DAG."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm, iterative over each node's successors
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, succ = work[-1]
            nxt = next(succ, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def check_tree(repo_root: Path) -> list[str]:
    """Every upward import in the source tree under ``repo_root`` (empty when the layering holds)."""
    mods = discover(repo_root)
    known = set(mods)
    bad: list[str] = []
    for name, (path, is_pkg) in mods.items():
        bad += upward_imports(imports_of(path.read_text(), name, is_pkg, known))
    return bad
