"""RMS norm + Q/K/V projections -> one ``com.microsoft.MatMulNBitsQkv``.

What the rules match (one rule instance per norm spelling and per mix of projection kinds)::

    x      = A                      |  Add(A, skip)                (the residual)
    normed = SimplifiedLayerNormalization(x, scale)                (ORT, default domain)
           | RMSNormalization(x, scale)                            (opset 23)
           | decomposed: [Cast(x, float)] -> Pow(., 2) | Mul(., .) -> ReduceMean(last axis)
             -> Add(., eps) -> Sqrt -> Div(x, rms) | Mul(x, Reciprocal(rms) | Div(1, rms))
             -> [Cast] -> Mul(., [Cast](scale)) (either order) [-> Cast]
    normed, .., .., residual = com.microsoft.SkipSimplifiedLayerNormalization(A, skip, scale)
    P_i    = com.microsoft.MatMulNBits(normed, B_i, scales_i [, zero_points_i])
           | MatMul(normed, DequantizeLinear(W_i [K, N_i] int4/uint4, scale_i [, zp_i]))

for exactly three projections ``P_1..P_3`` of ``normed`` (input 0 of a MatMulNBits or MatMul).
The pattern proves the structure; ``check`` proves the meaning (plain-words failures feed
``--explain``): bits 4, block_size 32 along K, zero points absent or all 8 (MatMulNBits) or
symmetric (int4 without zero point or with 0, uint4 with 8), no bias or act-order ``g_idx``,
constant DQ weights, the same K everywhere, the norm over the last axis with a ``[K]`` scale and a
non-negative epsilon, every dtype float32 or float16 and never computed in less precision than
the fused node, a rank-2 or rank-3 input, and which projection is Q (below).

Q, K and V: K and V must have the same width (``Nkv``); a third, different width is Q. Where all
three widths are equal (or to pick K against V), the downstream use decides: the input of an
attention op (``GroupQueryAttention``/``MultiHeadAttention``/``Attention``...: 0 = Q, 1 = K,
2 = V) or of a decomposed attention (``MatMul`` feeding ``Softmax``: input 0 = Q, input 1 = K;
``MatMul`` after ``Softmax``: input 1 = V) reached through shape-only and element-wise ops,
``RotaryEmbedding`` (Q or K, never V), then the names of the projection, its weights and the
values it feeds (``q``/``query``/``q_proj``, ``k``/``key``, ``v``/``value`` tokens). Evidence that
contradicts the widths refuses the rewrite; with no evidence for Q the rule refuses ("cannot
tell"); with none for K against V it takes graph order (the earlier one is K): both slots have the
width Nkv and each output is rewired to the slot computed from its own weights, so the choice
cannot change a number.

What ``rewrite`` emits: one ``com.microsoft.MatMulNBitsQkv`` inserted right after the norm, with
ONNX Runtime's input positions ``A, skip, norm_scale, q_B, q_scales, "", k_B, k_scales, "", v_B,
v_scales, ""`` and every attribute written (``K, Nq, Nkv, bits=4, block_size=32, epsilon,
accuracy_level=0``). MatMulNBits weights pass through unchanged (flat scales reshaped to
``[N, k_blocks]``); DequantizeLinear weights are repacked into MatMulNBits layout (int4 codes
shifted by 8, low nibble first, a last partial block padded with 8). The three projection outputs
are rewired to Q, K, V. The fused node takes ``skip`` (and its output 3 replaces the residual for
every other reader) when the norm's nodes die with the rewrite; when the normalised value (or any
intermediate of the norm) has other readers, the norm stays for them, and the fused node reads
``A + skip`` from the kept residual instead of adding it again.

The rules never remove nodes themselves (``remove_nodes=False``): the replaced projections and
the dead norm are left for a dead-code pass (``onnxscript.rewriter.rewrite`` runs one; so does
the fuser's pipeline), and a graph that does not match is left exactly as it was.

Exports: :class:`MatMulNBitsQkvRule`, :func:`rules` (the rule set), :func:`rule_instances`,
:func:`near_misses` (why each candidate norm did not fuse), :data:`FUSED_OP`,
:data:`FUSED_ATTRIBUTES`, :data:`REPLACED_KEY`.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import _basics, _matcher, pattern

from ._graph_facts import attr_int, const_array, const_float

__all__ = [
    "FUSED_ATTRIBUTES",
    "FUSED_OP",
    "MS_DOMAIN",
    "NORM_FORMS",
    "PROJECTION_MIXES",
    "REPLACED_KEY",
    "MatMulNBitsQkvRule",
    "NearMiss",
    "near_misses",
    "rule_instances",
    "rules",
]

MS_DOMAIN = "com.microsoft"
#: The op these rules emit (``com.microsoft`` domain).
FUSED_OP = "MatMulNBitsQkv"
#: The attributes every emitted node writes (ORT's defaults are not relied on).
FUSED_ATTRIBUTES = frozenset({"K", "Nq", "Nkv", "bits", "block_size", "epsilon", "accuracy_level"})
#: Node metadata key carrying the replaced node names (JSON list), as the MoE rules write it.
REPLACED_KEY = "onnx_moe_fuse.replaced"

#: Norm spellings, one rule instance each (times :data:`PROJECTION_MIXES`).
NORM_FORMS: tuple[str, ...] = (
    "skip_sln_residual",  # SkipSimplifiedLayerNormalization with output 3 bound
    "skip_sln",  # SkipSimplifiedLayerNormalization, output 0 only
    "add_sln",
    "sln",
    "add_rms",
    "rms",
    "add_decomposed_mul_ns",
    "decomposed_mul_ns",
    "add_decomposed_mul_sn",
    "decomposed_mul_sn",
    "add_decomposed_cast",
    "decomposed_cast",
)
#: Projection kinds of the three slots: ``n`` MatMulNBits, ``d`` MatMul (of a DequantizeLinear).
PROJECTION_MIXES: tuple[str, ...] = ("nnn", "nnd", "ndd", "ddd")

_BLOCK = 32
_BITS = 4
_ROLES = ("q", "k", "v")
_KERNEL_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
_PRECISION = {ir.DataType.FLOAT16: 1, ir.DataType.FLOAT: 2, ir.DataType.DOUBLE: 3}
# Reasons the matcher gives; near_misses() reports those that start with this prefix.
_COUNT_PREFIX = "the RMS-normalised value"

Refusal = _basics.MatchFailureError


# Constants and attributes are read exactly as the MoE rules read them.
_const = const_array
_const_scalar = const_float
_int_attr = attr_int


def _v(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


# -- graph facts -------------------------------------------------------------------------------


def _label(item: ir.Node | ir.Value | None) -> str:
    """A readable name: a node's name (or ``OpType(first output)``), a value's name."""
    if item is None:
        return "<absent>"
    if isinstance(item, ir.Node):
        if item.name:
            return item.name
        out = item.outputs[0].name if item.outputs else ""
        return f"{item.op_type}({out})"
    if item.name:
        return item.name
    producer = item.producer()
    return f"output {item.index()} of {_label(producer)}" if producer else "<unnamed>"


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return attr.value


# Ops whose output 0 has the element type and the rank of input 0 (element-wise or norm-like).
_LIKE_INPUT0 = frozenset(
    {
        ("", "Identity"),
        ("", "Neg"),
        ("", "Relu"),
        ("", "Sigmoid"),
        ("", "Tanh"),
        ("", "Erf"),
        ("", "Sqrt"),
        ("", "Reciprocal"),
        ("", "Softmax"),
        ("", "Gelu"),
        ("", "Dropout"),
        ("", "LayerNormalization"),
        ("", "SimplifiedLayerNormalization"),
        ("", "RMSNormalization"),
        ("", "RotaryEmbedding"),
        (MS_DOMAIN, "SkipSimplifiedLayerNormalization"),
        (MS_DOMAIN, "SkipLayerNormalization"),
        (MS_DOMAIN, "MatMulNBits"),
        (MS_DOMAIN, "MatMulNBitsQkv"),
        (MS_DOMAIN, "GroupQueryAttention"),
        (MS_DOMAIN, "MultiHeadAttention"),
        (MS_DOMAIN, "RotaryEmbedding"),
        (MS_DOMAIN, "QMoE"),
        (MS_DOMAIN, "MoE"),
        (MS_DOMAIN, "FastGelu"),
        (MS_DOMAIN, "Gelu"),
    }
)
# Ops whose output has its inputs' element type and their broadcast rank.
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})
_SAME_TYPE = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Flatten"})
_REDUCE = frozenset(("", op) for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2"))
_INFER_LIMIT = 2048  # values visited per query


def _infer(value: ir.Value | None, what: str, memo: dict[int, Any] | None = None) -> Any:
    """The element type (``what="dtype"``) or rank (``"rank"``) of ``value``, or None.

    Declared types and shapes first; otherwise read through the producer: Cast, element-wise and
    norm-like ops (ONNX's and ONNX Runtime's, e.g. MatMulNBits keeps A's rank and type),
    broadcasting binary ops, reductions with ``keepdims=1``, MatMul with a 2-D weight, Reshape
    with a constant shape. The graphs the rule meets often carry no value_info for com.microsoft
    outputs, which onnx's shape inference cannot type.
    """
    if value is None:
        return None
    memo = {} if memo is None else memo
    key_v = id(value)
    if key_v in memo:
        return memo[key_v]
    if len(memo) > _INFER_LIMIT:
        return None
    memo[key_v] = None  # guards cycles while this value is being read
    try:
        memo[key_v] = found = _infer_step(value, what, memo)
    except RecursionError:  # a very deep chain without declared shapes: unknown
        return None
    return found


def _infer_step(value: ir.Value, what: str, memo: dict[int, Any]) -> Any:
    if what == "dtype" and value.dtype is not None:
        return value.dtype
    if what == "rank" and value.shape is not None:
        return len(value.shape)
    arr = _const(value)
    if arr is not None:
        if what == "rank":
            return arr.ndim
        try:
            return ir.DataType.from_numpy(arr.dtype)
        except (TypeError, ValueError):
            return None
    node = value.producer()
    if node is None or not node.inputs:
        return None
    key = (node.domain, node.op_type)
    first = node.inputs[0]
    if key == ("", "Cast"):
        if what == "rank":
            return _infer(first, what, memo)
        to = _int_attr(node, "to", None)
        return ir.DataType(to) if to is not None else None
    if key in _LIKE_INPUT0 and value.index() in (0, 3):
        found = _infer(first, what, memo)
        if found is None and what == "dtype" and len(node.inputs) > 2:
            found = _infer(node.inputs[2], what, memo)  # MatMulNBits(Qkv): scales / norm_scale
        return found
    if key in _REDUCE and _int_attr(node, "keepdims", 1) == 1:
        return _infer(first, what, memo)
    if node.domain == "" and node.op_type in _BROADCAST:
        if what == "dtype":
            return _infer(first, what, memo) or _infer(node.inputs[-1], what, memo)
        ranks = [_infer(v, what, memo) for v in node.inputs]
        return None if any(r is None for r in ranks) else max(ranks)
    if key == ("", "MatMul") and len(node.inputs) == 2:
        if what == "dtype":
            return _infer(first, what, memo) or _infer(node.inputs[1], what, memo)
        if _infer(node.inputs[1], what, memo) == 2:
            return _infer(first, what, memo)
        return None
    if node.domain == "" and node.op_type in _SAME_TYPE:
        if what == "dtype":
            return _infer(first, what, memo)
        if node.op_type == "Reshape" and len(node.inputs) > 1:
            shape = _const(node.inputs[1])
            return None if shape is None else int(shape.size)
        if node.op_type == "Transpose":
            return _infer(first, what, memo)
    return None


def _dtype(value: ir.Value | None) -> ir.DataType | None:
    """The element type of ``value`` (see :func:`_infer`)."""
    return _infer(value, "dtype")


def _pick(bindings: dict[str, Any], *names: str) -> ir.Value | None:
    """The first of ``names`` bound to a value."""
    for name in names:
        value = bindings.get(name)
        if value is not None:
            return value
    return None


def _rank(value: ir.Value | None) -> int | None:
    """The rank of ``value`` (see :func:`_infer`)."""
    return _infer(value, "rank")


def _dims(value: ir.Value | None) -> tuple[Any, ...] | None:
    """Static shape as a tuple of ints / symbolic names; None when unknown or anonymous."""
    if value is None or value.shape is None:
        return None
    dims: list[Any] = []
    for d in value.shape:
        if isinstance(d, int):
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value:
            dims.append(d.value)
        else:
            return None
    return tuple(dims)


def _static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    arr = _const(value)
    if arr is not None:
        return tuple(arr.shape)
    dims = _dims(value)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(dims)


def _dtype_name(dtype: ir.DataType | None) -> str:
    return "unknown" if dtype is None else dtype.name.lower()


def _np_dtype(dtype: ir.DataType) -> np.dtype:
    return np.dtype(dtype.numpy())


# -- pattern pieces ----------------------------------------------------------------------------


def _norm_input(op, with_add: bool):
    """The value the norm reads: ``A``, or ``Add(A, skip)`` bound as ``residual``."""
    if with_add:
        return op.Add(_v("a"), _v("skip"), _outputs=["residual"])
    return _v("x")


def _decomposed(op, x, final: str):
    """The decomposed RMS norm of ``x``; ``final`` picks the spelling of its last node."""
    x_c = pattern.OrValue([op.Cast(x, _outputs=["x_up"]), x], name="x_c")
    sq = pattern.OrValue(
        [op.Pow(x_c, _v("pow_exponent"), _outputs=["sq_pow"]), op.Mul(x_c, x_c)], name="sq"
    )
    mean_sq = op.ReduceMean(sq, _v("rm_axes", True), _outputs=["mean_sq"])
    eps = _v("epsilon")
    mean_eps = pattern.OrValue([op.Add(mean_sq, eps), op.Add(eps, mean_sq)], name="mean_sq_eps")
    rms = op.Sqrt(mean_eps, _outputs=["rms"])
    inv = pattern.OrValue(
        [op.Reciprocal(rms), op.Div(_v("one"), rms, _outputs=["inv_div"])], name="inv_rms"
    )
    normalized = pattern.OrValue(
        [op.Div(x_c, rms), op.Mul(x_c, inv), op.Mul(inv, x_c)], name="normalized"
    )
    normalized_t = pattern.OrValue(
        [op.Cast(normalized, _outputs=["normalized_cast"]), normalized], name="normalized_t"
    )
    scale = _v("norm_scale")
    scale_c = pattern.OrValue([op.Cast(scale, _outputs=["scale_cast"]), scale], name="scale_c")
    if final == "mul_ns":
        return op.Mul(normalized_t, scale_c, _outputs=["normed"])
    if final == "mul_sn":
        return op.Mul(scale_c, normalized_t, _outputs=["normed"])
    scaled = pattern.OrValue(
        [op.Mul(normalized_t, scale_c), op.Mul(scale_c, normalized_t)], name="scaled"
    )
    return op.Cast(scaled, _outputs=["normed"])


def _norm(op, form: str):
    """``(normed, residual or None)`` for one of :data:`NORM_FORMS`."""
    if form.startswith("skip_sln"):
        if form == "skip_sln_residual":
            outs = ["normed", "ssln_mean", "ssln_inv_std_var", "residual"]
        else:
            outs = ["normed"]
        values = op.SkipSimplifiedLayerNormalization(
            _v("a"), _v("skip"), _v("norm_scale"), _v("ssln_bias", True), _domain=MS_DOMAIN,
            _outputs=outs,
        )  # fmt: skip
        if form == "skip_sln_residual":
            return values[0], values[3]
        return values, None
    with_add = form.startswith("add_")
    body = form.removeprefix("add_")
    x = _norm_input(op, with_add)
    residual = x if with_add else None
    if body == "sln":
        normed = op.SimplifiedLayerNormalization(x, _v("norm_scale"), _outputs=["normed"])
    elif body == "rms":
        normed = op.RMSNormalization(x, _v("norm_scale"), _outputs=["normed"])
    else:
        normed = _decomposed(op, x, body.removeprefix("decomposed_"))
    return normed, residual


def _projection(op, normed, slot: int, kind: str):
    if kind == "n":
        return op.MatMulNBits(
            normed,
            _v(f"p{slot}_B"),
            _v(f"p{slot}_scales"),
            _v(f"p{slot}_zero_points", True),
            _v(f"p{slot}_g_idx", True),
            _v(f"p{slot}_bias", True),
            _domain=MS_DOMAIN,
            _outputs=[f"p{slot}"],
        )
    return op.MatMul(normed, _v(f"p{slot}_weight"), _outputs=[f"p{slot}"])


def _is_projection_of(node: ir.Node, value: ir.Value) -> bool:
    if not node.inputs or node.inputs[0] is not value:
        return False
    return (node.domain, node.op_type) in (("", "MatMul"), (MS_DOMAIN, "MatMulNBits"))


def _projection_consumers(normed: ir.Value) -> list[ir.Node]:
    """Nodes that project ``normed``: MatMulNBits / MatMul reading it as input 0, in use order."""
    found: dict[int, ir.Node] = {}
    for node, index in normed.uses():
        if index == 0 and _is_projection_of(node, normed):
            found.setdefault(id(node), node)
    return list(found.values())


def _count_reason(normed: ir.Value, found: Sequence[ir.Node]) -> str:
    labels = ", ".join(_label(n) for n in found)
    n = len(found)
    if n == 0:
        return f"no projection (MatMulNBits or MatMul) reads the normalised value {_label(normed)}"
    if n < 3:
        words = {1: "only one projection", 2: "only two projections"}[n]
        return (
            f"{_COUNT_PREFIX} {_label(normed)} feeds {words} ({labels}); MatMulNBitsQkv needs "
            "exactly three (Q, K and V)"
        )
    return (
        f"{_COUNT_PREFIX} {_label(normed)} feeds {n} projections ({labels}); MatMulNBitsQkv "
        "takes exactly three, and which three are Q, K and V cannot be told"
    )


class _PreludeMatcher(_matcher.SimplePatternMatcher):
    """Matches the norm at the visited node, then its three projections among its readers.

    onnxscript's generic multi-output search tries every combination of graph nodes for the
    other output nodes; here they can only be readers of the normalised value, so only those are
    tried (every assignment to the pattern's projection slots). With other than three such
    readers the match fails with the count as its reason.
    """

    def match(  # type: ignore[override]
        self,
        model: ir.Model,
        graph_or_function: ir.Graph | ir.Function,
        node: ir.Node,
        *,
        verbose: int = 0,
        remove_nodes: bool = True,
        tracer: _basics.MatchingTracer | None = None,
    ) -> _basics.MatchResult:
        del model
        self._tracer = tracer
        if isinstance(graph_or_function, ir.Graph):
            self._graph = graph_or_function
        else:
            self._graph = graph_or_function.graph
        self._init_match(verbose)
        match = self._match
        head, *slots = self.pattern.output_nodes
        if not self._match_node(head, node):
            return match
        normed = node.outputs[0]
        found = _projection_consumers(normed)
        if len(found) != 3:
            return match.fail(_count_reason(normed, found), [node, *found])
        wanted = [pn.op_identifier() for pn in slots]
        for order in itertools.permutations(found):
            if [n.op_identifier() for n in order] != wanted:
                continue
            match.enter_new_match()
            if all(self._match_node(pn, n) for pn, n in zip(slots, order, strict=True)):
                match.merge_current_match()
                break
            match.abandon_current_match()
        else:
            return match.fail("the projection kinds differ from this rule variant's", node)
        outputs = self._get_output_values()
        if outputs is None:
            return match
        if remove_nodes and not _matcher._valid_to_replace(match.nodes, outputs):
            return match.fail("Matched nodes have other uses preventing replacement.")
        match.outputs.extend(outputs)
        return match


# -- analysis ----------------------------------------------------------------------------------


@dataclass
class _Projection:
    """One projection, read and validated."""

    node: ir.Node
    output: ir.Value
    n: int
    k: int
    dtype: ir.DataType
    b: ir.Value | np.ndarray  # a value to pass through, or a repacked array
    scales: ir.Value | np.ndarray
    names: list[str] = field(default_factory=list)  # for the role evidence


@dataclass
class _Plan:
    """Everything the rewrite needs, proven by the analysis."""

    anchor: ir.Node
    normed: ir.Value
    a: ir.Value
    skip: ir.Value | None
    scale: ir.Value | np.ndarray
    epsilon: float
    dtype: ir.DataType
    k: int
    projections: list[_Projection]  # in pattern slot order
    roles: dict[str, int]  # "q" / "k" / "v" -> index into projections
    residual: ir.Value | None  # the pattern's residual output (skip forms)
    emit_residual: bool  # the fused node's output 3 replaces the residual
    replaced: list[ir.Node]

    @property
    def nq(self) -> int:
        """Q width."""
        return self.projections[self.roles["q"]].n

    @property
    def nkv(self) -> int:
        """K and V width."""
        return self.projections[self.roles["k"]].n

    def attributes(self) -> dict[str, int | float]:
        """Every attribute of the fused node."""
        return {
            "K": self.k,
            "Nq": self.nq,
            "Nkv": self.nkv,
            "bits": _BITS,
            "block_size": _BLOCK,
            "epsilon": self.epsilon,
            "accuracy_level": 0,
        }


def _refuse(reason: str, *sources: ir.Node | ir.Value | None) -> Refusal:
    return Refusal(reason, *[s for s in sources if s is not None])


def _check_zero_points_nbits(proj: ir.Node, zp: ir.Value, n: int, kb: int) -> None:
    arr = _const(zp)
    if arr is None:
        raise _refuse(
            f"{_label(proj)}: its zero points {_label(zp)} are not constant, so they cannot be "
            "proven symmetric (all 8)",
            proj,
            zp,
        )
    if arr.dtype == np.uint8:
        per_row = -(-kb * _BITS // 8)
        if arr.size != n * per_row:
            raise _refuse(f"{_label(proj)}: zero points of unexpected shape {arr.shape}", proj, zp)
        lo = arr.reshape(n, per_row) & 0x0F
        hi = arr.reshape(n, per_row) >> 4
        points = np.stack([lo, hi], axis=-1).reshape(n, 2 * per_row)[:, :kb]
    else:
        points = arr.astype(np.float64).reshape(-1)
    if not np.all(points == 8):
        raise _refuse(
            f"{_label(proj)}: asymmetric zero points (not all 8); MatMulNBitsQkv has no "
            "zero-point inputs, its 4-bit weights are symmetric (zero point 8)",
            proj,
            zp,
        )


def _nbits_projection(node: ir.Node, output: ir.Value, bindings: dict[str, Any], s: int):
    b, scales = bindings[f"p{s}_B"], bindings[f"p{s}_scales"]
    zp, g_idx, bias = (bindings.get(f"p{s}_{n}") for n in ("zero_points", "g_idx", "bias"))
    label = _label(node)
    k, n = _int_attr(node, "K", None), _int_attr(node, "N", None)
    bits, bs = _int_attr(node, "bits", 4), _int_attr(node, "block_size", None)
    if k is None or n is None or bs is None:
        raise _refuse(f"{label}: MatMulNBits without its K, N or block_size attribute", node)
    if _int_attr(node, "weight_prepacked", 0):
        raise _refuse(f"{label}: weight_prepacked=1 (an execution-provider layout)", node)
    if bits != _BITS:
        raise _refuse(
            f"{label}: {bits}-bit weights (bits={bits}); MatMulNBitsQkv's kernels take 4-bit "
            "weights only",
            node,
        )
    if bs != _BLOCK:
        raise _refuse(
            f"{label}: quantised with block_size {bs} along K; MatMulNBitsQkv's kernels take "
            f"block_size {_BLOCK} only",
            node,
        )
    if bias is not None:
        raise _refuse(f"{label}: has a bias input; MatMulNBitsQkv's kernels add none", node, bias)
    kb = -(-k // bs)
    if g_idx is not None:
        arr = _const(g_idx)
        if arr is None or not np.array_equal(arr.reshape(-1), np.arange(k) // bs):
            raise _refuse(
                f"{label}: an act-order g_idx ({_label(g_idx)}) that is not the plain k // "
                f"{bs} block order",
                node,
                g_idx,
            )
    if zp is not None:
        _check_zero_points_nbits(node, zp, n, kb)
    b_type = _dtype(b)
    if b_type is not None and b_type != ir.DataType.UINT8:
        raise _refuse(f"{label}: B is {_dtype_name(b_type)}, not uint8", node, b)
    b_shape = _static_shape(b)
    if b_shape is not None and b_shape != (n, kb, bs * bits // 8):
        raise _refuse(
            f"{label}: B has shape {list(b_shape)}, not [N, k_blocks, blob] = "
            f"{[n, kb, bs * bits // 8]}",
            node,
            b,
        )
    dtype = _dtype(scales)
    if dtype is None:
        raise _refuse(f"{label}: cannot tell the element type of its scales", node, scales)
    s_shape = _static_shape(scales)
    scales_out: ir.Value | np.ndarray = scales
    if s_shape != (n, kb):
        arr = _const(scales)
        if arr is None or arr.size != n * kb:
            raise _refuse(
                f"{label}: scales of shape {s_shape if s_shape is None else list(s_shape)} "
                f"that cannot be proven to be [N, k_blocks] = {[n, kb]}",
                node,
                scales,
            )
        scales_out = np.ascontiguousarray(arr.reshape(n, kb))
    names = [node.name, output.name, b.name, scales.name]
    return _Projection(node, output, n, k, dtype, b, scales_out, [x for x in names if x])


def _dq_projection(node: ir.Node, output: ir.Value, bindings: dict[str, Any], s: int):
    label = _label(node)
    weight = bindings[f"p{s}_weight"]
    dq = weight.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain != "":
        raise _refuse(
            f"{label}: its weights {_label(weight)} are not a DequantizeLinear output (float or "
            "otherwise quantised weights); MatMulNBitsQkv takes 4-bit blocked weights",
            node,
            weight,
        )
    codes_v = dq.inputs[0]
    scale_v = dq.inputs[1] if len(dq.inputs) > 1 else None
    zp_v = dq.inputs[2] if len(dq.inputs) > 2 else None
    codes, scale = _const(codes_v), _const(scale_v)
    if codes is None or scale is None:
        raise _refuse(
            f"{label}: the DequantizeLinear weights or scales are not constant, so they cannot "
            "be repacked at fusion time (weights not constant)",
            node,
            dq,
        )
    ctype = _dtype(codes_v)
    if ctype in (ir.DataType.INT8, ir.DataType.UINT8):
        raise _refuse(
            f"{label}: 8-bit weights ({_dtype_name(ctype)} behind DequantizeLinear); "
            "MatMulNBitsQkv's kernels take 4-bit weights only",
            node,
            dq,
        )
    if ctype not in (ir.DataType.INT4, ir.DataType.UINT4):
        raise _refuse(
            f"{label}: weights of type {_dtype_name(ctype)} behind DequantizeLinear; "
            "MatMulNBitsQkv takes int4 / uint4 weights only",
            node,
            dq,
        )
    if codes.ndim != 2:
        raise _refuse(f"{label}: DequantizeLinear weights of rank {codes.ndim}, not [K, N]", dq)
    k, n = codes.shape
    axis = _int_attr(dq, "axis", 1)
    bs = _int_attr(dq, "block_size", 0)
    if not bs:
        raise _refuse(
            f"{label}: the weights are quantised per tensor or per channel, not in blocks of "
            f"{_BLOCK} along K",
            node,
            dq,
        )
    if axis not in (0, -2):
        raise _refuse(
            f"{label}: the weights are blocked along axis {axis} (N), not along K", node, dq
        )
    if bs != _BLOCK:
        raise _refuse(
            f"{label}: quantised with block_size {bs} along K; MatMulNBitsQkv's kernels take "
            f"block_size {_BLOCK} only",
            node,
            dq,
        )
    kb = -(-k // bs)
    if scale.shape != (kb, n):
        raise _refuse(
            f"{label}: DequantizeLinear scale of shape {list(scale.shape)}, not [k_blocks, N] = "
            f"{[kb, n]}",
            node,
            dq,
        )
    out_dtype = _int_attr(dq, "output_dtype", 0)
    dtype = ir.DataType(out_dtype) if out_dtype else ir.DataType.from_numpy(scale.dtype)
    if out_dtype and ir.DataType.from_numpy(scale.dtype) != dtype:
        raise _refuse(f"{label}: DequantizeLinear output_dtype differs from its scale's", dq)
    signed = ctype == ir.DataType.INT4
    if zp_v is None:
        if not signed:
            raise _refuse(
                f"{label}: asymmetric zero point: a uint4 DequantizeLinear without zero point has "
                "zero point 0, not MatMulNBits' 8",
                node,
                dq,
            )
    else:
        zp = _const(zp_v)
        if zp is None:
            raise _refuse(
                f"{label}: the zero points are not constant, so they cannot be proven symmetric",
                node,
                zp_v,
            )
        want = 0 if signed else 8
        if zp.size not in (1, kb * n) or not np.all(zp.astype(np.int64) == want):
            raise _refuse(
                f"{label}: asymmetric zero points (not all {want} for "
                f"{_dtype_name(ctype)}); MatMulNBitsQkv's 4-bit weights are symmetric",
                node,
                zp_v,
            )
    unsigned = codes.astype(np.int64) + (8 if signed else 0)  # zero point 8, values 0..15
    padded = np.full((n, kb * bs), 8, dtype=np.uint8)
    padded[:, :k] = unsigned.T.astype(np.uint8)
    blocks = padded.reshape(n, kb, bs)
    b = (blocks[..., 0::2] | (blocks[..., 1::2] << 4)).astype(np.uint8)  # low nibble first
    scales = np.ascontiguousarray(scale.T.astype(scale.dtype))
    names = [node.name, output.name, weight.name, codes_v.name, dq.name]
    return _Projection(node, output, n, k, dtype, b, scales, [x for x in names if x])


def _read_projections(bindings: dict[str, Any]) -> list[_Projection]:
    projections = []
    for s in (1, 2, 3):
        output = bindings[f"p{s}"]
        node = output.producer()
        if node.op_type == "MatMulNBits":
            projections.append(_nbits_projection(node, output, bindings, s))
        else:
            projections.append(_dq_projection(node, output, bindings, s))
    ks = {p.k for p in projections}
    if len(ks) != 1:
        raise _refuse(
            "the projections disagree on K: "
            + ", ".join(f"{_label(p.node)} K={p.k}" for p in projections),
            *[p.node for p in projections],
        )
    dtypes = {p.dtype for p in projections}
    if len(dtypes) != 1:
        raise _refuse(
            "the projections compute in different types: "
            + ", ".join(f"{_label(p.node)} {_dtype_name(p.dtype)}" for p in projections),
            *[p.node for p in projections],
        )
    dtype = projections[0].dtype
    if dtype not in _KERNEL_DTYPES:
        raise _refuse(
            f"the projections compute in {_dtype_name(dtype)}; MatMulNBitsQkv's kernels take "
            "float32 and float16",
            projections[0].node,
        )
    return projections


def _first_rank(*values: ir.Value | None) -> int | None:
    for v in values:
        r = _rank(v)
        if r is not None:
            return r
    return None


def _check_last_axis(node: ir.Node, axis: int, rank: int | None, what: str) -> None:
    if axis == -1 or (rank is not None and axis == rank - 1):
        return
    if rank is None and axis >= 0:
        raise _refuse(
            f"{_label(node)}: {what} axis {axis}, and the input's rank is unknown, so it cannot "
            "be proven to be the last axis",
            node,
        )
    raise _refuse(f"{_label(node)}: {what} axis {axis}, not the last axis", node)


def _precise_enough(node: ir.Node, compute: ir.DataType | None, dtype: ir.DataType, what: str):
    if compute is None:
        raise _refuse(f"{_label(node)}: cannot tell the type {what} is computed in", node)
    if _PRECISION.get(compute, 0) < _PRECISION[dtype]:
        raise _refuse(
            f"{_label(node)}: {what} is computed in {_dtype_name(compute)}, less precise than "
            f"the model's {_dtype_name(dtype)} (the fused node computes in float32)",
            node,
        )


@dataclass
class _NormFacts:
    x: ir.Value  # the value normalised (A, or A + skip)
    scale: ir.Value
    scale_dtype: ir.DataType | None  # of ``scale`` as bound (before any Cast)
    epsilon: float
    axis_node: ir.Node


def _decomposed_facts(b: dict[str, Any], dtype: ir.DataType, rank: int | None) -> _NormFacts:
    x = _pick(b, "residual", "x")
    normed = b["normed"]
    anchor = normed.producer()
    x_up = b.get("x_up")
    # the element types along the chain (ONNX typing ties the rest together)
    casts = [v for v in (x_up, b.get("normalized_cast"), b.get("scale_cast")) if v is not None]
    if anchor.op_type == "Cast":
        casts.append(normed)
    x_type = _dtype(x)
    if x_type is None and not casts:
        x_type = dtype  # no Cast anywhere: every value of the chain has normed's type
    if x_type != dtype:
        raise _refuse(
            f"the norm's input {_label(x)} is {_dtype_name(x_type)}, but the projections compute "
            f"in {_dtype_name(dtype)} (the fused node reads A in the projections' type)",
            x,
        )
    compute = ir.DataType(_int_attr(x_up.producer(), "to", 0)) if x_up is not None else x_type
    _precise_enough(x_up.producer() if x_up is not None else anchor, compute, dtype, "the norm")
    nc = b.get("normalized_cast")
    mul_type = ir.DataType(_int_attr(nc.producer(), "to", 0)) if nc is not None else compute
    _precise_enough(anchor, mul_type, dtype, "the scale multiplication")
    if anchor.op_type == "Cast" and _int_attr(anchor, "to", 0) != dtype:
        raise _refuse(f"{_label(anchor)}: casts to another type than the projections'", anchor)
    pow_exp = b.get("pow_exponent")
    if b.get("sq_pow") is not None and _const_scalar(pow_exp) != 2.0:
        raise _refuse(
            f"{_label(b['sq_pow'].producer())}: the power is {_const_scalar(pow_exp)}, not 2",
            b["sq_pow"].producer(),
        )
    rm = b["mean_sq"].producer()
    axes_v = b.get("rm_axes")
    axes = _const(axes_v) if axes_v is not None else None
    if axes_v is not None and axes is None:
        raise _refuse(f"{_label(rm)}: its axes {_label(axes_v)} are not constant", rm)
    axes_list = [int(a) for a in axes.reshape(-1)] if axes is not None else _attr(rm, "axes", None)
    if not axes_list or len(axes_list) != 1:
        raise _refuse(f"{_label(rm)}: reduces over axes {axes_list}, not the last axis only", rm)
    _check_last_axis(rm, int(axes_list[0]), rank, "reduces over")
    if _int_attr(rm, "keepdims", 1) != 1:
        raise _refuse(f"{_label(rm)}: keepdims=0 (the mean does not broadcast back)", rm)
    eps = _const_scalar(b.get("epsilon"))
    if eps is None:
        raise _refuse(
            f"the epsilon added to the mean square ({_label(b.get('epsilon'))}) is not a "
            "constant scalar",
            b["mean_sq"].producer(),
        )
    if b.get("inv_div") is not None and _const_scalar(b.get("one")) != 1.0:
        raise _refuse(
            f"{_label(b['inv_div'].producer())}: divides {_const_scalar(b.get('one'))}, not 1, "
            "by the RMS",
            b["inv_div"].producer(),
        )
    sc = b.get("scale_cast")
    scale = b["norm_scale"]
    scale_dtype = _dtype(scale) if sc is not None else mul_type
    return _NormFacts(x, scale, scale_dtype, eps, rm)


def _op_norm_facts(b: dict[str, Any], dtype: ir.DataType, rank: int | None) -> _NormFacts:
    normed = b["normed"]
    node = normed.producer()
    scale = b["norm_scale"]
    if node.op_type == "SkipSimplifiedLayerNormalization":
        x = b["a"]
        if b.get("ssln_bias") is not None:
            raise _refuse(
                f"{_label(node)}: SkipSimplifiedLayerNormalization with a bias input; "
                "MatMulNBitsQkv adds none",
                node,
                b["ssln_bias"],
            )
        eps = _attr(node, "epsilon", 1e-12)
    else:
        x = _pick(b, "residual", "x")
        eps = _attr(node, "epsilon", 1e-5)
        _check_last_axis(node, _int_attr(node, "axis", -1), rank, "normalises over")
        stash = _int_attr(node, "stash_type", 1)
        if stash != 1:
            raise _refuse(
                f"{_label(node)}: stash_type={stash}; the fused node computes the norm in "
                "float32 (stash_type 1)",
                node,
            )
    x_type = _dtype(x)
    if x_type != dtype:
        raise _refuse(
            f"the norm's input {_label(x)} is {_dtype_name(x_type)}, but the projections compute "
            f"in {_dtype_name(dtype)}",
            x,
        )
    return _NormFacts(x, scale, _dtype(scale), float(eps), node)


def _fused_scale(facts: _NormFacts, dtype: ir.DataType, k: int) -> ir.Value | np.ndarray:
    """The ``[K]`` norm scale of the fused node's type: the value itself, or an exact copy."""
    scale = facts.scale
    if facts.scale_dtype == dtype and _static_shape(scale) == (k,):
        return scale
    arr = _const(scale)
    if arr is None:
        raise _refuse(
            f"the norm scale {_label(scale)} ({_dtype_name(facts.scale_dtype)}, shape "
            f"{_dims(scale)}) cannot be proven to be [K] = [{k}] of {_dtype_name(dtype)}",
            scale,
        )
    if arr.size == 1:
        arr = np.full((k,), arr.reshape(-1)[0], dtype=arr.dtype)
    elif arr.size != k or any(d != 1 for d in arr.shape[:-1]) or arr.shape[-1] != k:
        raise _refuse(
            f"the norm scale {_label(scale)} has shape {list(arr.shape)}, not [K] = [{k}]", scale
        )
    out = arr.reshape(k).astype(_np_dtype(dtype))
    if not np.array_equal(out.astype(np.float64), arr.reshape(k).astype(np.float64)):
        raise _refuse(
            f"the norm scale {_label(scale)} is {_dtype_name(ir.DataType.from_numpy(arr.dtype))}"
            f" and not exactly representable in {_dtype_name(dtype)}",
            scale,
        )
    return np.ascontiguousarray(out)


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    da, db = _dims(a), _dims(b)
    return da is not None and da == db


def _norm_nodes(normed: ir.Value, stops: Iterable[ir.Value | None]) -> list[ir.Node]:
    """The nodes computing ``normed`` from the boundary values ``stops`` (constants excluded)."""
    stop_ids = {id(v) for v in stops if v is not None}
    seen: dict[int, ir.Node] = {}
    todo = [normed.producer()]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for v in node.inputs:
            if v is None or id(v) in stop_ids or v.is_graph_input() or v.is_initializer():
                continue
            p = v.producer()
            if p is not None and p.op_type != "Constant":
                todo.append(p)
    return list(seen.values())


def _read_uses(value: ir.Value, allowed: set[int]) -> bool:
    """True when ``value`` is a graph output or read by a node outside ``allowed`` (ids)."""
    if value.is_graph_output():
        return True
    return any(id(user) not in allowed for user, _ in value.uses())


# -- Q, K and V --------------------------------------------------------------------------------

_ATTENTION_OPS = frozenset(
    {
        (MS_DOMAIN, "GroupQueryAttention"),
        (MS_DOMAIN, "MultiHeadAttention"),
        (MS_DOMAIN, "DecoderMaskedMultiHeadAttention"),
        (MS_DOMAIN, "PagedAttention"),
        (MS_DOMAIN, "SparseAttention"),
        ("", "Attention"),
    }
)
_ROPE_OPS = frozenset({(MS_DOMAIN, "RotaryEmbedding"), ("", "RotaryEmbedding")})
_THROUGH_OPS = frozenset(
    {
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Cast",
        "Identity",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Neg",
        "Slice",
        "Split",
        "Concat",
        "Expand",
        "Gather",
        "Where",
        "SimplifiedLayerNormalization",
        "RMSNormalization",
        "LayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "Pow",
        "ReduceMean",
        "Sqrt",
        "Reciprocal",
    }
)
_SCORE_OPS = frozenset({"Mul", "Div", "Add", "Where", "Cast", "Reshape", "Transpose", "Sub"})
_NAME_ROLES = {
    "q": "q",
    "query": "q",
    "queries": "q",
    "wq": "q",
    "k": "k",
    "key": "k",
    "keys": "k",
    "wk": "k",
    "v": "v",
    "value": "v",
    "values": "v",
    "wv": "v",
}


def _reaches_softmax(value: ir.Value, depth: int = 6) -> bool:
    for user, _ in value.uses():
        if user.op_type == "Softmax":
            return True
        if depth > 0 and user.op_type in _SCORE_OPS:
            if any(_reaches_softmax(out, depth - 1) for out in user.outputs):
                return True
    return False


def _from_softmax(value: ir.Value | None, depth: int = 6) -> bool:
    node = value.producer() if value is not None else None
    while node is not None and depth > 0:
        if node.op_type == "Softmax":
            return True
        if node.op_type not in ("Cast", "Reshape", "Transpose", "Dropout", "Where", "Identity"):
            return False
        node = node.inputs[0].producer() if node.inputs and node.inputs[0] else None
        depth -= 1
    return False


def _downstream(output: ir.Value) -> tuple[set[str], bool, list[str]]:
    """Roles the downstream use implies, whether RoPE is applied, names met on the way."""
    roles: set[str] = set()
    rope = False
    names: list[str] = []
    seen: set[int] = set()
    todo = [(output, 0)]
    while todo and len(seen) < 256:
        value, depth = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.name:
            names.append(value.name)
        for user, index in value.uses():
            key = (user.domain, user.op_type)
            if key in _ATTENTION_OPS:
                if index < 3:
                    roles.add(_ROLES[index])
                continue
            if key in _ROPE_OPS and index == 0:
                rope = True
            if key == ("", "MatMul"):
                if _reaches_softmax(user.outputs[0]):
                    roles.add("q" if index == 0 else "k")
                elif index == 1 and _from_softmax(user.inputs[0]):
                    roles.add("v")
                continue
            if (user.op_type in _THROUGH_OPS or key in _ROPE_OPS) and depth < 12:
                todo.extend((out, depth + 1) for out in user.outputs)
    return roles, rope, names


def _name_role(names: Iterable[str]) -> str | None:
    found = set()
    for name in names:
        roles = {_NAME_ROLES[t] for t in re.split(r"[^a-z0-9]+", name.lower()) if t in _NAME_ROLES}
        if len(roles) == 1:
            found |= roles
    return found.pop() if len(found) == 1 else None


def _assign_roles(projections: list[_Projection], order: list[int]) -> dict[str, int]:
    """Decide which projection is Q, K and V; see the module docstring."""
    widths = [p.n for p in projections]
    labels = [_label(p.node) for p in projections]
    nodes = [p.node for p in projections]
    if len(set(widths)) == 3:
        raise _refuse(
            "the three projections have different widths "
            + ", ".join(f"{lab} N={w}" for lab, w in zip(labels, widths, strict=True))
            + "; K and V must have the same width (Nkv)",
            *nodes,
        )
    perms = [
        dict(zip(_ROLES, p, strict=True))
        for p in itertools.permutations(range(3))
        if widths[p[1]] == widths[p[2]]
    ]
    structural: dict[int, str] = {}
    by_name: dict[int, str] = {}
    for i, p in enumerate(projections):
        roles, rope, names = _downstream(p.output)
        if len(roles) == 1:
            structural[i] = next(iter(roles))
        elif not roles and rope:
            structural[i] = "qk"
        role = _name_role(p.names + names)
        if role is not None:
            by_name[i] = role
    for kind, evidence in (("downstream use", structural), ("names", by_name)):
        if not evidence:
            continue
        kept = [
            perm
            for perm in perms
            if all(
                (perm["q"] == i or perm["k"] == i) if r == "qk" else perm[r] == i
                for i, r in evidence.items()
            )
        ]
        if not kept:
            said = ", ".join(
                f"{labels[i]} is {'Q or K' if r == 'qk' else r.upper()}"
                for i, r in evidence.items()
            )
            raise _refuse(
                f"the {kind} ({said}) contradicts the widths "
                + ", ".join(f"{lab} N={w}" for lab, w in zip(labels, widths, strict=True))
                + " (K and V share one width)",
                *nodes,
            )
        perms = kept
    if len({perm["q"] for perm in perms}) != 1:
        raise _refuse(
            f"cannot tell which projection is Q: all three have width {widths[0]} and nothing "
            "downstream (attention inputs, RoPE, value names) tells them apart",
            *nodes,
        )
    # K against V: evidence where there is some, else graph order (both have the width Nkv).
    perms.sort(key=lambda perm: order[perm["k"]] > order[perm["v"]])
    return perms[0]


# -- the whole analysis ------------------------------------------------------------------------


def _analyse(b: dict[str, Any], form: str) -> _Plan:
    """Prove the rewrite equivalent and plan it, or raise a refusal naming the reason."""
    normed = b["normed"]
    anchor = normed.producer()
    projections = _read_projections(b)
    dtype = projections[0].dtype
    k = projections[0].k
    residual = b.get("residual")
    a_in = _pick(b, "a", "x")
    skip_in = b.get("skip")
    rank = _first_rank(a_in, skip_in, residual, normed, *[p.output for p in projections])
    if form.removeprefix("add_").startswith("decomposed"):
        facts = _decomposed_facts(b, dtype, rank)
    else:
        facts = _op_norm_facts(b, dtype, rank)
    if rank not in (2, 3):
        raise _refuse(
            f"the norm's input {_label(facts.x)} has "
            + ("an unknown rank (run shape inference)" if rank is None else f"rank {rank}")
            + "; MatMulNBitsQkv takes [T, K] or [B, S, K]",
            facts.x,
        )
    last = _dims(a_in)
    if last is not None and last[-1] != k:
        raise _refuse(
            f"the norm's input {_label(a_in)} has last axis {last[-1]}, but the projections "
            f"have K={k}",
            a_in,
        )
    if not np.isfinite(facts.epsilon) or facts.epsilon < 0:
        raise _refuse(f"the norm's epsilon {facts.epsilon} is negative or not finite", anchor)
    scale = _fused_scale(facts, dtype, k)

    # What dies with the rewrite, and where A + skip comes from.
    proj_nodes = [p.node for p in projections]
    norm_nodes = _norm_nodes(normed, [a_in, skip_in, facts.scale])
    norm_ids = {id(n) for n in norm_nodes}
    proj_ids = {id(n) for n in proj_nodes}
    survives = _read_uses(normed, proj_ids) or any(
        _read_uses(v, norm_ids | proj_ids)
        for n in norm_nodes
        for v in n.outputs
        if v is not normed and v is not residual
    )
    a, skip, emit_residual = a_in, None, False
    if skip_in is not None:
        a, skip = b["a"], skip_in
        residual_read = residual is not None and _read_uses(residual, norm_ids)
        if survives:
            if residual is not None and residual.name:
                a, skip = residual, None  # the kept norm computes A + skip anyway
        elif residual_read:
            graph = anchor.graph
            order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
            here = order.get(id(anchor), -1)
            late = all(id(u) in norm_ids or order.get(id(u), -1) > here for u, _ in residual.uses())
            if late:
                emit_residual = True
            else:  # a reader sits before the norm: keep the Add for it, read its output
                a, skip = residual, None
        if skip is not None and not _same_shape(b["a"], skip):
            if form.startswith("skip_sln"):
                raise _refuse(
                    f"{_label(anchor)}: the skip {_label(skip)} cannot be proven to have the "
                    f"input's shape (it may broadcast); MatMulNBitsQkv's skip must match A",
                    anchor,
                    skip,
                )
            a, skip, emit_residual = residual, None, False
    graph = anchor.graph
    position = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    roles = _assign_roles(projections, [position.get(id(n), 0) for n in proj_nodes])
    replaced = list(proj_nodes)
    if not survives:
        replaced = norm_nodes + replaced
    return _Plan(
        anchor=anchor,
        normed=normed,
        a=a,
        skip=skip,
        scale=scale,
        epsilon=float(np.float32(facts.epsilon)),
        dtype=dtype,
        k=k,
        projections=projections,
        roles=roles,
        residual=residual,
        emit_residual=emit_residual,
        replaced=replaced,
    )


# -- the rule ----------------------------------------------------------------------------------


def _fresh_name(graph: ir.Graph | None, base: str, taken: set[str]) -> str:
    existing = graph.initializers if graph is not None else {}
    name, i = base, 1
    while name in existing or name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


class MatMulNBitsQkvRule(pattern.RewriteRuleClassBase):
    """One norm spelling and one mix of projection kinds -> ``com.microsoft.MatMulNBitsQkv``."""

    def __init__(self, form: str, mix: str, name: str | None = None) -> None:
        """Configure the instance: the norm spelling (:data:`NORM_FORMS`) and projection kinds."""
        if form not in NORM_FORMS:
            raise ValueError(f"form must be one of {NORM_FORMS}, got {form!r}")
        if mix not in PROJECTION_MIXES:
            raise ValueError(f"mix must be one of {PROJECTION_MIXES}, got {mix!r}")
        super().__init__(name or f"MatMulNBitsQkv[{form},{mix}]", remove_nodes=False)
        # configuration only: nothing about a match is ever stored on the rule
        self._form = form
        self._mix = mix

    @classmethod
    def rule(cls, *args, **kwargs) -> pattern.RewriteRule:
        """A RewriteRule using the readers-of-the-norm matcher (see :class:`_PreludeMatcher`)."""
        instance = cls(*args, **kwargs)
        return pattern.RewriteRule(
            instance.pattern,
            instance.rewrite,
            instance.check,
            _PreludeMatcher,
            name=instance.name,
            remove_nodes=False,
            graph_pre_visitor=instance.setup,
            graph_post_visitor=instance.cleanup,
        )

    def pattern(self, op):
        """The norm (first output: its anchor) and its three projections (+ the residual)."""
        normed, residual = _norm(op, self._form)
        outs = [normed] + [_projection(op, normed, s + 1, k) for s, k in enumerate(self._mix)]
        if residual is not None:
            outs.append(residual)
        return outs

    def check(self, context, **bindings) -> pattern.MatchResult:
        """Prove the rewrite equivalent; a failure names the reason in plain words."""
        del context
        result = pattern.MatchResult()
        try:
            _analyse(bindings, self._form)
        except Refusal as refusal:
            return result.fail(refusal.reason, list(refusal.failure_sources))
        return result

    def rewrite(self, op, **bindings):
        """Emit one MatMulNBitsQkv after the norm; rewire Q, K, V (and the residual)."""
        plan = _analyse(bindings, self._form)
        graph = plan.anchor.graph
        base = re.sub(r"[^A-Za-z0-9_.]+", "_", plan.anchor.name or plan.normed.name or "norm")
        base = f"{base}.qkv"
        taken: set[str] = set()

        def value(item: ir.Value | np.ndarray, suffix: str) -> ir.Value:
            if isinstance(item, ir.Value):
                return item
            name = _fresh_name(graph, f"{base}.{suffix}", taken)
            return op.initializer(ir.tensor(np.ascontiguousarray(item), name=name), name=name)

        inputs: list[ir.Value | None] = [
            plan.a,
            plan.skip,
            value(plan.scale, "norm_scale"),
        ]
        for role in _ROLES:
            p = plan.projections[plan.roles[role]]
            inputs += [value(p.b, f"{role}_B"), value(p.scales, f"{role}_scales"), None]
        outs = op.op(
            FUSED_OP,
            *inputs,
            _domain=MS_DOMAIN,
            _outputs=4 if plan.emit_residual else 3,
            _name=f"{base}/{FUSED_OP}",
            **plan.attributes(),
        )
        fused = outs[0].producer()
        fused.metadata_props[REPLACED_KEY] = json.dumps([_label(n) for n in plan.replaced])
        by_slot = {plan.roles[role]: outs[i] for i, role in enumerate(_ROLES)}
        result = [plan.normed] + [by_slot[i] for i in range(3)]
        if plan.residual is not None:
            result.append(outs[3] if plan.emit_residual else plan.residual)
        return result


def rule_instances() -> list[pattern.RewriteRule]:
    """Every instance: each norm spelling times each projection mix."""
    return [MatMulNBitsQkvRule.rule(form, mix) for form in NORM_FORMS for mix in PROJECTION_MIXES]


def rules() -> pattern.RewriteRuleSet:
    """The rule set. It never sweeps dead code itself: run a dead-code pass after it.

    To merge these rules into another ``RewriteRuleSet``, set its ``remove_unused_nodes`` to
    False as here: onnxscript turns it on for any set holding a ``remove_nodes=False`` rule, and
    then sweeps dead code even from graphs where nothing fused.
    """
    rule_set = pattern.RewriteRuleSet(rule_instances())
    rule_set.remove_unused_nodes = False
    return rule_set


# -- explanations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NearMiss:
    """A norm whose projections did not fuse: the norm's node, the reason, the values named."""

    rule: str
    root: str
    reason: str
    values: tuple[str, ...]


class _Recorder(_basics.MatchingTracer):
    """Keeps every logged match (onnxscript's tracer keeps only the best-scoring ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, ir.Node, _basics.MatchResult, _basics.MatchStatus]] = []

    def log(self, rule, container, node, match_result, status) -> None:  # type: ignore[override]
        del container
        self.records.append((str(rule), node, match_result, status))


def near_misses(model: onnx.ModelProto | ir.Model) -> list[NearMiss]:
    """Why each candidate norm did not fuse (a dry run: the model is not changed).

    A candidate is a norm whose match failed a check, or one read by other than three
    projections (at least one). Norms that some rule instance would fuse are not reported.
    """
    if isinstance(model, onnx.ModelProto):
        model = ir.serde.deserialize_model(model)
    recorder = _Recorder()
    rules().apply_to_model(model, tracer=recorder)
    fused = {id(node) for _, node, _, s in recorder.records if s == _basics.MatchStatus.SUCCESS}
    found: dict[tuple[int, str], NearMiss] = {}
    for rule, node, match, status in recorder.records:
        if id(node) in fused:
            continue
        reason = match.reason or ""
        if status == _basics.MatchStatus.CONDITION_FAILED or (
            status == _basics.MatchStatus.NO_MATCH and reason.startswith(_COUNT_PREFIX)
        ):
            values = tuple(_label(v) for v in match.failure_nodes_and_values)
            found.setdefault((id(node), reason), NearMiss(rule, _label(node), reason, values))
    return list(found.values())
