"""MatMulNBitsQkv kernel package: every variant forced, against the oracle and ONNX Runtime.

References:

* the numpy oracle (``onnx_moe_fuse.verify.oracles.matmul_nbits_qkv``), written apart from the kernel;
* ONNX Runtime's CPU composition that MatMulNBitsQkv replaces: ``SimplifiedLayerNormalization``
  (ai.onnx domain) or ``com.microsoft.SkipSimplifiedLayerNormalization`` (output 3 = A + skip),
  then three ``com.microsoft.MatMulNBits`` (bits 4, block 32, accuracy_level 0), weights as
  initializers, graph optimisations disabled. (ORT 1.32 has no CPU kernel for the fused node.)

Error measure per output: ``max|got - want| / max|want|``; float32 within 1e-4, float16 within
2e-3 (ORT's float16 composition rounds the normed rows to float16, the kernel keeps them float32).
The residual (A + skip) must be bit-exact. Outputs are poisoned with NaN bits before each run.

Shapes are drawn from a small pool: lavapipe compiles a pipeline at its first dispatch (0.1-1 s),
and pipelines are cached by their rendered constants, so a few shapes keep the file fast.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import rel_err
from planning import assert_valid_choice

from onnx_moe_fuse.kernels.cases import load_cases
from onnx_moe_fuse.kernels.planner import KernelCallError
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders
from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES
from onnx_moe_fuse.verify.oracles.quant import quantize_matmul_nbits
from onnx_moe_fuse.verify.ort_nodes import run_qkv_composition

ort = pytest.importorskip("onnxruntime")

NAME = "com.microsoft.MatMulNBitsQkv"
FOLDER = next(f for f in package_folders() if f.name == "matmul_nbits_qkv")
CASES = load_cases(FOLDER / "test.json")
VARIANTS = ["norm", "split_norm", "skip", "split_skip", "skipsum", "split_skipsum"]
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-3}
OUTPUTS = ("qT", "kT", "vT")
EPSILON = 1e-6

#: (K, Nq, Nkv): N not a multiple of the column tiles; K = 80 has a padded last block.
SHAPES = [(64, 40, 20), (80, 48, 16)]
#: Leading dims: 1 row (the decode walk), 3 rows (a 3-row tile), 8 and 19 rows (8-row tiles,
#: the last one partial); rank 2 and rank 3 of each.
LEADS = [(1,), (1, 1), (3,), (3, 1), (8,), (2, 4), (19,), (1, 19)]


def _needs_skip(variant: str) -> bool:
    return "skip" in variant


def _wants_residual(variant: str) -> bool:
    return variant.endswith("skipsum")


def _random_call(rng: np.random.Generator, dtype, lead, shape, skip: bool) -> dict:
    k, nq, nkv = shape
    call = {
        "aT": rng.standard_normal((*lead, k)).astype(dtype),
        "normScaleT": rng.uniform(0.5, 1.5, k).astype(dtype),
    }
    if skip:
        call["skipT"] = rng.standard_normal((*lead, k)).astype(dtype)
    for p, n in (("q", nq), ("k", nkv), ("v", nkv)):
        w = rng.standard_normal((n, k)) / np.sqrt(k)
        call[f"{p}BT"], call[f"{p}ScalesT"] = quantize_matmul_nbits(
            w, 4, 32, rng, scale_dtype=dtype
        )
    return call


def _attrs(call: dict, epsilon: float | None = EPSILON) -> dict:
    attrs = {
        "K": call["aT"].shape[-1],
        "Nq": call["qBT"].shape[0],
        "Nkv": call["kBT"].shape[0],
        "block_size": 32,
    }
    if epsilon is not None:
        attrs["epsilon"] = epsilon
    return attrs


def _oracle(call: dict, attrs: dict) -> dict:
    return KERNEL_ORACLES["MatMulNBitsQkv"](call, attrs)


def _run(call: dict, attrs: dict, variant: str, tunables: dict | None = None) -> dict:
    return get_kernel(NAME)(
        **call,
        attrs=attrs,
        variant=variant,
        tunables=tunables,
        poison_outputs=True,
        optional_outputs=["residualT"] if _wants_residual(variant) else [],
    )


def _compare(out: dict, want: dict, dtype, what: str, errors: dict | None = None) -> None:
    assert set(out) == set(want), f"{what}: outputs {sorted(out)} != {sorted(want)}"
    for key, ref in want.items():
        got = out[key]
        assert got.shape == ref.shape, f"{what} {key}: shape {got.shape} != {ref.shape}"
        assert got.dtype == ref.dtype, f"{what} {key}: dtype {got.dtype} != {ref.dtype}"
        assert not np.isnan(got).any(), f"{what} {key}: unwritten (poisoned) elements"
        if key == "residualT":
            np.testing.assert_array_equal(got, ref, err_msg=f"{what} {key}")
            continue
        err = rel_err(got, ref)
        if errors is not None:
            errors[key] = max(errors.get(key, 0.0), err)
        assert err <= TOL[np.dtype(dtype)], f"{what} {key}: relative error {err:.3g}"


def test_kernel_lists_its_variants(device):
    assert get_kernel(NAME).variants == VARIANTS


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_cases_against_oracle_and_ort(device, rng, variant):
    """100 random cases per forced variant: f32 and f16, rank 2 and 3, 1 to 19 rows."""
    errors = {dt: {"oracle": {}, "ort": {}} for dt in ("float32", "float16")}
    dtypes = [np.float32, np.float16] if device.has_f16 else [np.float32]
    for i in range(100):
        # Every lead shape with every dtype, in turn; K/Nq/Nkv and all data drawn afresh.
        dtype = dtypes[i % len(dtypes)]
        lead = LEADS[(i // len(dtypes)) % len(LEADS)]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        call = _random_call(rng, dtype, lead, shape, _needs_skip(variant))
        attrs = _attrs(call)
        out = _run(call, attrs, variant)
        what = f"{variant} case {i} {np.dtype(dtype).name} A{list(call['aT'].shape)} {shape}"
        ref = _oracle(call, attrs)
        ort_out = run_qkv_composition(call, attrs)
        if not _wants_residual(variant):
            ref.pop("residualT", None)
            ort_out.pop("residualT", None)
        e = errors[np.dtype(dtype).name]
        _compare(out, ref, dtype, f"{what} vs oracle", e["oracle"])
        _compare(out, ort_out, dtype, f"{what} vs ORT CPU", e["ort"])
    for dt, by_ref in errors.items():
        for ref_name, errs in by_ref.items():
            if errs:
                worst = ", ".join(f"{k[0].upper()} {v:.2e}" for k, v in sorted(errs.items()))
                print(f"max relative error {variant} {dt} vs {ref_name}: {worst}")


def _case_variants(case) -> list[str]:
    return list(case.variants) if case.variants is not None else ["chosen"]


CASE_RUNS = [(c, v) for c in CASES for v in _case_variants(c)]


@pytest.mark.parametrize(
    ("case", "variant"), CASE_RUNS, ids=[f"{c.name}-{v}" for c, v in CASE_RUNS]
)
def test_case(device, rng, case, variant):
    kernel = get_kernel(NAME)
    inputs = case.materialize(rng)
    if any(a.dtype == np.float16 for a in inputs.values()) and not device.has_f16:
        pytest.skip("adapter has no shader-f16")
    optional = ["residualT"] if _wants_residual(variant) else []
    if case.error is not None:
        with pytest.raises(ValueError, match=re.escape(case.error)):
            kernel(
                **inputs,
                attrs=case.attrs,
                variant=None if variant == "chosen" else variant,
                tunables=case.tunables,
                optional_outputs=optional,
            )
        return
    out = kernel(
        **inputs,
        attrs=case.attrs,
        variant=None if variant == "chosen" else variant,
        tunables=case.tunables,
        poison_outputs=True,
        optional_outputs=optional,
    )
    expected = case.expected_arrays()
    want = _oracle(inputs, case.attrs)
    if not optional:
        want.pop("residualT", None)
    assert set(out) == set(want)
    for key, ref in want.items():
        got = out[key]
        assert got.shape == ref.shape and got.dtype == ref.dtype, key
        assert not np.isnan(got).any(), f"{case.name} {key}: unwritten (poisoned) elements"
        if expected is not None and key in expected:
            np.testing.assert_allclose(
                got.astype(np.float64),
                expected[key].astype(np.float64),
                rtol=case.rtol,
                atol=case.atol,
                err_msg=f"{case.name} {key} vs test.json",
            )
        if key == "residualT":
            np.testing.assert_array_equal(got, ref, err_msg=f"{case.name} residual")
        else:
            err = rel_err(got, ref)
            assert err <= TOL[got.dtype], f"{case.name} {key} vs oracle: {err:.3g}"


def test_plan_prefers_fused_projections_and_follows_skip_and_residual(device, rng):
    kernel = get_kernel(NAME)
    call = _random_call(rng, np.float32, (4,), (64, 40, 20), skip=False)
    # Which inputs and outputs a call has decides the family (norm, skip, skipsum: each
    # reads or writes them); fused or split projections within it is the priorities'
    # (measured) business: the choice must be valid and top priority, either way.
    assert assert_valid_choice(kernel.plan(**call, attrs=_attrs(call))) in ("norm", "split_norm")
    skip = {**call, "skipT": call["aT"].copy()}
    assert assert_valid_choice(kernel.plan(**skip, attrs=_attrs(call))) in ("skip", "split_skip")
    plan = kernel.plan(**skip, attrs=_attrs(call), optional_outputs=["residualT"])
    assert assert_valid_choice(plan) in ("skipsum", "split_skipsum")
    assert plan.output_shapes["residualT"] == (4, 64)
    assert "present.skipT" in plan.rejected["norm"]


def test_residual_needs_skip_and_only_optional_outputs_can_be_asked_for(device, rng):
    kernel = get_kernel(NAME)
    call = _random_call(rng, np.float32, (2,), (64, 40, 20), skip=False)
    with pytest.raises(KernelCallError, match="normContractOk"):
        kernel(**call, attrs=_attrs(call), optional_outputs=["residualT"])
    with pytest.raises(KernelCallError, match="'qT' is not an optional output"):
        kernel(**call, attrs=_attrs(call), optional_outputs=["qT"])


def test_decode_and_tiled_walks_render_their_templates(device, rng):
    """One row takes the vec4 decode walk (subgroups where the device has them); more, tiles."""
    kernel = get_kernel(NAME)
    one = _random_call(rng, np.float32, (1,), (64, 40, 20), skip=False)
    many = _random_call(rng, np.float32, (5,), (64, 40, 20), skip=False)
    for call, walk in ((one, "Decode walk"), (many, "Tiled walk")):
        plan = kernel.plan(**call, attrs=_attrs(call))
        scope = kernel.recorder.variant_scope(plan)
        main = plan.variant.passes[1]
        pass_scope = scope.child(derived=main.derive)
        bindings = kernel.recorder.resolved_bindings(main, pass_scope)
        code = kernel.render(
            main.shader,
            kernel.recorder.template_constants(pass_scope, main),
            [facts for _, facts in bindings],
        )
        assert walk in code
        if walk == "Decode walk":
            assert "array<vec4<u32>>" in code and "array<vec4<f32>>" in code
            assert ("subgroupAdd" in code) == ("subgroups" in device.features)
        else:
            assert "subgroupAdd" not in code
