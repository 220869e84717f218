"""The spelling axes of an MoE layer, what each combination must fuse to, and hypothesis strategies.

A :class:`LayerCase` picks one spelling per part (router, routing, experts, activation, combine,
weights, tokens) plus sizes and a seed, and optionally one :data:`MUTATIONS` entry that breaks
the layer's equivalence to a fused node in exactly one place. :func:`expected` says what the
fuser must do with it: emit the op with the listed attributes, or refuse and name the part.

The fuser is being generalised, so not every spelling fuses yet. :data:`SUPPORTED` lists, per
axis, the spellings that fuse on the current tree, and :data:`UNSUPPORTED_COMBINATIONS` the
cross-axis combinations that do not (each with the fuser's reason); the CI properties draw from
those only (:func:`supported_cases`, :func:`supported_mutants`), the long run draws from
everything (:func:`all_cases`, :func:`all_mutants`). Grow ``SUPPORTED`` as support lands; never
weaken the properties instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

ROUTERS = ("matmul", "matmul_bias", "gemm_transb", "einsum")
ROUTINGS = ("softmax_topk_div", "softmax_topk_reciprocal", "topk_softmax", "softmax_topk_raw")
EXPERTS = (
    "gather_expand",  # Gather(W, idx), Unsqueeze + Expand the tokens, MatMul, Squeeze
    "gather_reshape",  # the same, the unit axis dropped by Reshape
    "transpose_weights",  # output-major [E, N, K] weights, Transpose in the graph
    "einsum",  # Einsum of the tokens with the gathered weights
    "rows_gathernd",  # torch batched_mm export: T*k rows, GatherND by flat ids, batched MatMul
    "dense_onehot",  # every expert on every token, combine masked by OneHot
    "dense_equal",  # every expert on every token, combine masked by Equal/Cast
)
ACTIVATIONS = (
    "swiglu_separate",  # gate and up from separate experts
    "swiglu_split",  # one FC1, Split into halves
    "swiglu_slice",  # one FC1, Slice halves
    "swiglu_strided",  # one FC1, step-2 Slices (interleaved)
    "swish",  # the Swish op (opset 24)
    "silu_x_sigmoid",  # Mul(x, Sigmoid(x))
    "silu_sigmoid_x",  # Mul(Sigmoid(x), x)
    "relu",
    "gelu_tanh",  # Gelu(approximate="tanh")
    "swiglu_oss",  # gpt-oss: strided, clamp 7, alpha 1.702, +1 on the linear side
)
COMBINES = (
    "mul_reducesum",
    "matmul_row",
    "einsum",
    # [B, S] tokens flattened for the experts, the mix split back: over [E, B, S, H] (dense,
    # optimum's dense gpt-oss) or [B, S, k, H] (per slot)
    "split_rows",
)
#: Combines that only some layouts write: combine -> (the experts, the ranks) it needs.
COMBINE_NEEDS = {
    "split_rows": (
        frozenset({"dense_onehot", "dense_equal", "gather_expand", "gather_reshape",
                   "transpose_weights", "einsum"}),
        frozenset({3}),
    )
}  # fmt: skip
WEIGHT_DTYPES = ("float32", "int4", "uint4", "int8", "uint8")
GRANULARITIES = ("channel", "block32")  # scales per output channel, or per block of 32 along K
ZERO_POINTS = ("absent", "explicit")  # explicit: 0 signed, 8 uint4, 128 uint8 (the symmetric point)
RANKS = (2, 3)
OPSETS = (21, 22, 23)
SHAPES = ("static", "symbolic")

MUTATIONS = (
    "softmax_axis",  # the router Softmax normalises over another axis than the experts
    "topk_axis",  # TopK selects along another axis than the experts
    "swap_gate_up",  # the SiLU's sigmoid reads the up projection instead of the gate
    "fc2_other_indices",  # FC2 gathers experts by other indices than FC1
    "erf_gelu",  # exact (erf) GELU where MoE's gelu is the tanh approximation
    "dropped_clamp",  # gpt-oss SwiGLU with the gate clamp removed (the linear clamp kept)
    "router_second_input",  # the router reads a second graph input, not the tokens
    "router_token_slice",  # the router reads the tokens reversed along the token axis
    "zero_point_off",  # the zero point is one off the symmetric point
    "weight_graph_input",  # FC1's weights (or codes) are a graph input, not a constant
)

# The part each mutation breaks; the fuser's near miss must name it (test_properties.PART_WORDS).
MUTATION_PART = {
    "softmax_axis": "routing",
    "topk_axis": "routing",
    "swap_gate_up": "activation",
    "fc2_other_indices": "experts",
    "erf_gelu": "activation",
    "dropped_clamp": "activation",
    "router_second_input": "router",
    "router_token_slice": "router",
    "zero_point_off": "weights",
    "weight_graph_input": "weights",
}

SWIGLU = frozenset(a for a in ACTIVATIONS if a.startswith("swiglu"))
GATHERED = frozenset(e for e in EXPERTS if not e.startswith("dense"))

# Spellings that fuse on the current tree (measured with scripts/spelling_long_run.py; the
# report of that run gives the reasons the others are refused).
SUPPORTED: dict[str, frozenset] = {
    "router": frozenset(ROUTERS),
    "routing": frozenset(ROUTINGS),
    "experts": frozenset(EXPERTS),
    "activation": frozenset(ACTIVATIONS),
    "combine": frozenset(COMBINES),
    "weight_dtype": frozenset(WEIGHT_DTYPES),
    "granularity": frozenset(GRANULARITIES),
    "zero_point": frozenset(ZERO_POINTS),
    "rank": frozenset(RANKS),
    "shapes": frozenset(SHAPES),
    "mutation": frozenset(MUTATIONS),
}


def multi_block_8bit(case: LayerCase) -> bool:
    """8-bit weights in several blocks of 32 along K (refused: ORT computes them inexactly)."""
    return case.bits == 8 and case.granularity == "block32" and max(case.hidden, case.inter) > 32


# Cross-axis combinations that do not fuse (or not right) today although each spelling does
# elsewhere: (name, predicate on the case, what the fuser does). The CI strategies skip them.
UNSUPPORTED_COMBINATIONS: tuple[tuple[str, Callable[[LayerCase], bool], str], ...] = (
    (
        "8-bit x several blocks of 32",
        multi_block_8bit,
        "refused on purpose (target): ORT CPU's block-wise 8-bit QMoE quantises the activations "
        "(1e-2 off); test_properties checks the refusal",
    ),
)


@dataclass(frozen=True)
class LayerCase:
    """One generated MoE layer: a spelling per part, sizes, a seed and an optional mutation."""

    router: str
    routing: str
    experts: str
    activation: str
    combine: str
    weight_dtype: str
    granularity: str
    zero_point: str
    rank: int
    shapes: str
    hidden: int
    inter: int
    experts_count: int
    top_k: int
    token_dims: tuple[int, ...]  # the static sizes before H ([T] or [B, S]); feeds use them
    seed: int
    mutation: str | None = None
    opset_version: int = 21  # 21..23 (blocked DequantizeLinear needs 21)

    @property
    def quantized(self) -> bool:
        """True when the expert weights are behind DequantizeLinear."""
        return self.weight_dtype != "float32"

    @property
    def bits(self) -> int:
        """The bit width of the quantized codes (32 for float)."""
        return {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8}.get(self.weight_dtype, 32)

    @property
    def fused_fc1(self) -> bool:
        """True when gate and linear come from one FC1 projection of width 2 I."""
        return self.activation in SWIGLU and self.activation != "swiglu_separate"

    @property
    def opset(self) -> int:
        """The default-domain opset: ``opset_version``, or 24 where the Swish op needs it."""
        return 24 if self.activation == "swish" else self.opset_version

    def label(self) -> str:
        """A short readable name of the case."""
        w = (
            "f32"
            if not self.quantized
            else f"{self.weight_dtype}-{self.granularity}-zp{self.zero_point}"
        )
        base = (
            f"{self.router}/{self.routing}/{self.experts}/{self.activation}/{self.combine}/{w}/"
            f"r{self.rank}-{self.shapes} H{self.hidden} I{self.inter} E{self.experts_count} "
            f"k{self.top_k} opset{self.opset} seed{self.seed}"
        )
        return base if self.mutation is None else f"{base} !{self.mutation}"

    def axis_values(self) -> dict[str, object]:
        """The spelling chosen on every axis (the keys of :data:`SUPPORTED`)."""
        return {
            "router": self.router,
            "routing": self.routing,
            "experts": self.experts,
            "activation": self.activation,
            "combine": self.combine,
            "weight_dtype": self.weight_dtype,
            "granularity": self.granularity if self.quantized else None,
            "zero_point": self.zero_point if self.quantized else None,
            "rank": self.rank,
            "shapes": self.shapes,
            "mutation": self.mutation,
        }


@dataclass(frozen=True)
class Expected:
    """What the fuser must do with a case.

    Fuse into ``op`` with ``attributes`` (a value, or a set of allowed values, per attribute),
    or refuse (``op`` None) with a near miss naming ``part``.
    """

    op: str | None
    attributes: Mapping[str, object]
    part: str | None = None


#: A small float layer of the commonest spellings, for tests that change one axis at a time.
SMALL_BASE = LayerCase(
    router="matmul",
    routing="softmax_topk_div",
    experts="gather_expand",
    activation="swiglu_separate",
    combine="mul_reducesum",
    weight_dtype="float32",
    granularity="channel",
    zero_point="absent",
    rank=2,
    shapes="symbolic",
    hidden=16,
    inter=8,
    experts_count=4,
    top_k=2,
    token_dims=(5,),
    seed=3,
)


def expected(case: LayerCase) -> Expected:
    """The outcome ``case`` must have (from the meaning of ORT's MoE/QMoE, not the fuser)."""
    if case.mutation is not None:
        return Expected(None, {}, MUTATION_PART[case.mutation])
    act = case.activation
    swiglu = act in SWIGLU
    oss = act == "swiglu_oss"
    attrs: dict[str, object] = {
        "k": case.top_k,
        "activation_type": "swiglu"
        if swiglu
        else {"relu": "relu", "gelu_tanh": "gelu"}.get(act, "silu"),
        "normalize_routing_weights": 0 if case.routing == "softmax_topk_raw" else 1,
        "use_sparse_mixer": 0,
        "swiglu_fusion": 1 if swiglu else 0,
        "activation_alpha": 1.702 if oss else 1.0,
        "activation_beta": 1.0 if oss else 0.0,
        "swiglu_limit": 7.0 if oss else math.inf,
    }
    if not case.quantized:
        return Expected("MoE", attrs)
    attrs["expert_weight_bits"] = case.bits
    if case.granularity == "block32" and max(case.hidden, case.inter) > 32:
        attrs["block_size"] = 32
    elif case.granularity == "block32":  # one block of 32 over each K: per channel too
        attrs["block_size"] = {0, 32}
    else:
        # one block over K per projection: per channel (0), or K itself when FC1 and FC2 share it
        attrs["block_size"] = {0, case.hidden} if case.hidden == case.inter else {0}
    return Expected("QMoE", attrs)


# -- strategies ----------------------------------------------------------------------------

# Mutations that only make sense on some spellings: axis -> the spellings they need.
MUTATION_NEEDS: dict[str, dict[str, frozenset]] = {
    "swap_gate_up": {"activation": SWIGLU},
    "fc2_other_indices": {"experts": GATHERED},
    "erf_gelu": {"activation": frozenset({"gelu_tanh"}), "weight_dtype": frozenset({"float32"})},
    "dropped_clamp": {"activation": frozenset({"swiglu_oss"})},
    "no_renorm_quantized": {
        "routing": frozenset({"softmax_topk_raw"}),
        "weight_dtype": frozenset(WEIGHT_DTYPES) - {"float32"},
    },
    "zero_point_off": {"weight_dtype": frozenset(WEIGHT_DTYPES) - {"float32"}},
}


def _choices(axis: str, allowed: Mapping[str, frozenset] | None, all_values: tuple) -> list:
    values = [v for v in all_values if allowed is None or v in allowed[axis]]
    return values


@st.composite
def layer_cases(
    draw: st.DrawFn,
    allowed: Mapping[str, frozenset] | None = None,
    mutation: str | None = None,
) -> LayerCase:
    """Draw an equivalent layer (``mutation`` None) or one broken by ``mutation``.

    ``allowed`` restricts every axis to a subset (``SUPPORTED``); None allows everything.
    """
    needs = MUTATION_NEEDS.get(mutation or "", {})

    def pick(axis: str, values: tuple) -> object:
        options = _choices(axis, allowed, values)
        if axis in needs:
            options = [v for v in options if v in needs[axis]]
        return draw(st.sampled_from(options))

    # float or quantized first, evenly: float layers are the only ones with every activation
    dtypes = _choices("weight_dtype", allowed, WEIGHT_DTYPES)
    dtypes = [d for d in dtypes if d in needs.get("weight_dtype", dtypes)]
    kinds = sorted({d == "float32" for d in dtypes})
    float_weights = draw(st.sampled_from(kinds))
    weight_dtype = draw(st.sampled_from([d for d in dtypes if (d == "float32") == float_weights]))
    routing_values = ROUTINGS
    if weight_dtype != "float32" and mutation != "no_renorm_quantized":
        routing_values = tuple(r for r in ROUTINGS if r != "softmax_topk_raw")
    granularity = pick("granularity", GRANULARITIES)
    blocked = weight_dtype != "float32" and granularity == "block32"
    sizes = (32, 64) if blocked else (16, 32, 48)
    experts_count = draw(st.integers(2, 8))
    rank = pick("rank", RANKS)
    # reversed tokens, or a softmax over tokens, differ from the layer only with two or more
    least = 2 if mutation in ("router_token_slice", "softmax_axis") else 1
    token_dims = (
        (draw(st.integers(least, 6)),)
        if rank == 2
        else (draw(st.integers(least, 3)), draw(st.integers(least, 4)))
    )
    # with k = E the raw top-k softmax weights sum to 1 already: not renormalising breaks nothing
    most_k = experts_count - 1 if mutation == "no_renorm_quantized" else experts_count
    zero_point = pick("zero_point", ZERO_POINTS)
    if weight_dtype in ("uint4", "uint8") or mutation == "zero_point_off":
        zero_point = "explicit"  # unsigned codes without a zero point mean zp 0: not symmetric
    experts = pick("experts", EXPERTS)
    combines = tuple(
        name
        for name in COMBINES
        if name not in COMBINE_NEEDS
        or (experts in COMBINE_NEEDS[name][0] and rank in COMBINE_NEEDS[name][1])
    )
    return LayerCase(
        router=pick("router", ROUTERS),
        routing=pick("routing", routing_values),
        experts=experts,
        activation=pick("activation", ACTIVATIONS),
        combine=pick("combine", combines),
        weight_dtype=weight_dtype,
        granularity=granularity,
        zero_point=zero_point,
        rank=rank,
        shapes=pick("shapes", SHAPES),
        hidden=draw(st.sampled_from(sizes)),
        inter=draw(st.sampled_from(sizes)),
        experts_count=experts_count,
        top_k=draw(st.integers(1, most_k)),
        token_dims=token_dims,
        seed=draw(st.integers(0, 2**31 - 1)),
        mutation=mutation,
        opset_version=draw(st.sampled_from(OPSETS)),
    )


def unmutated(case: LayerCase) -> LayerCase:
    """The equivalent layer a mutant breaks (no_renorm_quantized: its renormalised twin)."""
    if case.mutation == "no_renorm_quantized":
        return replace(case, mutation=None, routing="softmax_topk_div")
    return replace(case, mutation=None)


def is_valid(case: LayerCase) -> bool:
    """Whether an unmutated case is a layer that one MoE/QMoE node computes.

    What :func:`layer_cases` guarantees, for cases edited by hand (the long run's sweep):
    QMoE needs renormalised routing, unsigned codes need their zero point, blocks of 32 need
    H and I multiples of 32, and ``1 <= k <= E``.
    """
    if case.quantized and case.routing == "softmax_topk_raw":
        return False
    if case.weight_dtype in ("uint4", "uint8") and case.zero_point != "explicit":
        return False
    if case.quantized and case.granularity == "block32":
        if case.hidden % 32 or case.inter % 32:
            return False
    if case.combine in COMBINE_NEEDS:
        experts, ranks = COMBINE_NEEDS[case.combine]
        if case.experts not in experts or case.rank not in ranks:
            return False
    return 1 <= case.top_k <= case.experts_count


def is_supported(case: LayerCase) -> bool:
    """Whether every spelling of ``case`` is in SUPPORTED and no listed combination excludes it."""
    for axis, value in case.axis_values().items():
        if value is not None and value not in SUPPORTED[axis]:
            return False
    return not any(pred(case) for _, pred, _ in UNSUPPORTED_COMBINATIONS)


def supported_cases() -> st.SearchStrategy[LayerCase]:
    """Equivalent layers built from supported spellings only (the CI property 1)."""
    return layer_cases(SUPPORTED).filter(is_supported)


def all_cases() -> st.SearchStrategy[LayerCase]:
    """Equivalent layers built from every spelling (the long run)."""
    return layer_cases(None)


def _mutants(allowed: Mapping[str, frozenset] | None, mutations: tuple) -> st.SearchStrategy:
    return st.sampled_from(mutations).flatmap(lambda m: layer_cases(allowed, m))


def supported_mutants(mutation: str | None = None) -> st.SearchStrategy[LayerCase]:
    """Broken layers: a supported mutation (or ``mutation``) on a supported base (property 2)."""
    mutations = tuple(m for m in MUTATIONS if m in SUPPORTED["mutation"])
    if mutation is not None:
        mutations = (mutation,)
    return _mutants(SUPPORTED, mutations).filter(is_supported)


def all_mutants() -> st.SearchStrategy[LayerCase]:
    """Broken layers: every mutation on every base (the long run)."""
    return _mutants(None, MUTATIONS)


# -- hypothesis profiles -------------------------------------------------------------------

# CI: a fixed sequence of examples (derandomize), no example database, no deadline (the
# first example of a run pays ORT's start-up); the counts per property live in the tests.
settings.register_profile(
    "spellings-ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# The long run: fresh random examples, many of them; the script sets max_examples.
settings.register_profile(
    "spellings-long",
    derandomize=False,
    database=None,
    deadline=None,
    max_examples=2000,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
