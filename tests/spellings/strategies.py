"""What each combination of spellings must fuse to today, and hypothesis strategies of them.

A :class:`~.case.LayerCase` picks one spelling per part (the axes of :mod:`.axes`) plus sizes
and a seed, and optionally one :data:`~.axes.MUTATIONS` entry that breaks the layer's
equivalence to a fused node in exactly one place; :func:`~.case.expected` says what the fuser
must do with it. This module re-exports both modules' names.

The fuser is being generalised, so not every spelling fuses yet. :data:`SUPPORTED` lists, per
axis, the spellings that fuse on the current tree (or that the work in progress makes fuse:
the constructed routings), and :data:`UNSUPPORTED_COMBINATIONS` the cross-axis combinations
that do not (each with the fuser's reason); the CI properties draw from those only
(:func:`supported_cases`, :func:`supported_mutants`), the long run draws from everything
(:func:`all_cases`, :func:`all_mutants`). Grow ``SUPPORTED`` as support lands; never weaken
the properties instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from .axes import *  # noqa: F403 (re-exported: the axes, the mutations and their needs)
from .axes import (
    ACTIVATIONS,
    BIAS_EXPERTS,
    BIASES,
    COMBINE_NEEDS,
    COMBINES,
    CONSTRUCTED_ROUTINGS,
    EXPERTS,
    GRANULARITIES,
    MUTATION_NEEDS,
    MUTATIONS,
    NEEDS_TWO_TOKENS,
    OPSETS,
    RANKS,
    ROUTERS,
    ROUTINGS,
    SCATTERS,
    SHAPES,
    SOFTMAX_ROUTINGS,
    WEIGHT_DTYPES,
    ZERO_POINTS,
    needs_two_slots,
)
from .case import *  # noqa: F403 (re-exported: LayerCase, Expected, expected, SMALL_BASE)
from .case import LayerCase, group_options

#: The spellings issue 18 names that today's fuser does not fuse (or, for mutations, does
#: not refuse naming the part): measured with scripts/spelling_long_run.py, whose report gives
#: the near misses. Remove a spelling here as the analysis of meaning lands.
#: The spellings issue 18 added (row layouts, hand-written activations, scatter combines, k = 1
#: squeezed, bias ranks) and its mutations.
MEANING_AXES: dict[str, frozenset] = {
    "experts": frozenset({"rows_tile", "rows_range", "rows_concat", "top1_squeezed"}),
    "activation": frozenset({"silu_exp", "swiglu_exp", "gelu_tanh_hand"}),
    "combine": frozenset({"scatter_elements", "scatter_nd"}),
    "bias": frozenset({"en_unsqueeze", "e1n"}),
    # silu_off breaks a hand-written SiLU, scatter_other_token a scatter combine (at k >= 2)
    "mutation": frozenset({"silu_off", "scatter_other_token"}),
}

#: Those of them the CI properties leave out, measured by the long run
#: (``scripts/spelling_long_run.py --examples 300 --mutants 150 --seed 18``, 2026-12-02, on
#: branch mutants): gelu_tanh_hand (6 of 6 fused, 8 of 8 in the sweep) and the ScatterElements
#: combine (12 of 13, 8 of 8; the one refused has one static token: see
#: ``UNSUPPORTED_COMBINATIONS``) take part now, and the two mutations (150 mutants: silu_off 11
#: of 11 refused and named); the bias ranks fused at rank 2 and on flattened rows (e1n 9 of 9,
#: en_unsqueeze 12 of 12, 8 of 8 each in the sweep) and are left out only beside [B, S] tokens
#: routed unflattened (``UNSUPPORTED_COMBINATIONS``). Nothing is left out whole.
NOT_YET: dict[str, frozenset] = {}

# Spellings that fuse on the current tree (measured with scripts/spelling_long_run.py; the
# report of that run gives the reasons the others are refused).
SUPPORTED: dict[str, frozenset] = {
    axis: frozenset(values) - NOT_YET.get(axis, frozenset())
    for axis, values in {
        "router": ROUTERS,
        "routing": ROUTINGS,
        "experts": EXPERTS,
        "activation": ACTIVATIONS,
        "combine": COMBINES,
        "weight_dtype": WEIGHT_DTYPES,
        "granularity": GRANULARITIES,
        "zero_point": ZERO_POINTS,
        "rank": RANKS,
        "shapes": SHAPES,
        "bias": BIASES,
        "mutation": MUTATIONS,
    }.items()
}


def separate_up_bias(case: LayerCase) -> bool:
    """A bias added after the reshape to the up projection of separate gate/up experts."""
    return case.bias == "after_reshape" and case.activation == "swiglu_separate"


def top1_argmax_bias(case: LayerCase) -> bool:
    """Biases on a Switch-style top-1 layer (the TopK(1) ids the spelling pass rewrites)."""
    return case.bias != "none" and case.routing == "argmax_top1"


def one_static_token_rows(case: LayerCase) -> bool:
    """One static token in the flattened-rows layouts: a scatter at k >= 2, or Range rows of [1, 1].

    Measured on every row layout and combine at ``T = 1`` (static, ranks 2 and 3, k 1 and 2):
    24 of 110 refused, all of them these.
    """
    if case.shapes != "static" or math.prod(case.token_dims) != 1:
        return False
    scatter = case.combine in SCATTERS and case.top_k >= 2
    return scatter or (case.experts == "rows_range" and case.rank == 3)


def unflattened_bias_rank(case: LayerCase) -> bool:
    """A bias of rank ``[E, N]`` unsqueezed or ``[E, 1, N]`` beside [B, S, H] tokens routed as they are."""
    return case.bias in ("en_unsqueeze", "e1n") and case.rank == 3 and not case.flat_tokens


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
    (
        "bias after_reshape x separate gate and up",
        separate_up_bias,
        "refused (activation): the up projection's gathered bias is read as SwiGLU's beta, "
        "'SwiGLU: the linear operand's offset (beta) is not a constant scalar'",
    ),
    (
        "one static token x rows (scatter k>=2, Range rank 3)",
        one_static_token_rows,
        "refused (an analysis gap: the unit token index dropped): 'the layer's output is laid "
        "out [...], not [tokens, features]' (scatters), 'the rows FCN projects (Gather) are not "
        "the tokens repeated over the k slots' or 'a Gather along a unit axis' (rows_range)",
    ),
    (
        "bias ranks x unflattened [B, S] tokens",
        unflattened_bias_rank,
        "refused (an analysis gap) except beside unnormalised routings: 'FCN: ... (Reshape) is "
        "not a projection of the per-slot activations by each slot's expert', 'GatherElements "
        "of the ids from other than [T, E] router values', 'a MatMul of a value of the router "
        "alone and FCN' (measured on one base: 9 of 11 routings refused)",
    ),
    (
        "biases x argmax_top1",
        top1_argmax_bias,
        "refused (a false refusal: the biases are gathered by the same ids as the weights): "
        "'FCN: the bias is selected with other indices than the weights'",
    ),
)


# -- strategies ----------------------------------------------------------------------------


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
    # a top-1 routing has one slot: no base for a mutation that needs two
    routing = pick("routing", tuple(r for r in ROUTINGS if r != "argmax_top1"
                                    or not needs_two_slots(mutation, r)))  # fmt: skip
    granularity = pick("granularity", GRANULARITIES)
    blocked = weight_dtype != "float32" and granularity == "block32"
    sizes = (32, 64) if blocked else (16, 32, 48)
    groups = topk_group = 1
    if routing == "grouped_topk":  # groups of 2 or more experts (a top-2 sum scores each)
        experts_count = draw(st.sampled_from((4, 6, 8)))
        groups = draw(st.sampled_from(group_options(experts_count)))
        topk_group = draw(st.integers(1, groups - 1))
    else:  # a top-1 capacity_drop overflows an expert often only among few experts
        few = mutation == "capacity_drop" and routing == "argmax_top1"
        experts_count = draw(st.integers(2, 3 if few else 8))
    rank = pick("rank", RANKS)
    # reversed or rolled tokens, a softmax or a count over tokens, differ only with two or more
    least = 2 if mutation in NEEDS_TWO_TOKENS else 1
    token_dims = (
        (draw(st.integers(least, 6)),)
        if rank == 2
        else (draw(st.integers(least, 3)), draw(st.integers(least, 4)))
    )
    most_k = topk_group * (experts_count // groups)
    least_k = 2 if needs_two_slots(mutation, routing) else 1
    if mutation == "capacity_drop":  # 2 k > E: two tokens share an expert, one is dropped
        least_k = min(experts_count // 2 + 1, most_k)
    zero_point = pick("zero_point", ZERO_POINTS)
    if weight_dtype in ("uint4", "uint8") and zero_point == "absent":
        zero_point = "explicit"  # unsigned codes without a zero point mean zp 0: not symmetric
    experts_options = list(EXPERTS)
    if least_k > 1 or mutation == "capacity_drop":  # top1_squeezed has one slot only
        experts_options.remove("top1_squeezed")
    if "combine" in needs:  # a mutation of the combine: the experts its combines need
        experts_options = [
            e for e in experts_options
            if any(c not in COMBINE_NEEDS or e in COMBINE_NEEDS[c][0] for c in needs["combine"])
        ]  # fmt: skip
    if "bias" in needs:  # a mutation of the biases: a layout that has them
        experts_options = [e for e in experts_options if e in BIAS_EXPERTS]
    experts = pick("experts", tuple(experts_options))
    one_slot = routing == "argmax_top1" or experts == "top1_squeezed"
    top_k = 1 if one_slot else draw(st.integers(least_k, most_k))
    combines = tuple(
        name
        for name in COMBINES
        if name not in COMBINE_NEEDS
        or (experts in COMBINE_NEEDS[name][0] and rank in COMBINE_NEEDS[name][1])
    )
    if experts == "top1_squeezed":  # its combine is a Mul of [T, H] by the [T, 1] weights
        combines = ("mul_reducesum",)
    biases = BIASES if experts in BIAS_EXPERTS else ("none",)
    return LayerCase(
        router=pick("router", ROUTERS),
        routing=routing,
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
        top_k=top_k,
        token_dims=token_dims,
        seed=draw(st.integers(0, 2**31 - 1)),
        mutation=mutation,
        opset_version=draw(st.sampled_from(OPSETS)),
        groups=groups,
        topk_group=topk_group,
        bias=pick("bias", biases),
    )


def unmutated(case: LayerCase) -> LayerCase:
    """The equivalent layer a mutant breaks."""
    return replace(case, mutation=None)


def is_valid(case: LayerCase) -> bool:
    """Whether an unmutated case is a layer that one MoE/QMoE node computes.

    What :func:`layer_cases` guarantees, for cases edited by hand (the long run's sweep):
    unsigned codes need their zero point, blocks of 32 need H and I multiples of 32,
    ``1 <= k <= E``, a top-1 routing k = 1, and a grouped top-k 2 or more groups of 2 or more
    experts, fewer groups kept than there are and ``k`` within them (other routings: no groups).
    """
    if case.weight_dtype in ("uint4", "uint8") and case.zero_point == "absent":
        return False
    if case.quantized and case.granularity == "block32":
        if case.hidden % 32 or case.inter % 32:
            return False
    if case.combine in COMBINE_NEEDS:
        experts, ranks = COMBINE_NEEDS[case.combine]
        if case.experts not in experts or case.rank not in ranks:
            return False
    if case.routing == "argmax_top1" and case.top_k != 1:
        return False
    if case.experts == "top1_squeezed" and (case.top_k != 1 or case.combine != "mul_reducesum"):
        return False
    if case.bias != "none" and case.experts not in BIAS_EXPERTS:
        return False
    most_k = case.experts_count
    if case.routing == "grouped_topk":
        if case.groups not in group_options(case.experts_count):
            return False
        if not 1 <= case.topk_group < case.groups:
            return False
        most_k = case.topk_group * (case.experts_count // case.groups)
    elif (case.groups, case.topk_group) != (1, 1):
        return False
    return 1 <= case.top_k <= most_k


def with_routing(case: LayerCase, routing: str) -> LayerCase:
    """``case`` routed by ``routing``, its k and groups fitted to it where they do not fit.

    Top-1 gets ``k = 1``; a grouped top-k the fewest groups of 2 or more experts and one kept
    group (``k`` cut to that group's size); other routings no groups. The result may still be
    invalid (:func:`is_valid`: a grouped top-k of an odd number of experts).
    """
    changes: dict[str, object] = {"routing": routing, "groups": 1, "topk_group": 1}
    if routing == "argmax_top1":
        changes["top_k"] = 1
    options = group_options(case.experts_count)
    if routing == "grouped_topk" and options:
        changes["groups"] = options[0]
        changes["top_k"] = min(case.top_k, case.experts_count // options[0])
    return replace(case, **changes)


def overflows_capacity(case: LayerCase) -> bool:
    """Whether tokens of ``case`` overflow an expert capacity of one often (``capacity_drop``).

    Any two tokens share an expert where ``2 k > E``. A grouped top-k's kept groups may
    differ: there ``k`` fills them. A top-1 routing among at most 3 experts: most pairs do.
    """
    if case.routing == "grouped_topk":
        return case.top_k == case.topk_group * (case.experts_count // case.groups)
    if case.routing == "argmax_top1":
        return case.experts_count <= 3
    return 2 * case.top_k > case.experts_count


def mutant_of(case: LayerCase, mutation: str) -> LayerCase | None:
    """``case`` broken by ``mutation``, or None where the mutation does not apply to it.

    It applies where :func:`layer_cases` would draw it: the spellings of ``MUTATION_NEEDS``,
    two or more tokens on every static token axis (``NEEDS_TWO_TOKENS``), two or more slots
    (``needs_two_slots``), and tokens
    that overflow the capacity (``capacity_drop``: :func:`overflows_capacity`).
    """
    for axis, values in MUTATION_NEEDS.get(mutation, {}).items():
        if case.axis_values()[axis] not in values:
            return None
    if mutation in NEEDS_TWO_TOKENS and min(case.token_dims) < 2:
        return None
    if needs_two_slots(mutation, case.routing) and case.top_k < 2:
        return None
    if mutation == "capacity_drop" and not overflows_capacity(case):
        return None
    return replace(case, mutation=mutation)


def is_supported(case: LayerCase) -> bool:
    """Whether every spelling of ``case`` is in SUPPORTED and no listed combination excludes it."""
    for axis, value in case.axis_values().items():
        if value is not None and value not in SUPPORTED[axis]:
            return False
    return not any(pred(case) for _, pred, _ in UNSUPPORTED_COMBINATIONS)


def supported_cases(
    routing: str | None = None, quantized: bool | None = None
) -> st.SearchStrategy[LayerCase]:
    """Equivalent layers built from supported spellings only (the CI property 1).

    ``routing`` and ``quantized`` (float or quantized weights) narrow the draw further.
    """
    allowed = dict(SUPPORTED)
    if routing is not None:
        allowed["routing"] = allowed["routing"] & {routing}
    if quantized is not None:
        allowed["weight_dtype"] = frozenset(
            d for d in allowed["weight_dtype"] if (d != "float32") == quantized
        )
    return layer_cases(allowed).filter(is_supported)


def all_cases() -> st.SearchStrategy[LayerCase]:
    """Equivalent layers built from every spelling (the long run)."""
    return layer_cases(None)


def _mutants(allowed: Mapping[str, frozenset] | None, mutations: tuple) -> st.SearchStrategy:
    return st.sampled_from(mutations).flatmap(lambda m: layer_cases(allowed, m))


def supported_mutants(
    mutation: str | None = None, constructed: bool | None = None
) -> st.SearchStrategy[LayerCase]:
    """Broken layers: a supported mutation (or ``mutation``) on a supported base (property 2).

    ``constructed`` narrows the bases to those whose routing needs the routing construction
    (``LayerCase.constructed``: True) or those the fused ops route themselves (False).
    """
    mutations = tuple(m for m in MUTATIONS if m in SUPPORTED["mutation"])
    if mutation is not None:
        mutations = (mutation,)
    allowed = dict(SUPPORTED)  # the bases only the analysis of meaning fuses included
    if constructed is not None:
        family = {*CONSTRUCTED_ROUTINGS, "softmax_topk_raw"} if constructed else SOFTMAX_ROUTINGS
        allowed["routing"] = allowed["routing"] & frozenset(family)
    strategy = _mutants(allowed, mutations).filter(is_supported)
    if constructed is None:
        return strategy
    return strategy.filter(lambda case: case.constructed == constructed)


def mutation_applies(mutation: str, constructed: bool) -> bool:
    """Whether ``mutation`` has supported bases of that routing family to apply to."""
    family = {*CONSTRUCTED_ROUTINGS, "softmax_topk_raw"} if constructed else SOFTMAX_ROUTINGS
    needs = MUTATION_NEEDS.get(mutation, {}).get("routing", frozenset(ROUTINGS))
    return bool(needs & SUPPORTED["routing"] & frozenset(family))


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
