"""The package's layers hold: each imports only the layers below it, no cycles, no private names.

``docs/architecture.md`` ("Layers") draws them. The check reads the sources (absolute and
relative imports, at module level and inside functions; ``if TYPE_CHECKING:`` blocks are
skipped, they run only under a type checker) and compares every project import with
:data:`ALLOWED`. A package's ``__init__`` is imported by every import of a module below it, so
it counts as imported, and a package face that imports its own children at import time would
make a cycle: the faces re-export lazily instead (``lazy_loader``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> the package it is installed as (pyproject.toml's ``package-dir``).
SOURCE_ROOTS = {
    "fuser": "onnx_moe_fuse",
    "rewrites": "onnx_moe_fuse.rewrites",
    "kernels": "onnx_moe_fuse.kernels",
}

P = "onnx_moe_fuse"
#: Layer (a module prefix) -> the prefixes it may import. The longest matching layer applies.
#: A prefix names a module and everything below it; ``=name`` names exactly that module.
ALLOWED: dict[str, tuple[str, ...]] = {
    # the kernel runtime is usable alone: it imports nothing of the rest of the project
    f"{P}.kernels": (f"{P}.kernels",),
    # the com.microsoft op contract and the error types are leaves
    f"{P}.contract": (f"{P}.contract",),
    f"{P}.errors": (),
    # rules: the contract and the shared graph helpers only; each family on its own
    f"{P}.rewrites": (f"={P}.rewrites",),
    f"{P}.rewrites.graph": (f"{P}.contract", f"{P}.rewrites.graph"),
    f"{P}.rewrites.moe": (f"{P}.contract", f"{P}.rewrites.graph", f"{P}.rewrites.moe"),
    f"{P}.rewrites.qkv": (f"{P}.contract", f"{P}.rewrites.graph", f"{P}.rewrites.qkv"),
    f"{P}.rewrites.canonical": (
        f"{P}.contract",
        f"{P}.rewrites.graph",
        f"{P}.rewrites.canonical",
    ),
    # model IO: errors, and the weight-sink type it implements
    f"{P}.io": (f"{P}.errors", f"{P}.io", f"{P}.rewrites.graph.weight_sink"),
    # the pipeline: rules, contract, errors (never the verifier or the kernels)
    f"{P}.pipeline": (f"{P}.contract", f"{P}.errors", f"{P}.pipeline", f"{P}.rewrites"),
    # verification: the kernels' public face only, the contract, model IO, its oracles
    f"{P}.verify": (
        f"={P}.kernels",
        f"{P}.contract",
        f"{P}.errors",
        f"{P}.io",
        f"{P}.verify",
    ),
    # the oracles are written apart from the kernels they check
    f"{P}.verify.oracles": (f"{P}.contract", f"{P}.verify.oracles"),
    # samples: models and their quantisation (the oracles' numpy), nothing of the fuser
    f"{P}.samples": (f"{P}.contract", f"{P}.samples", f"{P}.verify.oracles"),
    # the fronts see everything: the package root, the API, the command line
    f"={P}": (P,),
    f"{P}.api": (P,),
    f"{P}.cli": (P,),
    f"{P}.cli_options": (P,),
    f"{P}.cli_summary": (P,),
    f"{P}.cli_verify": (P,),
    f"{P}.streaming_io": (P,),
    # progress on stderr and the report's run section: a front-level helper, imports nothing
    # of the project (the pipeline takes it as an observer and never imports it)
    f"{P}.progress": (),
}


#: The kernels' public face: the one module of the kernel package other layers may import.
KERNELS = f"{P}.kernels"


def _matches(prefix: str, module: str) -> bool:
    if prefix.startswith("="):
        return module == prefix[1:]
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str | None:
    """The layer :data:`ALLOWED` files ``module`` under (the longest matching prefix)."""
    hits = [layer for layer in ALLOWED if _matches(layer, module)]
    return max(hits, key=lambda layer: len(layer.lstrip("="))) if hits else None


def source_modules(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """Module name -> (source text, is a package ``__init__``), over the three source roots."""
    out = {}
    for folder, package in SOURCE_ROOTS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join([package, *parts])] = (path.read_text(), is_package)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for inner in ast.walk(node)}
    return skipped


def project_imports(
    module: str, text: str, is_package: bool, modules: set[str]
) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for each project import of a module."""
    tree = ast.parse(text)
    skipped = _type_checking_nodes(tree)
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith(P)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != P and not target.startswith(P + "."):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.append((sub, None, node.lineno))
                else:
                    out.append((target, alias.name, node.lineno))
    return out


