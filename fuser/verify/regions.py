"""One fused layer and the original region it replaced, as two small models (per-layer verification).

:func:`layer_models` cuts, from the original and the fused model (protos without their tensor
data), the two sub-models that per-layer verification compares (:mod:`.layers`):

* the original region: the nodes the fusion report says the fused node replaced, plus the
  Constant nodes they read; its inputs are the other values it reads (the tokens, a kept
  router's output), its outputs the values it makes that anything outside reads;
* the fused region: the backward cone of those same outputs in the fused model, down to the
  same inputs and the initializers (the fused node, the routing nodes the rule added, kept
  nodes between).

Both take their initializers as they are in their model (external data references, read later
by the caller from the model's folder: one layer's weights at a time), and the value types the
models declare or ONNX shape inference gives (inference on protos without data reads no
weight).

:func:`select_before_dequantize` is for the reference run of the original region: a
``Gather`` along axis 0 of a ``DequantizeLinear`` of constants (stacked expert weights) becomes
a ``DequantizeLinear`` of the gathered codes, scales and zero points. That is an identity
(``DequantizeLinear`` maps each element with its own block's scale, and the Gather picks whole
experts), so the reference computes exactly what the region computes, but dequantises only
the experts the tokens select rather than every expert of the layer (2.4 GB of float32 for one
Qwen3-30B-A3B layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

__all__ = ["copy_node", "layer_models", "select_before_dequantize", "value_infos"]


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def _value_infos(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every value's declared (or inferred) type, by name."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=False)
    except Exception:  # a model ONNX's inference refuses: the declared types only
        inferred = proto
    g = inferred.graph
    return {v.name: v for v in (*g.value_info, *g.input, *g.output)}


def _model(
    like: onnx.ModelProto,
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[str],
    outputs: list[str],
    inits: Mapping[str, onnx.TensorProto],
    infos: Mapping[str, onnx.ValueInfoProto],
) -> onnx.ModelProto:
    used = {v for n in nodes for v in n.input if v}

    def info(value: str) -> onnx.ValueInfoProto:
        if value in infos:
            return infos[value]
        return onnx.helper.make_empty_tensor_value_info(value)

    graph = onnx.helper.make_graph(
        nodes,
        name,
        [info(v) for v in inputs],
        [info(v) for v in outputs],
        initializer=[inits[v] for v in sorted(used) if v in inits],
    )
    model = onnx.helper.make_model(graph, opset_imports=list(like.opset_import))
    model.ir_version = like.ir_version
    return model


def value_infos(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every value's declared (or inferred) type, by name: once per model, for :func:`layer_models`."""
    return _value_infos(proto)


