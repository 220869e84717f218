"""Small facts about onnx-ir values and nodes that the MoE layer checks rely on.

Everything here reads the graph and never changes it. A helper that cannot establish a fact
returns ``None`` rather than guessing: a rule must refuse what it cannot prove (the refusal type
is :class:`onnx_moe_fuse.rewrites.graph.refusals.Refusal`).

* constants: :func:`const_array`, :func:`const_ints`, :func:`const_float`, :func:`node_axes`;
* static ranks and last dims of values: :func:`static_rank`, :func:`static_last_dim`;
* symbolic shapes (:class:`Dim`, :func:`reshape_dims`, :func:`value_dims`, :func:`lead_dims`,
  :func:`product`) live in :mod:`.symbolic_dims`, which reads the facts here;
* node labels for reports: :func:`label`, :func:`value_label`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

__all__ = [
    "label",
    "value_label",
    "const_array",
    "const_tensor",
    "const_ints",
    "const_float",
    "is_real",
    "attr_int",
    "attr_float",
    "attr_str",
    "node_axes",
    "normalize_axes",
    "static_rank",
    "static_last_dim",
    "default_opset",
]


def label(node: ir.Node | None) -> str:
    """A readable name for ``node``: its name, or ``OpType(first output name)`` if unnamed."""
    if node is None:
        return "<none>"
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else ""
    return f"{node.op_type}({out})"


def value_label(value: ir.Value | None) -> str:
    """A readable name for ``value`` (its name, or where it comes from)."""
    if value is None:
        return "<absent>"
    if value.name:
        return value.name
    return f"output {value.index()} of {label(value.producer())}"


def escape_from(
    nodes: Iterable[ir.Node], inside: Collection[ir.Node], skip: ir.Node | None = None
) -> tuple[ir.Node, ir.Value, ir.Node | None] | None:
    """The first output of ``nodes`` (``skip``'s excepted) that leaves the region ``inside``.

    ``(node, output, user)``: ``user`` is the first node outside ``inside`` that reads the output,
    or None when the output is a graph output. None when nothing escapes.
    """
    for node in nodes:
        if node is skip:
            continue
        for out in node.outputs:
            if out.is_graph_output():
                return node, out, None
            users = [u for u, _ in out.uses() if u not in inside]
            if users:
                return node, out, users[0]
    return None


def escape_where(user: ir.Node | None) -> str:
    """Where an escaping value goes, in words (:func:`escape_from`'s ``user``)."""
    if user is None:
        return "a graph output"
    return f"used by {user.op_type} '{label(user)}' outside the layer"


def default_opset(graph: ir.Graph | None) -> int:
    """The default-domain opset version of ``graph`` (latest known if not declared)."""
    if graph is not None:
        version = graph.opset_imports.get("")
        if version is not None:
            return int(version)
    return 21


# -- constants ---------------------------------------------------------------------------------


def const_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of ``value``'s initializer or Constant ``value`` attribute, unread; or None.

    For proofs that need a constant's type and shape but not its numbers (the expert weights:
    their bytes are read only when they are repacked). A graph input is not constant.
    """
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:
        return value.const_value
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    attr = node.attributes.get("value")
    if len(node.attributes) != 1 or attr is None or attr.is_ref():
        return None
    return attr.value


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant held by ``value`` (initializer or Constant node), or None.

    A graph input that has a default initializer is NOT constant: it can be fed at run time.
    """
    if value is None or value.is_graph_input():
        return None
    tensor = value.const_value
    if tensor is None:
        # A Constant's attribute, read as it is: onnx-ir's get_const_tensor renames the
        # attribute's tensor after the value, and the working copy shares that tensor object
        # with the original model, whose bytes would then change.
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        if len(node.attributes) != 1:
            return None
        ((name, attr),) = node.attributes.items()
        if attr.is_ref():
            return None
        if name in ("value_float", "value_floats"):
            return np.array(attr.value, dtype=np.float32)
        if name in ("value_int", "value_ints"):
            return np.array(attr.value, dtype=np.int64)
        if name != "value":
            return None
        tensor = attr.value
    try:
        return read_array(tensor)  # an external tensor is left unmapped: nothing kept per layer
    except Exception:  # external data that cannot be read, unsupported dtype
        return None


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integer constant held by ``value`` as a flat list, or None."""
    arr = const_array(value)
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return [int(v) for v in arr.reshape(-1)]


def is_real(dtype: np.dtype) -> bool:
    """A numeric dtype whose values are real numbers: numpy's ints and floats, and bfloat16.

    ml_dtypes' bfloat16 (how onnx-ir reads a bfloat16 tensor) has numpy kind ``V``.
    """
    return dtype.kind in "fiu" or dtype.name == "bfloat16"


def const_float(value: ir.Value | None) -> float | None:
    """The single float held by ``value`` (a scalar or one-element tensor), or None."""
    arr = const_array(value)
    if arr is None or arr.size != 1 or not is_real(arr.dtype):
        return None
    try:
        return float(np.asarray(arr, dtype=np.float64).reshape(-1)[0])
    except (TypeError, ValueError):
        return None


def attr_int(node: ir.Node, name: str, default: int | None) -> int | None:
    """Integer attribute ``name`` of ``node`` (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return int(attr.value)


def attr_float(node: ir.Node, name: str, default: float | None) -> float | None:
    """Float attribute ``name`` of ``node`` (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return float(attr.value)


def attr_str(node: ir.Node, name: str, default: str | None) -> str | None:
    """String attribute ``name`` of ``node`` (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    v = attr.value
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def node_axes(node: ir.Node, input_index: int = 1) -> list[int] | None:
    """The ``axes`` of a Reduce*/Squeeze/Unsqueeze node, from its input or its attribute.

    The input holds them from opset 13 on, the attribute before. Returns ``[]`` when neither is
    given, None when they are not constant.
    """
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        return const_ints(node.inputs[input_index])
    attr = node.attributes.get("axes")
    if attr is None:
        return []
    if attr.is_ref():
        return None
    return [int(a) for a in attr.value]


def normalize_axes(axes: Sequence[int], rank: int) -> list[int] | None:
    """``axes`` made non-negative for a tensor of ``rank``; None if one is out of range."""
    out = []
    for a in axes:
        b = a + rank if a < 0 else a
        if not 0 <= b < rank:
            return None
        out.append(b)
    return out


# -- static ranks ------------------------------------------------------------------------------

ELEMENTWISE_UNARY = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "Sigmoid",
        "Relu",
        "Tanh",
        "Cast",
        "CastLike",
        "Identity",
        "Neg",
        "Exp",
        "Erf",
        "Gelu",
        "Clip",
        "TopK",
        "DequantizeLinear",
    }
)
ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})