def import_graph(sources: dict[str, tuple[str, bool]]) -> nx.DiGraph:
    """Who imports whom, each module also importing the packages above it (their ``__init__``)."""
    graph = nx.DiGraph()
    names = set(sources)
    for module, (text, is_package) in sources.items():
        graph.add_node(module)
        for target, _, _ in project_imports(module, text, is_package, names):
            if target in names and target != module:
                graph.add_edge(module, target)
        parts = module.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in names:
                graph.add_edge(module, parent)
    return graph


def layer_violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import against the layers, every private name imported from another module."""
    names = set(sources)
    problems = []
    for module, (text, is_package) in sorted(sources.items()):
        layer = layer_of(module)
        if layer is None:
            problems.append(f"{module}: in no layer (add it to ALLOWED)")
            continue
        for target, name, line in project_imports(module, text, is_package, names):
            if not any(_matches(prefix, target) for prefix in ALLOWED[layer]):
                problems.append(f"{module}:{line} imports {target} ({layer} may not)")
            elif _matches(KERNELS, target) and target != KERNELS and layer != KERNELS:
                problems.append(
                    f"{module}:{line} imports {target}, a kernel internal (use {KERNELS})"
                )
            if name is not None and name.startswith("_") and not name.startswith("__"):
                problems.append(f"{module}:{line} imports the private name {target}.{name}")
    return list(dict.fromkeys(problems))


def import_cycles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """The import cycles, package ``__init__`` modules counted."""
    graph = import_graph(sources)
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


# ---------------------------------------------------------------------------------------------


def test_every_import_follows_the_layers():
    assert layer_violations(source_modules()) == []


def test_there_is_no_import_cycle():
    assert import_cycles(source_modules()) == []


@pytest.mark.parametrize(
    ("module", "plant", "expected"),
    [
        ("onnx_moe_fuse.kernels.device", "from onnx_moe_fuse.pipeline import compose", "kernels"),
        (
            "onnx_moe_fuse.rewrites.moe.emit",
            "from onnx_moe_fuse.verify.oracles import quant",
            "rewrites.moe",
        ),
        ("onnx_moe_fuse.contract.targets", "from ..errors import OptionError", "contract"),
        ("onnx_moe_fuse.verify.evaluator", "import onnx_moe_fuse.kernels.planner", "verify"),
        (
            "onnx_moe_fuse.pipeline.report",
            "from onnx_moe_fuse.rewrites.graph.facts import _x",
            "private name",
        ),
        ("onnx_moe_fuse.rewrites.graph.facts", "from onnx_moe_fuse import fuse", "rewrites.graph"),
    ],
)
def test_a_planted_wrong_way_import_is_caught(module, plant, expected):
    sources = source_modules()
    before = set(layer_violations(sources))
    text, is_package = sources[module]
    sources[module] = (text + f"\n\ndef _planted():\n    {plant}\n", is_package)
    problems = [p for p in layer_violations(sources) if p not in before]
    assert problems, plant
    assert all(p.startswith(module + ":") for p in problems), problems
    assert expected in problems[0]


def test_a_package_face_importing_its_children_is_a_cycle():
    sources = source_modules()
    text, _ = sources["onnx_moe_fuse.pipeline"]
    sources["onnx_moe_fuse.pipeline"] = (
        text + "\nfrom onnx_moe_fuse.pipeline.compose import fusion_pipeline\n",
        True,
    )
    assert any("onnx_moe_fuse.pipeline" in cycle for cycle in import_cycles(sources))


def _loaded_project_modules(statement: str) -> list[str]:
    """The project modules ``python -X importtime -c statement`` loads, in load order."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = []
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name == P or name.startswith(P + "."):
                loaded.append(name)
    return loaded


@pytest.mark.parametrize(
    ("statement", "may_load"),
    [
        ("import onnx_moe_fuse.kernels.runtime", (f"={P}", f"{P}.kernels")),
        (
            "import onnx_moe_fuse.rewrites.moe.layer_rules",
            (f"={P}", f"{P}.contract", f"{P}.rewrites"),
        ),
        ("import onnx_moe_fuse.contract", (f"={P}", f"{P}.contract")),
        ("import onnx_moe_fuse.verify.oracles.moe", (f"={P}", f"{P}.contract", f"{P}.verify")),
    ],
)
def test_a_layer_imports_on_its_own(statement, may_load):
    loaded = _loaded_project_modules(statement)
    assert loaded, "importtime reported no project module: the check would pass vacuously"
    strays = [m for m in loaded if not any(_matches(prefix, m) for prefix in may_load)]
    assert strays == [], f"{statement} loads {strays}"


def test_the_verify_oracles_do_not_load_the_verifier():
    loaded = _loaded_project_modules("import onnx_moe_fuse.verify.oracles.moe")
    assert "onnx_moe_fuse.verify.checker" not in loaded
    assert not any(m.startswith(f"{P}.kernels") for m in loaded)
