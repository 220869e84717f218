"""Tiny MoE layers with a hand-written activation (or router softmax), for the behaviour tests.

:func:`with_activation` builds a layer with the spelling generator (``tests/spellings``) and
replaces the nodes between FC1's output(s) and what FC2 reads (``act``) by the ones ``write``
writes with :class:`Ops`; :func:`fuse_and_compare` fuses it and compares the fused model with
ORT CPU on the original (fresh random tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from spellings.build import build_case
from spellings.strategies import SMALL_BASE

from onnx_moe_fuse import fuse
from onnx_moe_fuse.contract.ops import ACTIVATION_TYPES
from onnx_moe_fuse.rewrites.moe.behaviour.activation import prove_activation
from onnx_moe_fuse.rewrites.moe.behaviour.region import elementwise_region

BASE = replace(SMALL_BASE, seed=11)
#: The FC1 outputs of each base activation (what the new activation reads).
SOURCES = {
    "relu": ("fc1_out",),
    "swiglu_separate": ("fc1_gate_out", "fc1_up_out"),
    "swiglu_slice": ("fc1_out",),
    "swiglu_oss": ("fc1_out",),
}


class Ops:
    """Writes nodes with fresh output names: ``ops.Mul(a, b)``, ``ops.c(1.0)`` for a constant."""

    def __init__(self, prefix: str = "act") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.prefix = prefix
        self.count = 0

    def _name(self) -> str:
        self.count += 1
        return f"{self.prefix}_v{self.count}"

    def c(self, value, dtype=np.float32) -> str:
        """A constant initializer (a scalar, or an array)."""
        name = self._name()
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def i64(self, *values: int) -> str:
        return self.c(list(values), np.int64)

    def node(self, op: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs):
        names = [self._name() for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def __getattr__(self, op: str) -> Callable[..., str]:
        if not op[:1].isupper():
            raise AttributeError(op)
        return lambda *inputs, **attrs: self.node(op, *inputs, **attrs)


def _activation_nodes(
    graph: onnx.GraphProto, sources: tuple[str, ...], target: str = "act"
) -> set[int]:
    """Indices of the nodes computing ``target`` from ``sources``."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output}
    out, stack = set(), [target]
    while stack:
        v = stack.pop()
        if v in sources or v not in producer or producer[v] in out:
            continue
        out.add(producer[v])
        stack.extend(graph.node[producer[v]].input)
    return out


def with_activation(
    write: Callable[..., str], base: str = "relu", opset: int = 21, **changes
) -> onnx.ModelProto:
    """A layer (``base`` activation's FC1) whose activation ``write(ops, *sources)`` writes."""
    return with_region(write, "act", SOURCES[base], activation=base, opset=opset, **changes)


def with_region(
    write: Callable[..., str], target: str, sources: tuple[str, ...], opset: int = 21, **changes
) -> onnx.ModelProto:
    """A generated layer whose nodes computing ``target`` from ``sources`` ``write`` writes.

    E.g. the router softmax: ``target="router_probs", sources=("router_logits",)``; the top-k
    weights: ``target="routing_weights", sources=("topk_0",)``.
    """
    case = replace(BASE, **changes)
    if opset != case.opset_version:
        case = replace(case, opset_version=opset)
    model = build_case(case).model
    graph = model.graph
    drop = _activation_nodes(graph, sources, target)
    ops = Ops(target)
    result = write(ops, *sources)
    ops.nodes.append(helper.make_node("Identity", [result], [target]))
    at = min(drop)
    kept = [n for i, n in enumerate(graph.node) if i not in drop]
    new = kept[:at] + ops.nodes + kept[at:]
    del graph.node[:]
    graph.node.extend(new)
    graph.initializer.extend(ops.inits)
    read = {i for n in graph.node for i in n.input}
    unread = [t for t in graph.initializer if t.name not in read]
    for t in unread:
        graph.initializer.remove(t)
    if any(n.domain == "com.microsoft" for n in ops.nodes):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.checker.check_model(model)
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def standalone(write: Callable[..., str], widths: tuple[int, ...], opset: int = 21) -> ir.Model:
    """Just the activation ``write`` writes, on graph inputs ``s0, s1, ...`` ``[T, width]``."""
    ops = Ops()
    names = [f"s{i}" for i in range(len(widths))]
    out = write(ops, *names)
    ops.nodes.append(helper.make_node("Identity", [out], ["act"]))
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", w])
        for n, w in zip(names, widths, strict=True)
    ]
    graph = helper.make_graph(
        ops.nodes, "act", inputs, [helper.make_tensor_value_info("act", TensorProto.FLOAT, None)],
        ops.inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return ir.from_proto(helper.make_model(graph, opset_imports=opsets))


def prove_standalone(
    write: Callable[..., str], widths: tuple[int, ...], inter: int, dtype=np.float32
) -> tuple[str, np.ndarray, tuple]:
    """:func:`prove_activation` of the standalone activation (its sources: the graph inputs).

    The columns come back numbered over the inputs in their order (``s0``'s first).
    """
    model = standalone(write, widths)
    inputs = list(model.graph.inputs)
    act = model.graph.outputs[0]
    region = elementwise_region(act, lambda v: v in inputs, "the activation")
    assert region is not None
    order = [inputs.index(v) for v in region.sources]
    got = prove_activation(
        region, [widths[i] for i in order], 2, np.dtype(dtype), inter, ACTIVATION_TYPES
    )
    starts = np.cumsum([0, *widths])
    renumber = np.concatenate([starts[i] + np.arange(widths[i]) for i in order])
    return got[0], renumber[got[1]], got[2]


@dataclass
class Compared:
    """The fused model's op/attributes, the near misses, and the error against ORT."""

    ops: list[str]
    attributes: dict
    reasons: list[str]
    error: float
    unchanged: bool


def fuse_and_compare(model: onnx.ModelProto, seed: int = 0, scale: float = 1.0) -> Compared:
    """Fuse ``model``; when something fused, the max relative error against ORT on the original."""
    source = model.SerializeToString()
    result = fuse(model)
    fused = [n for n in result.model.graph.node if n.domain == "com.microsoft"]
    reasons = [m["reason"] for m in result.report.near_misses]
    attrs = {}
    error = float("nan")
    if fused:
        attrs = {a.name: helper.get_attribute_value(a) for a in fused[0].attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        rng = np.random.default_rng(seed)
        a, b = session(model), session(result.model)
        dims = model.graph.input[0].type.tensor_type.shape.dim
        h = dims[-1].dim_value
        error = 0.0
        for tokens in (3, 7):
            shape = (tokens, h) if len(dims) == 2 else (2, tokens, h)
            x = (scale * rng.standard_normal(shape)).astype(np.float32)
            want, got = a.run(None, {"x": x})[0], b.run(None, {"x": x})[0]
            err = np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
            error = max(error, float(err))
    return Compared(
        [n.op_type for n in fused],
        attrs,
        reasons,
        error,
        result.model.SerializeToString() == source,
    )


__all__ = [
    "prove_standalone",
    "standalone",
    "with_region",
    "BASE",
    "Compared",
    "Ops",
    "TensorProto",
    "fuse_and_compare",
    "session",
    "with_activation",
]
