"""The catalogue of sample MoE layers: one :class:`LayerSpec` and one expected outcome per name.

Names read ``<family>_<spelling>_<weights>[_rank3]``:

* family: ``mixtral``, ``qwen3``, ``qwen2``, ``gptoss``, ``gelu``, or ``nearmiss_<what>``;
* spelling: ``gmm`` (``GroupedMatMul``, opset 29) or ``dec`` (Gather/Expand/MatMul, opset 21);
* weights: ``f32`` (float initializers), ``int4b32`` / ``int4b128`` (int4 blocked along K),
  ``u8pc`` (uint8 per output channel, zero point 128), ``u8asym`` (uint8, asymmetric zero points).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from onnx_moe_fuse.samples.layers import Activation, LayerSpec, Routing, Spelling, Weights

__all__ = ["Entry", "CATALOG", "DEFAULT_SAMPLE"]

AttrValue = int | float | str

DEFAULT_SAMPLE = "mixtral_dec_int4b32"


@dataclass(frozen=True)
class Entry:
    """One catalogue entry: the layer to build and what a fuser must make of it."""

    spec: LayerSpec
    family: str
    description: str
    expected: list[tuple[str, int]]
    near_miss_reason: str | None = None
    expected_attributes: dict[str, AttrValue] = field(default_factory=dict)
    kept_ops: list[tuple[str, int]] = field(default_factory=list)
    twin: str | None = None


@dataclass(frozen=True)
class _Family:
    key: str
    title: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: Routing
    activation: Activation
    router_bias: bool = False
    expert_bias: bool = False
    shared_inter: int = 0
    squeeze_by_reshape: bool = False
    fc1_scale: float = 1.0


_MIXTRAL = _Family("mixtral", "Mixtral-like", 64, 32, 8, 2, "softmax_topk_renorm", "swiglu")
_QWEN3 = _Family("qwen3", "Qwen3-MoE-like", 64, 32, 16, 8, "softmax_topk_renorm", "swiglu")
_QWEN2 = _Family("qwen2", "Qwen2-MoE-like", 64, 32, 8, 4, "softmax_topk", "swiglu", shared_inter=64)
_GPTOSS = _Family(
    "gptoss",
    "gpt-oss-like",
    64,
    32,
    8,
    4,
    "topk_softmax",
    "swiglu_oss",
    router_bias=True,
    expert_bias=True,
    squeeze_by_reshape=True,
    fc1_scale=5.0,  # FC1 outputs beyond +-7 on a good share of elements: the clamps matter
)
_GELU = _Family("gelu", "GELU-MLP", 32, 64, 4, 2, "softmax_topk_renorm", "gelu_tanh")
# a sigmoid router (GLM-4.5 / DeepSeek-V3 style scores): fed to the fused node as its selection
# and final weights (the routing construction), the router staying in the graph
_SIGMOID = _Family(
    "sigmoid", "Mixtral-like, sigmoid router", 64, 32, 8, 2, "sigmoid_topk_renorm", "swiglu"
)

_ROUTING_TEXT: dict[str, str] = {
    "softmax_topk_renorm": "Softmax over the experts, TopK, renormalised (ReduceSum + Div)",
    "softmax_topk": "Softmax over the experts, TopK, NOT renormalised (the k probabilities as "
    "they are)",
    "topk_softmax": "TopK on the logits, then Softmax over the k values",
    "sigmoid_topk_renorm": "Sigmoid scores (not Softmax), TopK, renormalised (ReduceSum + Div)",
}
_ACTIVATION_TEXT: dict[str, str] = {
    "swiglu": "SwiGLU from separate gate/up experts (gate * Sigmoid(gate) * up)",
    "swiglu_oss": "interleaved SwiGLU (gate = even FC1 columns, up = odd, strided Slice), gate "
    "clamped at max 7 (Clip), up clamped to [-7, 7], gate * Sigmoid(1.702 * gate) * (up + 1)",
    "gelu_tanh": "Gelu(approximate='tanh') between FC1 and FC2",
    "gelu_erf": "exact GELU spelled x * 0.5 * (1 + Erf(x / sqrt(2))) between FC1 and FC2",
}
_WEIGHTS_TEXT: dict[str, str] = {
    "f32": "float32 expert weights (initializers)",
    "int4b32": "int4 expert weights behind DequantizeLinear, blocked 32 along K (axis=1), "
    "no zero point (symmetric)",
    "int4b128": "int4 expert weights behind DequantizeLinear, blocked 128 along K (axis=1), "
    "no zero point (symmetric)",
    "u8pc": "uint8 expert weights behind DequantizeLinear, one scale per expert and output "
    "channel (block_size = K along axis=1), zero point 128 (symmetric)",
    "u8asym": "uint8 expert weights behind DequantizeLinear, per output channel, min/max "
    "(asymmetric) zero points that are not 128",
}
_SPELLING_TEXT: dict[str, str] = {
    "gmm": "GroupedMatMul (ONNX opset 29); FC2 inputs flattened to [M*k, I] with indices "
    "[M*k, 1], its output reshaped to [M, k, H]",
    "dec": "the Gather/Expand/MatMul decomposition (opset 21): Gather of the selected "
    "weights [M,k,K,N]; FC1 tokens Unsqueeze + Expand to [M,k,1,H], FC2 inputs Unsqueeze to "
    "[M,k,1,I]; MatMul; the unit axis dropped by ",
}


def _spec(
    fam: _Family,
    spelling: Spelling,
    weights: Weights,
    *,
    name: str,
    seed_key: str,
    rank: int = 2,
    **over: object,
) -> LayerSpec:
    big = weights == "int4b128"
    spec = LayerSpec(
        name=name,
        hidden=128 if big else fam.hidden,
        inter=128 if big else fam.inter,
        experts=fam.experts,
        top_k=fam.top_k,
        routing=fam.routing,
        activation=fam.activation,
        spelling=spelling,
        weights=weights,
        seed_key=seed_key,
        router_bias=fam.router_bias,
        expert_bias=fam.expert_bias,
        shared_inter=fam.shared_inter,
        rank=rank,
        squeeze_by_reshape=fam.squeeze_by_reshape and spelling == "dec",
        fc1_scale=fam.fc1_scale,
    )
    return replace(spec, **over) if over else spec  # type: ignore[arg-type]


_BIAS_TEXT: dict[str, str] = {
    "gmm": "; per-expert FC1/FC2 biases as GroupedMatMul's bias input",
    "dec": "; per-expert FC1/FC2 biases by Gather + Add",
}


def _unit_axis(spec: LayerSpec) -> str:
    return "Reshape(shape=[0, 0, N])" if spec.squeeze_by_reshape else "Squeeze(axes=[2])"


def _describe(title: str, spec: LayerSpec, extra: str = "") -> str:
    tokens = "[T, H]" if spec.rank == 2 else "[B, S, H] (reshaped to [B*S, H] and back)"
    parts = [
        f"{title} MoE layer, H={spec.hidden}, I={spec.inter}, E={spec.experts}, k={spec.top_k}, "
        f"tokens {tokens}.",
        "Router: MatMul" + (" + Add (router bias)" if spec.router_bias else "") + "; routing: "
        f"{_ROUTING_TEXT[spec.routing]}.",
        f"Experts: {_SPELLING_TEXT[spec.spelling]}"
        + (_unit_axis(spec) if spec.spelling == "dec" else "")
        + (_BIAS_TEXT[spec.spelling] if spec.expert_bias else "")
        + f"; {_WEIGHTS_TEXT[spec.weights]}"
        + ("; expert weights are graph INPUTS, not initializers" if spec.weights_as_inputs else "")
        + ".",
        f"Activation: {_ACTIVATION_TEXT[spec.activation]}.",
        "Combine: Mul by Unsqueeze(weights, -1), ReduceSum over the k axis.",
    ]
    if spec.shared_inter:
        parts.append(
            f"Plus a shared expert (plain SwiGLU MLP, I={spec.shared_inter}, times "
            "Sigmoid(MatMul(x, w[H,1]))) added to the MoE output; it must stay unfused."
        )
    if extra:
        parts.append(extra)
    return " ".join(parts)


def _constructed(spec: LayerSpec) -> bool:
    """The fused op cannot compute the router itself: it is fed the selection and weights."""
    quantized = spec.weights != "f32"
    return spec.routing == "sigmoid_topk_renorm" or (quantized and spec.routing == "softmax_topk")


def _expected_attributes(spec: LayerSpec) -> dict[str, AttrValue]:
    quantized = spec.weights != "f32"
    attrs: dict[str, AttrValue] = {"k": spec.top_k}
    if _constructed(spec):
        # the routing construction: router_weights as they are for QMoE on ORT CPU, log-weights
        # renormalised by the node (and rescaled after it) otherwise
        attrs["normalize_routing_weights"] = 0 if quantized else 1
    else:
        attrs["normalize_routing_weights"] = 0 if spec.routing == "softmax_topk" else 1
    if spec.activation == "swiglu":
        attrs.update(activation_type="swiglu", swiglu_fusion=1)
        attrs.update(activation_alpha=1.0, activation_beta=0.0)
    elif spec.activation == "swiglu_oss":
        attrs.update(activation_type="swiglu", swiglu_fusion=1)
        attrs.update(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    elif spec.activation == "gelu_tanh":
        attrs.update(activation_type="gelu")
    if spec.weights in ("int4b32", "int4b128"):
        attrs.update(expert_weight_bits=4, block_size=32 if spec.weights == "int4b32" else 128)
    elif spec.weights in ("u8pc", "u8asym"):
        attrs.update(expert_weight_bits=8, block_size=0)
    return attrs


def _positive(fam: _Family, spelling: Spelling, weights: Weights, rank: int = 2) -> Entry:
    suffix = "_rank3" if rank == 3 else ""
    name = f"{fam.key}_{spelling}_{weights}{suffix}"
    spec = _spec(fam, spelling, weights, name=name, seed_key=f"{fam.key}/{weights}", rank=rank)
    op = "MoE" if weights == "f32" else "QMoE"
    kept = [("MatMul", 1 + (4 if fam.shared_inter else 0))]
    if fam.shared_inter:
        kept.append(("Sigmoid", 2))
    if fam.routing == "sigmoid_topk_renorm":
        kept.append(("Sigmoid", 1))  # the router stays as the model wrote it
    return Entry(
        spec=spec,
        family=fam.key,
        description=_describe(fam.title, spec, f"Must fuse into one {op}."),
        expected=[(op, 1)],
        expected_attributes=_expected_attributes(spec),
        kept_ops=kept,
        twin=f"{fam.key}_dec_{weights}{suffix}" if spelling == "gmm" else None,
    )


def _near_miss(
    what: str,
    fam: _Family,
    spelling: Spelling,
    weights: Weights,
    reason: str,
    why: str,
    **over: object,
) -> Entry:
    name = f"nearmiss_{what}_{spelling}_{weights}"
    spec = _spec(fam, spelling, weights, name=name, seed_key=f"nearmiss_{what}/{weights}", **over)
    return Entry(
        spec=spec,
        family=f"nearmiss_{what}",
        description=_describe(f"Near miss ({fam.title} base)", spec, f"Must NOT fuse: {why}"),
        expected=[],
        near_miss_reason=reason,
        twin=f"nearmiss_{what}_dec_{weights}" if spelling == "gmm" else None,
    )


# (what, base family, weights, reason keyword, why, LayerSpec overrides)
_NEAR_MISSES: list[tuple[str, _Family, Weights, str, str, dict[str, object]]] = [
    (
        "weights_not_const",
        _MIXTRAL,
        "f32",
        "weights not constant",
        "the expert weights are graph inputs, so they cannot be repacked into the fused node's "
        "layout at fusion time.",
        {"weights_as_inputs": True},
    ),
    (
        "erf_gelu",
        _GELU,
        "f32",
        "exact gelu",
        "the experts use exact (Erf) GELU; MoE's gelu is the tanh approximation (1e-4 to 3e-4 "
        "relative apart on this layer), so fusing would change the numbers.",
        {"activation": "gelu_erf"},
    ),
]


def _catalog() -> dict[str, Entry]:
    entries: list[Entry] = []
    spellings: tuple[Spelling, ...] = ("gmm", "dec")
    all_weights: tuple[Weights, ...] = ("f32", "int4b32", "int4b128", "u8pc")
    for fam in (_MIXTRAL, _QWEN3, _GPTOSS):
        for weights in all_weights:
            for spelling in spellings:
                entries.append(_positive(fam, spelling, weights))
    entries += [_positive(_MIXTRAL, s, "int4b32", rank=3) for s in spellings]
    entries += [_positive(_QWEN2, s, "f32") for s in spellings]
    entries += [_positive(_QWEN2, s, "int4b32") for s in spellings]
    entries += [_positive(_SIGMOID, s, w) for s in spellings for w in ("f32", "int4b32")]
    entries += [_positive(_QWEN2, s, "f32", rank=3) for s in spellings]
    entries += [_positive(_GELU, s, "f32") for s in spellings]
    # asymmetric zero points: explicit zero-point inputs of QMoE (ort-cpu takes them)
    entries += [_positive(_MIXTRAL, s, "u8asym") for s in spellings]
    for what, fam, weights, reason, why, over in _NEAR_MISSES:
        entries += [_near_miss(what, fam, sp, weights, reason, why, **over) for sp in spellings]
    catalog = {e.spec.name: e for e in entries}
    if len(catalog) != len(entries):  # pragma: no cover - guards edits to this file
        raise AssertionError("duplicate sample names")
    return catalog


CATALOG: dict[str, Entry] = _catalog()

#: Positive samples whose router the fused op does not compute itself: the fused node is fed
#: the selection and its weights (the routing construction), so no fused node of the sample's
#: router logits alone computes the layer.
CONSTRUCTED_ROUTING: frozenset[str] = frozenset(
    name for name, e in CATALOG.items() if e.expected and _constructed(e.spec)
)
