"""Splice a fused node from the canonicalised working copy into the original graph.

The layer rules run on a working copy that canonicalisation has rewritten freely
(``onnx_moe_fuse.rewrites.canonical``). What they emit there is moved into the *original* model,
replacing exactly the proved region, so everything outside fused layers stays as it was:

1. **What to copy.** From the fused node, walk back through values the working copy made
   (canonical forms, the rule's own Reshape of the router): those nodes are copied. The walk
   stops at values that came from the original (tagged by :func:`tag_origin` before
   canonicalisation; found again by name, which cloning keeps) and at constants; new constants
   (the repacked expert weights) become new initializers.
2. **The region.** In the original, the nodes between those boundary values and the value the
   fused node replaces: every node the output depends on, walking back until a boundary value or
   a constant. A region that reads a graph input or a value the fused node does not take is
   refused (the fused node would ignore an input): the check on the working copy and the
   original must agree on what the layer reads.
3. **Escapes.** A region value used outside the region may stay when it is upstream of the
   experts, i.e. does not depend on the tokens (the router Softmax of gpt-oss blocks, which is
   also a graph output; dequantized weights another node also reads): the nodes computing it are
   kept, and so is a function of the tokens alone (the flattened rows or the norm the router
   reads too: no projection, gather, mask or selection among its ancestors).
   Any other escaping value that depends on the tokens is refused, naming it.
4. **Splice.** Insert the copies before the region's last node, move every use of the replaced
   value (graph outputs included) to the fused output, remove the region less what was kept,
   drop initializers only the removed nodes read, and give the fused output the old name.

The region and escape analysis use a networkx graph of the region's nodes and boundary values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "ORIGIN_KEY",
    "Spliced",
    "origin_tail",
    "splice_fused_node",
    "tag_origin",
]

#: ``Value.meta`` key set on every value of the working copy before canonicalisation.
ORIGIN_KEY = "onnx_moe_fuse.origin"


@dataclass(frozen=True)
class Spliced:
    """A spliced layer: the fused node in the original and the original nodes it replaced."""

    node: ir.Node
    replaced: tuple[str, ...]
    kept: tuple[str, ...]


def tag_origin(graph: ir.Graph) -> None:
    """Mark every value of ``graph`` (a fresh clone of the original) as coming from it."""
    for v in (*graph.inputs, *graph.initializers.values()):
        v.meta[ORIGIN_KEY] = True
    for node in graph:
        for v in node.outputs:
            v.meta[ORIGIN_KEY] = True


def _label(node: ir.Node) -> str:
    if node.name:
        return node.name
    return f"{node.op_type}({node.outputs[0].name if node.outputs else ''})"


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values: dict[str, ir.Value] = {}
    for v in (*graph.inputs, *graph.initializers.values()):
        if v.name:
            values[v.name] = v
    for node in graph:
        for v in node.outputs:
            if v.name:
                values[v.name] = v
    return values


def _is_constant(v: ir.Value) -> bool:
    """An initializer that is not also a graph input (which a caller could override)."""
    return v.is_initializer() and not v.is_graph_input()


def _to_copy(fused: ir.Node) -> tuple[list[ir.Node], list[ir.Value], list[ir.Value]]:
    """Working-copy nodes to copy (fused node last), origin values and new constants read."""
    nodes: dict[int, ir.Node] = {}
    origin: dict[int, ir.Value] = {}
    constants: dict[int, ir.Value] = {}
    todo = [fused]
    while todo:
        node = todo.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        for v in node.inputs:
            if v is None:
                continue
            if v.meta.get(ORIGIN_KEY):
                origin[id(v)] = v
            elif v.producer() is None:
                if not _is_constant(v):
                    raise Refusal(
                        f"the fused node reads '{v.name}', which is not constant", part="region"
                    )
                constants[id(v)] = v
            else:
                todo.append(v.producer())
    graph = fused.graph
    order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    copied = sorted(nodes.values(), key=lambda n: order.get(id(n), 0))
    return copied, list(origin.values()), list(constants.values())


def _region(output: ir.Value, boundary: list[ir.Value]) -> tuple[nx.DiGraph, dict[int, ir.Node]]:
    """The original nodes the output depends on, back to the boundary values and constants."""
    stop = {id(v) for v in boundary}
    reached: set[int] = set()
    g = nx.DiGraph()
    region: dict[int, ir.Node] = {}
    root = output.producer()
    assert root is not None
    todo = [root]
    while todo:
        node = todo.pop()
        if id(node) in region:
            continue
        region[id(node)] = node
        g.add_node(("n", id(node)))
        if any(
            a.type == ir.AttributeType.GRAPH or a.type == ir.AttributeType.GRAPHS
            for a in node.attributes.values()
        ):
            raise Refusal(
                f"the layer holds control flow ({node.op_type} '{_label(node)}')", part="region"
            )
        for v in node.inputs:
            if v is None:
                continue
            if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
                # a read of a shape only: the layer proof showed the fused node needs no more
                # than the token count it takes (grouped_mm sizes its un-sort from Shape(x))
                continue
            if id(v) in stop:
                reached.add(id(v))
                g.add_edge(("v", id(v)), ("n", id(node)))
                continue
            producer = v.producer()
            if producer is None:
                if _is_constant(v):
                    continue
                raise Refusal(
                    f"the layer in the model reads '{v.name}' "
                    + (
                        "(a graph input with a default initializer)"
                        if v.is_initializer()
                        else "(a graph input)"
                    )
                    + ", which the fused node does not take",
                    v,
                    part="region",
                )
            g.add_edge(("n", id(producer)), ("n", id(node)))
            todo.append(producer)
    upstream = _ancestors([v for v in boundary if id(v) in reached])
    for v in boundary:
        # a value the fused node reads beside a reached one it is computed into (Llama4's
        # router logits, upstream of the scores that scale the tokens) is no other input
        if id(v) not in reached and id(v) not in upstream:
            raise Refusal(
                f"the fused node reads '{v.name}', which the layer in the model does not",
                v,
                part="region",
            )
    _add_dead_feeders(g, region, boundary)
    return g, region


def _ancestors(values: list[ir.Value], limit: int = 4096) -> set[int]:
    """The ids of every value the given values are computed from (bounded walk)."""
    seen: set[int] = set()
    todo = list(values)
    while todo and len(seen) < limit:
        v = todo.pop()
        node = v.producer()
        if node is None:
            continue
        for x in node.inputs:
            if x is not None and id(x) not in seen:
                seen.add(id(x))
                todo.append(x)
    return seen


def _add_dead_feeders(g: nx.DiGraph, region: dict[int, ir.Node], boundary: list[ir.Value]) -> None:
    """Take into the region the nodes after it that only feed it back (shape computations).

    The walk above stops at what a ``Shape`` reads, so nodes between a region value and such a
    read are outside the region while they read it: the TorchScript expert loop's
    ``Shape(Slice(acc, rows 0:1))``, or optimum's dense gpt-oss, where ``Shape(dense)[1]``
    becomes Unsqueeze / Concat pieces of shapes inside the layer. They would count as escapes,
    yet they are dead once the region is gone. Such a node is downstream of the region, none of
    its outputs is a graph output, a boundary value (the fused node reads those) or read by a
    node that stays; one backward pass over what follows the region finds them (linear in
    the nodes after it), and they are added with their edges.
    """
    keep_out = {id(v) for v in boundary}
    later: dict[int, ir.Node] = {}
    todo = [u for n in region.values() for o in n.outputs for u, _ in o.uses()]
    while todo:
        node = todo.pop()
        if id(node) in region or id(node) in later:
            continue
        later[id(node)] = node
        todo.extend(u for o in node.outputs for u, _ in o.uses())

    def stays_dead(node: ir.Node, dead: dict[int, ir.Node]) -> bool:
        if not node.outputs:
            return False
        for out in node.outputs:
            if out.is_graph_output() or id(out) in keep_out:
                return False
            if any(id(u) not in region and id(u) not in dead for u, _ in out.uses()):
                return False
        return True

    # users come after their producers in the graph's (topological) order: walked backwards,
    # every user of a node is decided before it, so one pass finds the fixpoint
    graph = next(iter(region.values())).graph
    order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    dead: dict[int, ir.Node] = {}
    for node in sorted(later.values(), key=lambda n: order.get(id(n), 0), reverse=True):
        if stays_dead(node, dead):
            dead[id(node)] = node
    for node in dead.values():
        region[id(node)] = node
    for node in dead.values():
        for v in node.inputs:
            producer = v.producer() if v is not None else None
            if producer is not None and id(producer) in region:
                g.add_edge(("n", id(producer)), ("n", id(node)))
        for o in node.outputs:
            g.add_edges_from((("n", id(node)), ("n", id(u))) for u, _ in o.uses())


def _check_kept_inputs(region: dict[int, ir.Node], keep: set[int]) -> None:
    """Refuse when a node that stays would read a value made by a node that goes.

    Kept nodes are those computing values used outside, with their ancestors; a ``Shape``
    read has no edge to what it reads (the walk does not follow it), so a kept one could read
    a removed value: the model would lose the value.
    """
    for i in keep:
        node = region[i]
        for v in node.inputs:
            producer = v.producer() if v is not None else None
            if producer is not None and id(producer) in region and id(producer) not in keep:
                raise Refusal(
                    f"'{_label(node)}' stays (a value it leads to is used outside the layer) but "
                    f"reads '{v.name}', which the fused node replaces",
                    v,
                    part="region",
                )


#: Ops that only lay out the tokens: a value they make from the tokens alone (the flattened
#: rows the router reads too) may stay for its other users; it is no part of the experts' work.
_TOKEN_LAYOUT = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


#: Shape arithmetic (a Reshape target computed from the tokens' Shape): no data of its own.
_SHAPE_ARITHMETIC = frozenset(
    {"Shape", "Size", "Constant", "Concat", "Gather", "Slice", "Cast", "Squeeze", "Unsqueeze",
     "Mul", "Div", "Add", "Sub", "ReduceProd", "Identity"}
)  # fmt: skip


#: Elementwise and reducing ops a token prelude (a norm, a dtype Cast) may hold: with no
#: projection, gather, mask or selection among its ancestors it computes from the tokens alone,
#: so keeping it for its other users (the router) keeps no expert work.
_TOKEN_ARITHMETIC = frozenset(
    {"Cast", "CastLike", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Abs",
     "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "Exp", "Log", "Erf", "Tanh",
     "Sigmoid", "Max", "Min", "Clip", "SimplifiedLayerNormalization", "LayerNormalization",
     "RMSNormalization"}
)  # fmt: skip


def _prelude_node(node: ir.Node) -> bool:
    """A layout or elementwise function of the tokens, or integer shape arithmetic."""
    if node.op_type == "Constant" or node.op_type in _TOKEN_LAYOUT | _TOKEN_ARITHMETIC:
        return True
    ints = (ir.DataType.INT64, ir.DataType.INT32)
    return node.op_type in _SHAPE_ARITHMETIC and all(
        o.dtype in ints or node.op_type in ("Shape", "Size") for o in node.outputs
    )


def _kept(
    g: nx.DiGraph, region: dict[int, ir.Node], output: ir.Value, tokens: ir.Value | None
) -> set[int]:
    """Region nodes to keep for values used outside; refuse escapes that depend on the tokens."""
    keep: set[int] = set()
    for node in region.values():
        for out in node.outputs:
            if out is output:
                continue
            outside = [u for u, _ in out.uses() if id(u) not in region]
            if not outside and not out.is_graph_output():
                continue
            where = (
                "a graph output"
                if out.is_graph_output()
                else f"used by {outside[0].op_type} '{_label(outside[0])}' outside the layer"
            )
            ancestors = nx.ancestors(g, ("n", id(node)))
            prelude = _prelude_node(node) and all(
                _prelude_node(region[i]) for kind, i in ancestors if kind == "n"
            )
            if tokens is not None and ("v", id(tokens)) in ancestors and not prelude:
                raise Refusal(
                    f"an intermediate value escapes the layer: '{out.name}' ({node.op_type} "
                    f"'{_label(node)}') is also {where}, and it depends on the expert "
                    "computation",
                    out,
                    part="region",
                )
            keep.add(id(node))
            keep.update(i for kind, i in ancestors if kind == "n")
    return keep


def _fresh(taken: Iterable[str], base: str) -> str:
    taken = set(taken)
    base = re.sub(r"[^A-Za-z0-9_./:-]+", "_", base) or "fused"
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


#: Ops a tail may hold: they regroup the fused output's elements and compute nothing, or (Add)
#: add a model value the layer was scatter-added into (the meaning pass writes the layer, then
#: ``Add(layer, base)``: the base's nodes stay in the model, a boundary of the copy).
_TAIL_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Identity", "Add"})
#: A tail longer than this is not a regrouping canonicalisation left behind.
_MAX_TAIL = 4


def origin_tail(fused: ir.Node, replaces: str, original: ir.Graph) -> tuple[ir.Node, str]:
    """Where the fused node's region ends in ``original``: ``(fused, replaces)`` or a layout tail.

    ``replaces`` names the layer output the rule proved (the fused output takes that name).
    Canonicalisation may have moved a Reshape of it below the combine (optimum's dense gpt-oss
    sums over ``[E, B, S, H]``; :mod:`~onnx_moe_fuse.rewrites.canonical.spellings.split_rows`
    sums over flat rows and splits after), so that the proved output is a canonical value the
    original lacks, and the original's layer output is that of a Reshape after it. Then this
    follows the chain of single-use layout ops from the fused node to the first value the
    original has (by name: the working copy keeps the original's names, canonical values get
    fresh ones) and returns that op and its output's name; otherwise ``(fused, replaces)``.
    """
    names = _values_by_name(original)
    if replaces in names:
        return fused, replaces
    node = fused
    for _ in range(_MAX_TAIL):
        users = node.outputs[0].uses()
        if len(users) != 1 or node.outputs[0].is_graph_output():
            break
        user, index = users[0]
        if index != 0 or user.op_type not in _TAIL_OPS or user.domain not in ("", "ai.onnx"):
            break
        node = user
        name = node.outputs[0].name or ""
        if name in names:
            return node, name
    return fused, replaces


def splice_fused_node(
    model: ir.Model,
    fused: ir.Node,
    replaces: str,
    *,
    tokens_input: int = 0,
    last: ir.Node | None = None,
) -> Spliced:
    """Replace the region of ``model`` that the working-copy node ``fused`` was proved to equal.

    ``fused`` lives in the canonicalised working copy (:func:`tag_origin` called on it before
    canonicalisation); ``replaces`` names the value its output replaces, or the output of
    ``last``, a layout tail after it (:func:`origin_tail`), which is then copied with it;
    ``tokens_input`` is its input that carries the tokens (the escape analysis keeps only
    values that do not depend on it). Raises a
    :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` of part ``region``, naming the
    value at fault, and leaves ``model`` unchanged when the region cannot be proved.
    """
    graph = model.graph
    values = _values_by_name(graph)
    last = fused if last is None else last
    out_w = last.outputs[0]
    target = values.get(replaces)
    if target is None or target.producer() is None:
        raise Refusal(
            f"the layer output '{replaces}' was made by canonicalisation and has no "
            "counterpart in the model",
            target if target is not None else ir.Value(name=replaces),  # names it in the report
            part="region",
        )
    copies, origin, constants = _to_copy(last)
    mapping: dict[int, ir.Value] = {}
    boundary: list[ir.Value] = []
    for v in origin:
        ov = values.get(v.name or "")
        if ov is None:
            raise Refusal(
                f"the fused node reads '{v.name}', which the model lacks", v, part="region"
            )
        mapping[id(v)] = ov
        if not _is_constant(ov):
            boundary.append(ov)
    w_tokens = fused.inputs[tokens_input] if tokens_input < len(fused.inputs) else None
    tokens = mapping.get(id(w_tokens)) if w_tokens is not None else None

    g, region = _region(target, boundary)
    keep = _kept(g, region, target, tokens)
    _check_kept_inputs(region, keep)
    for v in boundary:  # the copy reads it: a node of the region that makes it must stay
        producer = v.producer()
        if producer is not None and id(producer) in region and id(producer) not in keep:
            raise Refusal(
                f"the fused nodes read '{v.name}', which {producer.op_type} "
                f"'{_label(producer)}' of the replaced layer computes",
                v,
                part="region",
            )

    # -- from here on the model changes; nothing below can refuse --------------------------
    taken_values = set(values)
    for v in constants:
        name = _fresh(taken_values, v.name or "fused_weight")
        taken_values.add(name)
        init = ir.Value(name=name, type=v.type, shape=v.shape, const_value=v.const_value)
        graph.register_initializer(init)
        mapping[id(v)] = init
    taken_nodes = {n.name for n in graph if n.name}
    root = target.producer()
    assert root is not None
    new_nodes: list[ir.Node] = []
    for node in copies:
        clone = ir.Node(
            node.domain,
            node.op_type,
            [None if v is None else mapping[id(v)] for v in node.inputs],
            attributes=list(node.attributes.values()),
            overload=node.overload,
            num_outputs=len(node.outputs),
            version=node.version,
            name=_fresh(taken_nodes, node.name or node.op_type),
            metadata_props=dict(node.metadata_props),
        )
        taken_nodes.add(clone.name)
        for old, new in zip(node.outputs, clone.outputs, strict=True):
            new.type, new.shape = old.type, old.shape
            if old is not out_w:
                new.name = _fresh(taken_values, old.name or f"{clone.name}_out")
                taken_values.add(new.name)
            mapping[id(old)] = new
        new_nodes.append(clone)
    graph.insert_before(root, new_nodes)
    fused_out = mapping[id(out_w)]
    fused_out.type = target.type or fused_out.type
    fused_out.shape = target.shape or fused_out.shape
    ir.convenience.replace_all_uses_with(target, fused_out, replace_graph_outputs=True)

    removed = [n for i, n in region.items() if i not in keep]
    order = {id(n): i for i, n in enumerate(graph)}
    removed.sort(key=lambda n: order[id(n)])
    read = {id(v): v for n in removed for v in n.inputs if v is not None}
    replaced = tuple(_label(n) for n in removed)
    graph.remove(removed, safe=True)
    name = target.name
    target.name = None
    fused_out.name = name
    for v in read.values():
        if _is_constant(v) and not v.uses() and not v.is_graph_output() and v.name:
            graph.initializers.pop(v.name, None)

    for domain in {n.domain for n in new_nodes if n.domain not in ("", "ai.onnx")}:
        version = fused.graph.opset_imports.get(domain, 1) if fused.graph is not None else 1
        model.opset_imports.setdefault(domain, version)
        graph.opset_imports.setdefault(domain, version)
    kept = tuple(_label(region[i]) for i in keep)
    fused_clone = mapping[id(fused.outputs[0])].producer()
    assert fused_clone is not None
    return Spliced(node=fused_clone, replaced=replaced, kept=kept)
