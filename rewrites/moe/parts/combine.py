"""Combine: the weighted sum over each token's k slots that ends an MoE layer.

Spellings (``w`` the routing weights ``[*, k]``, ``y`` FC2's output)::

    reduce_sum        ReduceSum(Mul(y, Unsqueeze(w, -1)), k axis)      y [*, k, H]  (either order)
    matmul_squeeze    Squeeze(MatMul(Unsqueeze(w, k-1 axis), y), axis)  y [*, k, H]
    matmul_reshape    Reshape(MatMul(Unsqueeze(w, k-1 axis), y), shape) y [*, k, H]
    reshape_reduce_sum   ReduceSum(Reshape(Mul(y, Unsqueeze(Reshape(w, [-1]), -1)), [-1, k, H]), 1)
                                                                      y [T*k, H]  (either order)

(Einsum combines are MatMul ones after canonicalisation.) A float16/bfloat16 export may sum in
float32 what FC2 computed in half precision, ``Mul(Cast(y, to=FLOAT), w)``: the widening Cast is
exact, so ``y`` is FC2's output as read (bound ``combine_upcast``); so is a widening Cast of
the weighted slots just before the ReduceSum (tag ``sum_cast``). :func:`combine_pattern` builds a form
for a rule's pattern; :func:`recognise_combine` recognises one at a node. The axes, shapes and
``keepdims`` are proved by the layer proofs.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.graph.match import PartPattern
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.parts.facts import CombineFact, precision_cast

__all__ = ["COMBINE_FORMS", "SLOT_COMBINES", "combine_pattern", "recognise_combine"]

#: The combine forms that read ``[*, k, H]`` slots.
SLOT_COMBINES = ("reduce_sum", "matmul_squeeze", "matmul_reshape")
#: Every combine form; ``reshape_reduce_sum`` reads flattened ``[T*k, H]`` rows.
COMBINE_FORMS = (*SLOT_COMBINES, "reshape_reduce_sum")


def _var(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


def _maybe_upcast(op, summed: Any) -> Any:
    """``summed`` or ``Cast(summed)`` (tag ``sum_cast``): a float16 export sums in float32."""
    return pattern.OrValue(
        [summed, op.Cast(summed)], tag_var="sum_cast", tag_values=["none", "upcast"]
    )


def combine_pattern(op, form: str, expert_out: Any, weights: Any) -> Any:
    """The combine ``form`` of ``expert_out`` by ``weights`` (pattern values); its output.

    Binds ``layer_out`` and the combine's own nodes: ``routing_weights_unsq``, ``combine_axes``,
    ``combine_unsq_axes``, ``combine_shape`` (slot forms) or ``weights_flat``, ``weights_col``,
    ``combine_unflat``, ``weights_flat_shape``, ``weights_col_axes`` (rows).
    """
    if form == "reshape_reduce_sum":
        flat_w = op.Reshape(weights, _var("weights_flat_shape"), _outputs=["weights_flat"])
        col_w = op.Unsqueeze(flat_w, _var("weights_col_axes", True), _outputs=["weights_col"])
        weighted = pattern.OrValue([op.Mul(expert_out, col_w), op.Mul(col_w, expert_out)])
        slots = op.Reshape(weighted, _var("combine_shape"), _outputs=["combine_unflat"])
        return op.ReduceSum(
            _maybe_upcast(op, slots), _var("combine_axes", True), _outputs=["layer_out"]
        )
    unsq = op.Unsqueeze(weights, _var("combine_unsq_axes", True), _outputs=["routing_weights_unsq"])
    if form == "reduce_sum":
        weighted = pattern.OrValue([op.Mul(expert_out, unsq), op.Mul(unsq, expert_out)])
        return op.ReduceSum(
            _maybe_upcast(op, weighted), _var("combine_axes", True), _outputs=["layer_out"]
        )
    mixed = op.MatMul(unsq, expert_out)
    if form == "matmul_squeeze":
        return op.Squeeze(mixed, _var("combine_axes", True), _outputs=["layer_out"])
    if form == "matmul_reshape":
        return op.Reshape(mixed, _var("combine_shape"), _outputs=["layer_out"])
    raise ValueError(f"unknown combine form {form!r}; choose among {COMBINE_FORMS}")


def _recogniser(form: str) -> PartPattern:
    return PartPattern(
        f"combine/{form}",
        lambda op: combine_pattern(op, form, _var("expert_out"), _var("combine_weights")),
    )


_PATTERNS = {form: _recogniser(form) for form in COMBINE_FORMS}


def recognise_combine(root: ir.Node, form: str | None = None) -> CombineFact:
    """The combine ending at ``root`` (in ``form``, or in the first form that matches)."""
    forms = COMBINE_FORMS if form is None else (form,)
    for f in forms:
        match = _PATTERNS[f].match(root)
        if match is None:
            continue
        b = dict(match.bindings)
        expert_out, weights = b.pop("expert_out"), b.pop("combine_weights")
        nodes = tuple(match.nodes)
        if b.pop("sum_cast", "none") == "upcast":
            summed = root.inputs[0]
            cast = precision_cast(summed, widening=True)
            if cast is None:
                raise Refusal(
                    f"the combine's ReduceSum '{label(root)}' sums a Cast that is not a widening "
                    "float cast (float16/bfloat16 -> float32): the weighted slots would change",
                    summed.producer() or root,
                    part="combine",
                )
            b["combine_dtype"] = ir.DataType(cast.attributes["to"].as_int())
        upcast = precision_cast(expert_out, widening=True)
        if upcast is not None:
            # a float16 export sums in float32: Mul(Cast(y16, to=float), w32). The Cast is
            # exact; FC2 is what it reads, and the fused node's output is cast to the sum's type
            expert_out = upcast.inputs[0]
            nodes = (*nodes, upcast)
            b["combine_upcast"] = upcast
            b["combine_dtype"] = ir.DataType(upcast.attributes["to"].as_int())
        return CombineFact(
            form=f,
            root=root,
            expert_out=expert_out,
            weights=weights,
            nodes=nodes,
            bindings=b,
        )
    raise Refusal(
        f"{root.op_type} '{label(root)}' is not a weighted sum over the k slots ("
        + ", ".join(forms)
        + ")",
        root,
        part="combine",
        expected=" | ".join(_PATTERNS[f].name for f in forms),
    )
