"""Packaging: kernel folders reach the wheel, every import is declared, private APIs are pinned.

The rules use private parts of onnxscript's rewriter (``_basics``, ``_matcher``,
``_pattern_ir``), so pyproject pins onnxscript to the tested minor; the tests below fail when
those names or signatures change (a new onnxscript: check the rules, then move the pin).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from onnx_moe_fuse.kernels.runtime import PACKAGE_ROOT

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("fuser", "rewrites", "kernels")
#: Import names that are not the distribution's name on PyPI.
DISTRIBUTION = {"google": "protobuf", "onnx_ir": "onnx-ir", "yaml": "pyyaml"}
#: Imported only where the "test" extra installs them (each import sits in a try or a function).
OPTIONAL = {"onnxruntime"}


def _config() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement_names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements
    }


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> files importing it, over the package sources (absolute imports)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in stdlib and top != "onnx_moe_fuse":
                        found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_every_kernel_folder_is_a_listed_package():
    listed = set(_config()["tool"]["setuptools"]["packages"])
    folders = {p.name for p in PACKAGE_ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    missing = {f"onnx_moe_fuse.kernels.{name}" for name in folders} - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_every_imported_package_is_declared():
    config = _config()["project"]
    declared = _requirement_names(config["dependencies"])
    extras = _requirement_names(sum(config.get("optional-dependencies", {}).values(), []))
    imports = _third_party_imports()
    assert "ml_dtypes" in imports and "onnxscript" in imports  # the scan sees real imports
    missing = {
        DISTRIBUTION.get(top, top).lower().replace("_", "-"): files[0]
        for top, files in imports.items()
        if DISTRIBUTION.get(top, top).lower().replace("_", "-")
        not in (declared | (extras if top in OPTIONAL else set()))
    }
    assert not missing, f"declare in pyproject.toml [project] dependencies: {missing}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_onnxscript_is_pinned_to_the_tested_minor():
    (pin,) = [r for r in _config()["project"]["dependencies"] if r.startswith("onnxscript")]
    low, high = re.fullmatch(r"onnxscript>=(\d+\.\d+)\.\d+,<(\d+\.\d+)", pin).groups()
    installed = ".".join(metadata.version("onnxscript").split(".")[:2])
    assert installed == low, f"tests run with onnxscript {installed}, pyproject pins {pin}"
    major, minor = map(int, low.split("."))
    assert high == f"{major}.{minor + 1}", f"pin one minor: {pin}"


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_private_onnxscript_api_the_rules_use_is_unchanged():
    from onnxscript.rewriter import _basics, _matcher, _pattern_ir, pattern

    assert pattern.MatchingTracer is _basics.MatchingTracer
    assert pattern.SimplePatternMatcher is _matcher.SimplePatternMatcher
    assert pattern.MatchStatus is _basics.MatchStatus and pattern.MatchResult is _basics.MatchResult
    assert issubclass(_basics.MatchFailureError, Exception)
    assert {"NO_MATCH", "CONDITION_FAILED", "SUCCESS"} <= set(_basics.MatchStatus.__members__)
    expected = {
        _basics.MatchingTracer.log: ["self", "rule", "container", "node", "match_result", "status"],
        _matcher.SimplePatternMatcher.match: [
            "self",
            "model",
            "graph_or_function",
            "node",
            "verbose",
            "remove_nodes",
            "tracer",
        ],
        _matcher.SimplePatternMatcher._init_match: ["self", "verbose"],
        _matcher.SimplePatternMatcher._match_node: ["self", "pattern_node", "node"],
        _matcher.SimplePatternMatcher._get_output_values: ["self"],
        _matcher._valid_to_replace: ["matched_nodes", "output_values"],
        _pattern_ir._to_graph_pattern: ["pattern_constructor"],
        _basics.MatchResult.fail: ["self", "reason", "failure_source"],
        _basics.MatchResult.enter_new_match: ["self"],
        _basics.MatchResult.merge_current_match: ["self"],
        _basics.MatchResult.abandon_current_match: ["self"],
    }
    changed = {
        f.__qualname__: _parameters(f) for f, want in expected.items() if _parameters(f) != want
    }
    assert not changed, f"onnxscript's private matcher API changed: {changed}"
    result = _basics.MatchResult()
    assert all(hasattr(result, name) for name in ("outputs", "nodes", "bindings", "reason"))


def test_the_private_matcher_still_matches():
    """Behaviour, not only names: a graph pattern from ``_to_graph_pattern`` matches a node."""
    import onnx_ir as ir
    from onnxscript.rewriter import _pattern_ir, pattern

    def relu_of_add(op, x, y):
        return op.Relu(op.Add(x, y))

    graph_pattern = _pattern_ir._to_graph_pattern(relu_of_add)
    matcher = pattern.SimplePatternMatcher(graph_pattern)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    add = ir.node("Add", [x, y])
    relu = ir.node("Relu", add.outputs)
    graph = ir.Graph([x, y], relu.outputs, nodes=[add, relu], opset_imports={"": 21})
    result = matcher.match(None, graph, relu, remove_nodes=False)
    assert result and [n.op_type for n in result.nodes] == ["Relu", "Add"]
    miss = matcher.match(None, graph, add, remove_nodes=False)
    assert not miss
