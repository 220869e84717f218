"""Whether a dense layer's experts map a zero input row to zero (Llama4's unselected experts).

Llama4's dense form (:mod:`.prescaled`) runs every expert on every token with the rows of the
experts a token did not choose scaled to zero; those experts add nothing only when each maps a
zero row to zero: no biases, and an activation that is 0 at 0, evaluated here by ONNX's
reference evaluator on a copy of the activation's nodes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import const_array
from onnx_moe_fuse.rewrites.canonical.experts.dense.ffn import ExpertMLP

__all__ = ["maps_zero_to_zero"]


def maps_zero_to_zero(mlp: ExpertMLP) -> bool:
    """Every expert maps a zero row to zero: no biases, and act(0, ...) = 0 (evaluated)."""
    if any(p.bias is not None for p in (*mlp.fc1, mlp.fc2)):
        return False
    inputs, inits, produced = [], [], {id(o) for n in mlp.act_nodes for o in n.outputs}
    feeds: dict[str, np.ndarray] = {}
    names: dict[int, str] = {}
    for j, p in enumerate(mlp.fc1):
        # float32 zeros: every op of an activation maps 0 to the same in any float type
        # one row of the projection's rank (a stacked [E, T, N] activation splits along axis 2)
        row = (1,) * (len(p.weight.shape) - 1) + (int(p.weight.shape[-1]),)
        feeds[f"fc1_{j}"] = np.zeros(row, dtype=np.float32)
        names[id(p.out)] = f"fc1_{j}"
        inputs.append(onnx.helper.make_tensor_value_info(f"fc1_{j}", 1, None))
    nodes = []
    for n in mlp.act_nodes:
        ins = []
        for v in n.inputs:
            if v is None:
                ins.append("")
                continue
            if id(v) not in names:
                if id(v) in produced:
                    names[id(v)] = f"v{len(names)}"
                else:
                    array = const_array(v)
                    if array is None:
                        return False
                    names[id(v)] = f"c{len(names)}"
                    inits.append(onnx.numpy_helper.from_array(np.asarray(array), names[id(v)]))
            ins.append(names[id(v)])
        outs = []
        for o in n.outputs:
            names.setdefault(id(o), f"v{len(names)}")
            outs.append(names[id(o)])
        attrs = {k: a.value for k, a in n.attributes.items() if not a.is_ref()}
        nodes.append(onnx.helper.make_node(n.op_type, ins, outs, **attrs))
    out_name = names.get(id(mlp.act_out))
    if out_name is None:
        return False
    graph = onnx.helper.make_graph(
        nodes, "act", inputs, [onnx.helper.make_tensor_value_info(out_name, 1, None)], inits
    )
    try:
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
        (out,) = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # noqa: BLE001 - an activation the evaluator cannot run is not proved
        return False
    return bool(np.all(np.asarray(out) == 0))