def static_rank(value: ir.Value | None, _depth: int = 0) -> int | None:
    """The rank of ``value`` if the graph fixes it (declared shape or a few common producers)."""
    if value is None or _depth > 32:
        return None
    if value.shape is not None:
        return len(value.shape)
    arr = const_array(value)
    if arr is not None:
        return arr.ndim
    node = value.producer()
    if node is None:
        return None
    op = node.op_type
    ins = node.inputs
    if op == "Reshape":
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        return None if shape is None else len(shape)
    if op in ELEMENTWISE_UNARY and ins:
        return static_rank(ins[0], _depth + 1)
    if op in ELEMENTWISE_BINARY or op == "MatMul":
        ranks = [static_rank(v, _depth + 1) for v in ins[:2]]
        if any(r is None for r in ranks):
            return None
        return max(ranks)  # type: ignore[type-var]
    if op == "Gemm":
        return 2
    if op == "Transpose" and ins:
        return static_rank(ins[0], _depth + 1)
    if op in ("Unsqueeze", "Squeeze"):
        r = static_rank(ins[0], _depth + 1)
        axes = node_axes(node)
        if r is None or axes is None or (op == "Squeeze" and not axes):
            return None
        return r + len(axes) if op == "Unsqueeze" else r - len(axes)
    if op == "Gather":
        rd, ri = static_rank(ins[0], _depth + 1), static_rank(ins[1], _depth + 1)
        return None if rd is None or ri is None else rd + ri - 1
    return None


def static_last_dim(value: ir.Value | None, _depth: int = 0) -> int | None:
    """The size of the last axis of ``value`` if the graph fixes it, else None."""
    if value is None or _depth > 32:
        return None
    if value.shape is not None and len(value.shape) > 0:
        d = value.shape[-1]
        if isinstance(d, int):
            return d
    arr = const_array(value)
    if arr is not None:
        return int(arr.shape[-1]) if arr.ndim else None
    node = value.producer()
    if node is None:
        return None
    op = node.op_type
    ins = node.inputs
    if op in ("Softmax", "LogSoftmax", "Sigmoid", "Relu", "Tanh", "Cast", "Identity", "Neg"):
        return static_last_dim(ins[0], _depth + 1)
    if op == "MatMul":
        b = ins[1]
        rb = static_rank(b, _depth + 1)
        return static_last_dim(b, _depth + 1) if rb is not None and rb >= 2 else None
    if op == "Gemm":
        b = const_array(ins[1])
        if b is None or b.ndim != 2:
            return None
        trans_b = attr_int(node, "transB", 0)
        return int(b.shape[0] if trans_b else b.shape[1])
    if op in ELEMENTWISE_BINARY:
        dims = [static_last_dim(v, _depth + 1) for v in ins[:2]]
        known = [d for d in dims if d is not None and d != 1]
        if len(known) >= 1 and all(d is not None for d in dims):
            return known[0] if len(set(known)) == 1 else None
        # one side unknown: only its own producer chain could tell; the known non-1 side fixes
        # the result when the graph is valid (broadcasting never shrinks a dim).
        return known[0] if known else None
    if op == "Reshape":
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        if shape and shape[-1] > 0:
            return shape[-1]
        return None
    if op == "Transpose" and ins:
        arr = const_array(ins[0])
        if arr is None or arr.ndim == 0:
            return None
        perm_attr = node.attributes.get("perm")
        perm = list(perm_attr.value) if perm_attr is not None else list(range(arr.ndim))[::-1]
        return int(arr.shape[perm[-1]]) if len(perm) == arr.ndim else None
    return None
