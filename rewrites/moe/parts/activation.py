"""Activation: what FC2 reads, recognised back to the FC1 output(s) it is made of.

Families (each a few small patterns rooted at the activation's output)::

    fused_gated   SwiGLU of one FC1 ``h`` cut by Slice (halves or strided) or Split
    gated         SwiGLU of two projections, gate ``g`` and up ``u``
    elementwise   Relu(h) | Gelu(h) | FastGelu(h) | com.microsoft Gelu(h) | h * Sigmoid(h) |
                  Swish(h) | the erf spellings of exact GELU (recognised so the proof can
                  refuse them by name)

    SwiGLU        gate * Sigmoid(alpha * gate) * (linear + beta), each operand maybe Clip-ped,
                  alpha and beta optional, every product in either order

The identity (FC2 reads FC1 directly) is no pattern: the layer recogniser takes it when the
activation is itself an FC1 projection. Any other spelling is recognised by behaviour (kind
``behaviour``): given ``is_fc1`` (does a value come out of an FC1 projection?), the element-wise
region between FC1 and FC2 is cut out (:func:`~onnx_moe_fuse.rewrites.moe.behaviour.region.elementwise_region`)
and its family read from its sources: two projections are ``gated``, one cut by a
Slice/Split/Gather ``fused_gated``, one alone ``elementwise``; the proof probes it
(:mod:`onnx_moe_fuse.rewrites.moe.behaviour.activation`). :func:`recognise_activation` returns an
:class:`~.facts.ActivationFact` or raises a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`
of part ``activation``, naming what it found (a Sigmoid that reads the up projection instead of the
gate, for instance). The constants (clamp limits, alpha, beta, the cut columns) are proved by the
layer proof.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.contract.ops import MS_DOMAIN
from onnx_moe_fuse.rewrites.graph.facts import const_array, label, value_label
from onnx_moe_fuse.rewrites.graph.match import PartPattern, first_match, spellings
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.interpret import COLUMN_OPS
from onnx_moe_fuse.rewrites.moe.behaviour.region import elementwise_region
from onnx_moe_fuse.rewrites.moe.parts.facts import ActivationFact, half_precision

__all__ = ["FAMILIES", "MS_DOMAIN", "identity_activation", "recognise_activation"]

#: The activation families, in the order :func:`recognise_activation` tries them.
FAMILIES = ("fused_gated", "gated", "elementwise")


def _var(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


def _swiglu(op, gate_src, linear_src, root: str, shift: bool = True) -> Any:
    """``gate * Sigmoid(alpha * gate) * (linear + beta)``; ``root`` is the last product's order.

    ``shift=False``: ``linear`` as it is, even where it is an ``Add`` (an up projection's
    gathered bias, which the shifted spelling would read as beta).
    """
    gate = pattern.OrValue(
        [op.Clip(gate_src, _var("gate_clip_min", True), _var("gate_clip_max", True)), gate_src],
        name="swiglu_gate",
    )
    linear = pattern.OrValue(
        [
            op.Clip(linear_src, _var("linear_clip_min", True), _var("linear_clip_max", True)),
            linear_src,
        ],
        name="swiglu_linear",
    )
    alpha = _var("swiglu_alpha")
    sig = op.Sigmoid(
        pattern.OrValue(
            [op.Mul(gate, alpha), op.Mul(alpha, gate), gate],
            tag_var="alpha_form",
            tag_values=["scaled", "scaled", "plain"],
        )
    )
    glu = pattern.OrValue([op.Mul(gate, sig), op.Mul(sig, gate)])
    beta = _var("swiglu_beta")
    shifted = pattern.OrValue(
        [op.Add(linear, beta), op.Add(beta, linear), linear] if shift else [linear],
        tag_var="beta_form",
        tag_values=["shifted", "shifted", "plain"] if shift else ["plain"],
    )
    return op.Mul(shifted, glu) if root == "linear_first" else op.Mul(glu, shifted)


def _cut_swiglu(op, root: str, shift: bool = True) -> Any:
    """SwiGLU of one FC1 ``fc1_out`` cut into gate and linear operands (Slice or Split)."""
    h = _var("fc1_out")
    first, second = op.Split(h, _var("split_sizes", True), _outputs=2)

    def operand(name: str, prefix: str) -> Any:
        cut = op.Slice(
            h,
            _var(f"{prefix}_starts"),
            _var(f"{prefix}_ends"),
            _var(f"{prefix}_axes", True),
            _var(f"{prefix}_steps", True),
        )
        return pattern.OrValue([cut, first, second], name=name)

    return _swiglu(
        op,
        operand("swiglu_gate_src", "gate_slice"),
        operand("swiglu_linear_src", "lin_slice"),
        root,
        shift,
    )


def _gated(op, root: str, shift: bool = True) -> Any:
    return _swiglu(op, _var("fc1_gate_out"), _var("fc1_up_out"), root, shift)


def _erf_gelu(op, order: int) -> Any:
    h = _var("fc1_out")
    erf = op.Erf(pattern.OrValue([op.Div(h, _var("erf_div")), op.Mul(h, _var("erf_scale"))]))
    one_plus = pattern.OrValue([op.Add(erf, _var("erf_one")), op.Add(_var("erf_one"), erf)])
    half = _var("erf_half")
    return (
        op.Mul(op.Mul(h, half), one_plus),
        op.Mul(one_plus, op.Mul(h, half)),
        op.Mul(op.Mul(h, one_plus), half),
        op.Mul(h, op.Mul(one_plus, half)),
        op.Mul(h, op.Mul(half, one_plus)),
    )[order]


def _h() -> pattern.Var:
    return _var("fc1_out")


_ELEMENTWISE: tuple[tuple[str, Any], ...] = (
    ("relu", lambda op: op.Relu(_h())),
    ("gelu", lambda op: op.Gelu(_h())),
    ("fast_gelu", lambda op: op.FastGelu(_h(), _domain=MS_DOMAIN)),
    ("ms_gelu", lambda op: op.Gelu(_h(), _domain=MS_DOMAIN)),
    ("silu_mul", lambda op: op.Mul(_h(), op.Sigmoid(_h()))),
    ("silu_mul_r", lambda op: op.Mul(op.Sigmoid(_h()), _h())),
    ("swish", lambda op: op.Swish(_h())),
    *(("erf_gelu", lambda op, i=i: _erf_gelu(op, i)) for i in range(5)),
)

_PATTERNS: dict[str, tuple[tuple[str, PartPattern], ...]] = {
    "fused_gated": tuple(
        ("swiglu", PartPattern(f"activation/cut_swiglu/{r}", lambda op, r=r: _cut_swiglu(op, r)))
        for r in ("linear_first", "glu_first")
    ),
    "gated": tuple(
        ("swiglu", PartPattern(f"activation/swiglu/{r}", lambda op, r=r: _gated(op, r)))
        for r in ("linear_first", "glu_first")
    ),
    "elementwise": tuple(
        (kind, PartPattern(f"activation/{kind}", build)) for kind, build in _ELEMENTWISE
    ),
}

#: The SwiGLU families without the offset: where the shifted spelling's beta is no constant
#: scalar, the ``Add`` it matched is the linear operand itself (an up projection plus its bias).
_UNSHIFTED: dict[str, tuple[tuple[str, PartPattern], ...]] = {
    "fused_gated": tuple(
        (
            "swiglu",
            PartPattern(
                f"activation/cut_swiglu_unshifted/{r}", lambda op, r=r: _cut_swiglu(op, r, False)
            ),
        )
        for r in ("linear_first", "glu_first")
    ),
    "gated": tuple(
        (
            "swiglu",
            PartPattern(f"activation/swiglu_unshifted/{r}", lambda op, r=r: _gated(op, r, False)),
        )
        for r in ("linear_first", "glu_first")
    ),
}


def _variable_offset(bindings: dict) -> bool:
    """A shifted SwiGLU match whose beta is not a constant scalar (a value of the layer)."""
    if bindings.get("beta_form") != "shifted":
        return False
    beta = const_array(bindings.get("swiglu_beta"))
    return beta is None or beta.size != 1


_FC1_OUTPUTS = {
    "fused_gated": ("fc1_out",),
    "gated": ("fc1_gate_out", "fc1_up_out"),
    "elementwise": ("fc1_out",),
}


def recognise_activation(
    act: ir.Value,
    families: tuple[str, ...] = FAMILIES,
    is_fc1: Callable[[ir.Value], bool] | None = None,
) -> ActivationFact:
    """The activation whose output is ``act``: the first of ``families`` whose pattern matches.

    When none does and ``is_fc1`` is given, the element-wise region back to the FC1 outputs
    (:func:`behaviour_activation`); it raises this function's refusal when ``act`` is itself an
    FC1 output (the identity, the caller's case) or the region holds no activation at all.
    """
    node = act.producer()
    for family in families:
        found = first_match(_PATTERNS[family], node)
        if found is not None and family in _UNSHIFTED and _variable_offset(found[1].bindings):
            found = first_match(_UNSHIFTED[family], node) or found  # else beta's refusal
        if found is None:
            continue
        kind, match = found
        b = dict(match.bindings)
        b["act"] = act
        b["activation"] = kind
        return ActivationFact(
            family=family,
            kind=kind,
            output=act,
            fc1_outputs=tuple(b[name] for name in _FC1_OUTPUTS[family]),
            nodes=match.nodes,
            bindings=b,
        )
    if is_fc1 is not None and not _swapped_operands(act, is_fc1):
        fact = behaviour_activation(act, is_fc1, families)
        if fact is not None:
            return fact
    raise _diagnose(act)


def behaviour_activation(
    act: ir.Value, is_fc1: Callable[[ir.Value], bool], families: tuple[str, ...] = FAMILIES
) -> ActivationFact | None:
    """The element-wise region from the FC1 outputs to ``act``: an activation of kind behaviour.

    None when ``act`` is an FC1 output or reads none, or the family is not in ``families``; a
    Refusal of part ``activation`` when the region is not element-wise.

    A ``Mul(x, Sigmoid(y))`` whose ``y`` is not ``x`` (up to a clamp or a scale) is left to the
    pattern diagnosis (:func:`recognise_activation` does not come here): the spelling
    generator's swapped-gate mutant, which stays refused by name (see docs/rules.md).
    """
    try:
        region = elementwise_region(act, is_fc1, "the activation")
    except Refusal as refusal:
        if refusal.part is None:
            refusal.part = "activation"
        raise
    if region is None or not region.sources:
        return None
    if len(region.sources) > 2:
        raise Refusal(
            f"the activation '{value_label(act)}' reads {len(region.sources)} projections; a "
            "fused node takes FC1 (and FC3) only",
            act,
            part="activation",
        )
    if len(region.sources) == 2:
        family = "gated"
    elif any(n.op_type in COLUMN_OPS for n in region.nodes):
        family = "fused_gated"
    else:
        family = "elementwise"
    if family not in families:
        return None
    b = {"act": act, "activation": "behaviour", "act_region": region}
    if family == "gated":
        b["fc1_gate_out"], b["fc1_up_out"] = region.sources
    else:
        b["fc1_out"] = region.sources[0]
    nodes = tuple(n for n in region.nodes if const_array(n.outputs[0]) is None)
    return ActivationFact(
        family=family,
        kind="behaviour",
        output=act,
        fc1_outputs=region.sources,
        nodes=nodes,
        bindings=b,
    )


def identity_activation(fc1_out: ir.Value) -> ActivationFact:
    """FC2 reads FC1 directly (activation ``identity``)."""
    return ActivationFact(
        family="elementwise",
        kind="identity",
        output=fc1_out,
        fc1_outputs=(fc1_out,),
        nodes=(),
        bindings={"act": fc1_out, "activation": "identity", "fc1_out": fc1_out},
    )


# -- why nothing matched -----------------------------------------------------------------------


def _through_scaling(value: ir.Value) -> ir.Value:
    """``value`` with a Clip or a product by a constant peeled off (the gate's decorations)."""
    node = value.producer()
    if node is None:
        return value
    if node.op_type == "Clip" and node.inputs[0] is not None:
        return node.inputs[0]
    if node.op_type == "Mul" and len(node.inputs) == 2:
        a, b = node.inputs
        if b is not None and const_array(b) is not None and a is not None:
            return a
        if a is not None and const_array(a) is not None and b is not None:
            return b
    return value


def _sigmoid_products(node: ir.Node | None, depth: int = 2):
    """``(x, sigmoid)`` for each ``Mul(x, Sigmoid(_))`` at or just below ``node``."""
    if node is None or depth < 0 or node.op_type != "Mul":
        return
    for i, v in enumerate(node.inputs[:2]):
        p = v.producer() if v is not None else None
        other = node.inputs[1 - i]
        if p is not None and p.op_type == "Sigmoid" and other is not None:
            yield other, p
        elif p is not None:
            yield from _sigmoid_products(p, depth - 1)


def _miswired_sigmoid(act: ir.Value) -> Refusal | None:
    """The refusal for a ``Mul(x, Sigmoid(y))`` at or below ``act`` whose ``y`` is not ``x``."""
    node = act.producer()
    for multiplied, sigmoid in _sigmoid_products(node):
        read = sigmoid.inputs[0]
        if read is None:
            continue
        gate, sig_src = _through_scaling(multiplied), _through_scaling(read)
        if sig_src is not gate and read is not multiplied:
            return Refusal(
                f"the Sigmoid '{label(sigmoid)}' reads '{value_label(read)}', not the gate "
                f"'{value_label(multiplied)}' it multiplies: SwiGLU and SiLU take the sigmoid "
                "of the gate itself (gate * sigmoid(alpha * gate)), so gate and up may be swapped",
                sigmoid,
                part="activation",
            )
    return None


def _swapped_operands(act: ir.Value, is_fc1: Callable[[ir.Value], bool]) -> bool:
    """A ``Mul(x, Sigmoid(y))`` below ``act`` whose ``x`` and ``y`` are two FC1 operands.

    (Each an FC1 output or a Slice/Split/Gather of one, up to a clamp or a scale.) That is the
    spelling generator's swapped-gate mutant; its refusal names the Sigmoid.
    """

    def operand(value: ir.Value) -> ir.Value | None:
        value = _through_scaling(value)
        node = value.producer()
        if is_fc1(value):
            return value
        if node is not None and node.op_type in COLUMN_OPS and node.inputs[0] is not None:
            return value if is_fc1(node.inputs[0]) else None
        return None

    for multiplied, sigmoid in _sigmoid_products(act.producer()):
        if sigmoid.inputs[0] is None:
            continue
        x, y = operand(multiplied), operand(sigmoid.inputs[0])
        if x is not None and y is not None and x is not y:
            return True
    return False


def _diagnose(act: ir.Value):
    """The failure for an activation no pattern matches: the mis-wired Sigmoid if there is one."""
    half = half_precision("the activation", act)
    if half is not None:
        return half
    node = act.producer()
    miswired = _miswired_sigmoid(act)
    if miswired is not None:
        return miswired
    what = "a graph input" if node is None else f"{node.op_type} '{label(node)}'"
    return Refusal(
        f"the activation '{value_label(act)}' ({what}) that FC2 reads is not one the fused ops "
        "take (relu, tanh gelu, silu, SwiGLU, or FC1's output itself)",
        node if node is not None else act,
        part="activation",
        expected=" | ".join(spellings(_PATTERNS[f]) for f in FAMILIES),
    )