def layer_models(
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    fusion: Mapping[str, Any],
    infos: Mapping[str, onnx.ValueInfoProto] | None = None,
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The original region ``fusion`` replaced and its fused region, as two models.

    ``fusion`` is one entry of the report's ``fusions`` (its ``replaced`` node names);
    ``infos``: :func:`value_infos` of both models (computed here when None). Raises
    ``ValueError`` when the region cannot be found again (a report of another model).
    """
    replaced = set(fusion["replaced"])
    og = original.graph
    nodes = list(og.node)
    names = {n.name for n in nodes if n.name}
    missing = sorted(replaced - names)
    if missing:
        raise ValueError(f"the original has no nodes {missing[:3]} of layer {fusion['name']!r}")
    index = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    chosen = {i for i, n in enumerate(nodes) if n.name in replaced}
    o_inits = {t.name: t for t in og.initializer}
    inputs: list[str] = []
    todo = sorted(chosen)
    while todo:
        for v in nodes[todo.pop()].input:
            if not v or v in o_inits or v in inputs or (v in index and index[v] in chosen):
                continue
            p = index.get(v)
            if p is not None and nodes[p].op_type == "Constant" and not nodes[p].input:
                chosen.add(p)  # a constant read by the region: part of it
            else:
                inputs.append(v)
    region = [nodes[i] for i in sorted(chosen)]
    outside = {v for i, n in enumerate(nodes) if i not in chosen for v in n.input}
    graph_outputs = {o.name for o in og.output}
    outputs = [v for n in region for v in n.output if v and (v in outside or v in graph_outputs)]
    if not outputs:
        raise ValueError(f"layer {fusion['name']!r}: its region has no output read outside it")

    fg = fused.graph
    f_inits = {t.name: t for t in fg.initializer}
    f_nodes = list(fg.node)
    f_index = {out: i for i, n in enumerate(f_nodes) for out in n.output if out}
    stop = set(inputs)
    cone: set[int] = set()
    todo = list(outputs)
    while todo:
        v = todo.pop()
        if v in stop or v in f_inits or not v:
            continue
        i = f_index.get(v)
        if i is None:
            raise ValueError(
                f"layer {fusion['name']!r}: the fused model computes {v!r} from something "
                "the original region does not read"
            )
        if i not in cone:
            cone.add(i)
            todo.extend(f_nodes[i].input)
    fused_nodes = [f_nodes[i] for i in sorted(cone)]
    if infos is None:
        infos = {**value_infos(original), **value_infos(fused)}
    name = str(fusion["name"])
    return (
        _model(original, f"original {name}", region, inputs, outputs, o_inits, infos),
        _model(fused, f"fused {name}", fused_nodes, inputs, outputs, f_inits, infos),
    )


def select_before_dequantize(model: onnx.ModelProto) -> int:
    """Gather the experts before dequantising them, in place (see the module); how many."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = _producers(g)
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for v in n.input:
            users.setdefault(v, []).append(n)
    count = 0
    for gather in list(g.node):
        if gather.op_type != "Gather" or gather.domain not in ("", "ai.onnx"):
            continue
        axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
        dq = producers.get(gather.input[0])
        if axis != 0 or dq is None or dq.op_type != "DequantizeLinear":
            continue
        if not all(v in inits for v in dq.input if v):
            continue
        rank = len(inits[dq.input[0]].dims)
        dq_axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) % max(rank, 1)
        scale_rank = len(inits[dq.input[1]].dims)
        if rank < 2 or dq_axis == 0 or scale_rank not in (0, rank):
            continue  # per-expert scales: a gather would change how they broadcast
        if any(u.op_type != "Gather" for u in users.get(dq.output[0], [])):
            continue
        idx = gather.input[1]
        new_inputs = []
        for i, v in enumerate(dq.input):
            if not v or (i > 0 and scale_rank == 0):
                new_inputs.append(v)
                continue
            out = f"{gather.output[0]}/selected_{i}"
            g.node.append(onnx.helper.make_node("Gather", [v, idx], [out], axis=0))
            new_inputs.append(out)
        at = next(i for i, n in enumerate(g.node) if n.output == gather.output)
        replacement = onnx.helper.make_node(
            "DequantizeLinear", new_inputs, list(gather.output), name=f"{gather.name}/selected"
        )
        for a in dq.attribute:  # the axis counted from the end: the gather adds leading axes
            replacement.attribute.append(
                onnx.helper.make_attribute("axis", dq_axis - rank) if a.name == "axis" else a
            )
        if not any(a.name == "axis" for a in dq.attribute):
            replacement.attribute.append(onnx.helper.make_attribute("axis", dq_axis - rank))
        del g.node[at]
        g.node.insert(at, replacement)
        count += 1
    if count:
        _topological(g)
        used = {v for n in g.node for v in n.input}
        kept = [
            copy_node(n) for n in g.node if n.op_type != "DequantizeLinear" or n.output[0] in used
        ]
        del g.node[:]
        g.node.extend(kept)
    return count


def _topological(g: onnx.GraphProto) -> None:
    """Order ``g``'s nodes so that each comes after what it reads (a stable sort)."""
    known = {v.name for v in g.input} | {t.name for t in g.initializer} | {""}
    left = list(g.node)
    ordered: list[onnx.NodeProto] = []
    while left:
        ready = [n for n in left if all(v in known for v in n.input)]
        if not ready:
            raise ValueError("the region has a cycle or reads a value nothing makes")
        for n in ready:
            known.update(n.output)
        ordered.extend(ready)
        ready_ids = {id(n) for n in ready}
        left = [n for n in left if id(n) not in ready_ids]
    ordered = [copy_node(n) for n in ordered]  # wrappers of removed messages are not to be trusted
    del g.node[:]
    g.node.extend(ordered)


def copy_node(node: onnx.NodeProto) -> onnx.NodeProto:
    """A detached copy of ``node`` (to rebuild a graph's node list from)."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out
