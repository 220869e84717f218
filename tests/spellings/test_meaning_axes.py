"""The generator's issue-18 axes are honest layers, whether or not the fuser takes them yet.

Property 1 and 2 (``test_properties.py``) draw from ``SUPPORTED`` only, and the spellings of
issue 18 (hand-written activations, row layouts, scatter combines, k = 1 squeezed, bias ranks:
``strategies.MEANING_AXES``) did not fuse when they were added, so here each is checked against
the reference on its own. Here every such spelling is drawn on otherwise supported layers: the built layer
must compute the numpy reference (``reference.py``), and each new mutation must compute
something else than its base. Fixed examples (profile ``spellings-ci``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .build import build_case
from .outcomes import relative_error, session, token_shape
from .reference import reference
from .strategies import (
    MEANING_AXES,
    ROW_EXPERTS,
    SCATTERS,
    SUPPORTED,
    LayerCase,
    is_valid,
    layer_cases,
    unmutated,
)

CI = settings.get_profile("spellings-ci")
NEW_MUTATIONS = sorted(MEANING_AXES["mutation"])


def _allowing(axis: str, value: object) -> dict[str, frozenset]:
    """SUPPORTED with ``axis`` narrowed to ``value`` (and what that spelling needs)."""
    allowed = dict(SUPPORTED)
    allowed[axis] = frozenset({value})
    if axis == "combine":  # the scatters sum flat rows
        allowed["experts"] = frozenset({"rows_gathernd"})
    if axis == "bias":  # biases are written for the per-slot layouts
        allowed["experts"] = frozenset({"gather_expand", "gather_reshape", "transpose_weights"})
    if axis == "experts" and value == "top1_squeezed":
        allowed["combine"] = frozenset({"mul_reducesum"})
    return allowed


NEW_SPELLINGS = [
    pytest.param(axis, value, id=f"{axis}={value}")
    for axis, values in sorted(MEANING_AXES.items())
    if axis != "mutation"
    for value in sorted(values)
]


@pytest.mark.parametrize(("axis", "value"), NEW_SPELLINGS)
def test_new_spelling_matches_numpy_reference(axis: str, value: object) -> None:
    @settings(CI, max_examples=6)
    @given(layer_cases(_allowing(axis, value)).filter(is_valid))
    def check(case: LayerCase) -> None:
        assert case.axis_values()[axis] == value
        built = build_case(case)
        rng = np.random.default_rng(case.seed)
        x = rng.standard_normal(token_shape(case, rng)).astype(np.float32)
        err = relative_error(session(built.model).run(None, {"x": x})[0],
                             reference(case, built.params, x))  # fmt: skip
        assert err <= 1e-5, f"{case.label()}: built layer off the reference by {err:.1e}"

    check()


def _mutant_bases(mutation: str) -> dict[str, frozenset]:
    needs = {
        "silu_off": ("activation", "silu_exp"),
        "scatter_other_token": ("combine", "scatter_elements"),
        "rows_other_token": ("experts", "rows_gathernd"),
        "bias_other_ids": ("bias", "en_unsqueeze"),
    }[mutation]
    return _allowing(*needs)


@pytest.mark.parametrize("mutation", NEW_MUTATIONS)
def test_new_mutation_computes_something_else(mutation: str) -> None:
    @settings(CI, max_examples=6)
    @given(st.just(mutation).flatmap(lambda m: layer_cases(_mutant_bases(m), m)))
    def check(case: LayerCase) -> None:
        base, mutant = (session(build_case(c).model) for c in (unmutated(case), case))
        rng = np.random.default_rng(case.seed)
        errors = []
        for _ in range(8):
            x = rng.standard_normal(token_shape(case, rng)).astype(np.float32)
            outs = [s.run(None, {"x": x})[0] for s in (base, mutant)]
            errors.append(relative_error(outs[1], outs[0].astype(np.float64)))
            if errors[-1] > 1e-5:
                return
        raise AssertionError(f"{case.label()}: the mutant computes its base's numbers: {errors}")

    check()


@pytest.mark.parametrize("combine", sorted(SCATTERS))
def test_scatter_other_token_is_no_permutation_of_the_layer(combine: str) -> None:
    """``scatter_other_token`` changes what the layer computes, beyond moving its token rows.

    Shifting whole tokens (or any scatter at k = 1) leaves the layer's rows whole, only moved:
    one fused node then the scatter computes that, and the fuser rightly fuses it. The mutant
    must differ from its base on the reference inputs (one of eight), and on such an input it has
    a row that is no row of the base's output.
    """
    allowed = {**SUPPORTED, "combine": frozenset({combine}), "experts": ROW_EXPERTS}

    @settings(CI, max_examples=12)
    @given(layer_cases(allowed, "scatter_other_token"))
    def check(case: LayerCase) -> None:
        assert case.top_k >= 2, case.label()
        base, mutant = (session(build_case(c).model) for c in (unmutated(case), case))
        rng = np.random.default_rng(case.seed + 1)  # outcomes.check_equivalent's inputs
        for _ in range(8):
            x = rng.standard_normal(token_shape(case, rng)).astype(np.float32)
            want, got = (s.run(None, {"x": x})[0].reshape(-1, case.hidden) for s in (base, mutant))
            scale = float(np.abs(want).max())
            if relative_error(got, want.astype(np.float64)) <= 1e-5:
                continue  # one token: every row's next row is its own token's
            gap = np.abs(got[:, None, :] - want[None, :, :]).max(axis=-1).min(axis=1)  # [T]
            assert gap.max() > 1e-5 * scale, f"{case.label()}: the base's rows, moved"
            return
        raise AssertionError(f"{case.label()}: the mutant computes its base's numbers")

    check()
