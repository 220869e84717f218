"""Which projection is Q, which K and which V: widths, then downstream attention use, then names.

K and V share a width; a third width is Q. Where widths do not decide, the attention op (or
decomposed attention) the output reaches decides, then RotaryEmbedding, then names; evidence
that contradicts the widths refuses the rewrite.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.qkv.graph import (
    MS_DOMAIN,
    ROLES,
    item_label,
)
from onnx_moe_fuse.rewrites.qkv.projections import (
    Projection,
)

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
                    roles.add(ROLES[index])
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


def assign_roles(projections: list[Projection], order: list[int]) -> dict[str, int]:
    """Decide which projection is Q, K and V; see the module docstring."""
    widths = [p.n for p in projections]
    labels = [item_label(p.node) for p in projections]
    nodes = [p.node for p in projections]
    if len(set(widths)) == 3:
        raise Refusal(
            "the three projections have different widths "
            + ", ".join(f"{lab} N={w}" for lab, w in zip(labels, widths, strict=True))
            + "; K and V must have the same width (Nkv)",
            *nodes,
        )
    perms = [
        dict(zip(ROLES, p, strict=True))
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
            raise Refusal(
                f"the {kind} ({said}) contradicts the widths "
                + ", ".join(f"{lab} N={w}" for lab, w in zip(labels, widths, strict=True))
                + " (K and V share one width)",
                *nodes,
            )
        perms = kept
    if len({perm["q"] for perm in perms}) != 1:
        raise Refusal(
            f"cannot tell which projection is Q: all three have width {widths[0]} and nothing "
            "downstream (attention inputs, RoPE, value names) tells them apart",
            *nodes,
        )
    # K against V: evidence where there is some, else graph order (both have the width Nkv).
    perms.sort(key=lambda perm: order[perm["k"]] > order[perm["v"]])
    return perms[0]
