"""Hand-written MoE layers that write each expert's rows back by a boolean index_put.

Part of the "meaning" set (:mod:`onnx_moe_fuse.samples.handwritten_meaning`, issue 18). The
tokens are repeated k times (``repeat_interleave``: row ``t * k + j``), each expert runs on the
rows whose flat id is its own (``NonZero`` of ``ids == e``, a GatherND of those rows), and writes
its outputs back as torch's ``y[mask] = rows`` exports by dynamo: an element-wise ``ScatterND``
at ``NonZero`` of the mask expanded over the features, of the rows Expanded to
``[count, O]`` and flattened (DeepSeek-V2's ``moe`` training branch). The per-pair outputs are
then weighted and summed over the slots.

:func:`pair_rows_index_put` is the layer; :func:`trap_pair_rows_expert_missing` leaves the last
expert out of the loop, so the pairs that chose it keep the zeros they started from.
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from onnx_moe_fuse.samples.handwritten_graph import Fused, Graph, HandwrittenLayer, Refused, normal
from onnx_moe_fuse.samples.handwritten_meaning_act import moe_attrs

__all__ = ["pair_rows_index_put", "trap_pair_rows_expert_missing"]


def _write_back(g: Graph, y: str, mask: str, rows: str, width: int, e: int) -> str:
    """``y[mask] = rows`` as dynamo exports it (element tuples, rows flattened)."""
    mask_col = g.op("Unsqueeze", [mask, g.const(f"m_axis_{e}", [-1])], f"mask_col_{e}")
    shape = g.op("Concat", [g.op("Shape", [mask], f"mask_shape_{e}"), g.const(f"w_{e}", [width])],
                 f"mask_wide_shape_{e}", axis=0)  # fmt: skip
    wide = g.op("Expand", [mask_col, shape], f"mask_wide_{e}")
    where = g.op("Transpose", [g.op("NonZero", [wide], f"elements_{e}")], f"where_{e}", perm=[1, 0])
    count = g.op("ReduceSum", [g.op("Cast", [mask], f"mask_int_{e}", to=7)], f"count_{e}")
    rows_shape = g.op("Concat", [count, g.const(f"rw_{e}", [width])], f"rows_shape_{e}", axis=0)
    flat = g.op("Reshape", [g.op("Expand", [rows, rows_shape], f"rows_x_{e}"),
                            g.const(f"flat_{e}", [-1])], f"rows_flat_{e}")  # fmt: skip
    return g.op("ScatterND", [y, where, flat], f"y_{e}")


def pair_rows_index_put(seed: int = 210, experts_run: int | None = None) -> HandwrittenLayer:
    """Experts on repeat_interleave'd rows, written back by boolean index_put (see the module)."""
    rng = np.random.default_rng(seed)
    h, i, e_count, k = 16, 24, 4, 2
    g = Graph("pair_rows" if experts_run is None else "pair_rows_missing")
    x = g.input("x", ["T", h])
    z = g.op("MatMul", [x, g.init("wg", normal(rng, (h, e_count), h))], "z")
    probs = g.op("Softmax", [z], "p", axis=-1)
    w, ids = g.op_multi("TopK", [probs, g.init("k", [k])], ["w", "ids"], axis=-1)
    flat_ids = g.op("Reshape", [ids, g.const("flat_ids_shape", [-1])], "flat_ids")
    wide = g.op("Concat", [g.op("Shape", [x], "t_dim", start=0, end=1), g.const("kh", [k, h])],
                "tkh", axis=0)  # fmt: skip
    x3 = g.op("Expand", [g.op("Unsqueeze", [x, g.const("slot_axis", [1])], "x_t1h"), wide], "x_tkh")
    rep = g.op("Reshape", [x3, g.const("rep_shape", [-1, h])], "x_rep")
    y = g.op("ConstantOfShape", [g.op("Shape", [rep], "rep_dims")], "y_init",
             value=numpy_helper.from_array(np.zeros(1, np.float32)))  # fmt: skip
    w1, w2 = normal(rng, (e_count, h, i), h), normal(rng, (e_count, i, h), i)
    for e in range(e_count if experts_run is None else experts_run):
        mask = g.op("Equal", [flat_ids, g.const(f"e_{e}", np.array(e, np.int64))], f"mask_{e}")
        where = g.op("Transpose", [g.op("NonZero", [mask], f"nz_{e}")], f"rows_at_{e}", perm=[1, 0])
        rows = g.op("GatherND", [rep, where], f"rows_{e}")
        act = g.op("Relu", [g.op("MatMul", [rows, g.init(f"w1_{e}", w1[e])], f"fc1_{e}")], f"a_{e}")
        out = g.op("MatMul", [act, g.init(f"w2_{e}", w2[e])], f"fc2_{e}")
        y = _write_back(g, y, mask, out, h, e)
    for e in range(e_count if experts_run is None else experts_run, e_count):
        g.init(f"w1_{e}", w1[e])  # the skipped experts' weights stay (as a traced model's)
        g.init(f"w2_{e}", w2[e])
    slots = g.op("Reshape", [y, g.const("tko", [-1, k, h])], "slots")
    weighted = g.op("Mul", [slots, g.op("Unsqueeze", [w, g.const("w_axis", [-1])], "w3")], "wy")
    g.op("ReduceSum", [weighted, g.const("slot_dim", [1])], "out", keepdims=0)
    g.output("out", ["T", h])
    if experts_run is not None:
        return HandwrittenLayer(
            g.model(21),
            f"trap: the boolean index_put loop runs experts 0..{experts_run - 1} of {e_count}",
            Refused("fc2", "not a projection"),
        )
    return HandwrittenLayer(
        g.model(21),
        "repeat_interleave'd rows per expert by NonZero, written back by an element-wise "
        "ScatterND (torch's y[mask] = rows), weighted and summed over the slots",
        Fused("MoE", moe_attrs(k, "relu", normalize=0)),
    )


def trap_pair_rows_expert_missing(seed: int = 211) -> HandwrittenLayer:
    """Trap: :func:`pair_rows_index_put` whose loop leaves the last expert out."""
    return pair_rows_index_put(seed, experts_run=3)
