"""GroupedMatMul kernel package: every test.json case and random cases, each variant forced.

The reference is the numpy oracle (``onnx_moe_fuse.verify.oracles.grouped_matmul``), written
apart from the kernel; literal expectations in test.json come from the ONNX page.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from planning import assert_valid_choice

from onnx_moe_fuse.kernels.cases import load_cases
from onnx_moe_fuse.kernels.planner import KernelCallError
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders
from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES

FOLDER = next(f for f in package_folders() if f.name == "grouped_matmul")
CASES = load_cases(FOLDER / "test.json")
VARIANTS = ["decode", "tiled"]


def _oracle(inputs: dict) -> np.ndarray:
    return KERNEL_ORACLES["GroupedMatMul"](inputs, {})["outputT"]


def _close(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float, what: str):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert not np.isnan(actual).any(), f"{what}: unwritten (poisoned) elements in the output"
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol, err_msg=what
    )


def test_kernel_lists_its_variants(device):
    assert get_kernel("GroupedMatMul", version=1).variants == VARIANTS


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(device, rng, case, variant):
    kernel = get_kernel("GroupedMatMul")
    inputs = case.materialize(rng)
    if case.error is not None:
        with pytest.raises(ValueError, match=re.escape(case.error)):
            kernel(**inputs, variant=variant, poison_outputs=True)
        return
    out = kernel(**inputs, variant=variant, poison_outputs=True)["outputT"]
    expected = case.expected_arrays()
    if expected is not None:
        _close(out, expected["outputT"], case.rtol, case.atol, f"{case.name} vs test.json")
    _close(out, _oracle(inputs), case.rtol, case.atol, f"{case.name} vs oracle")


def _random_call(rng: np.random.Generator, dtype) -> dict:
    tokens = int(rng.choice([0, 1, 2, 3, 5, 9, 17, 33, 40]))
    hidden, out_cols = int(rng.integers(1, 41)), int(rng.integers(1, 41))
    groups, selections = int(rng.integers(1, 10)), int(rng.integers(0, 5))
    index_dtype = rng.choice([np.int32, np.int64])
    call = {
        "inputT": rng.standard_normal((tokens, hidden)).astype(dtype),
        "weightsT": (rng.standard_normal((groups, hidden, out_cols)) * 0.5).astype(dtype),
        "groupIndicesT": rng.integers(0, groups, (tokens, selections)).astype(index_dtype),
    }
    if rng.random() < 0.5:
        call["biasT"] = rng.standard_normal((groups, out_cols)).astype(dtype)
    return call


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_float32_cases(device, rng, variant):
    kernel = get_kernel("GroupedMatMul")
    for i in range(100):
        call = _random_call(rng, np.float32)
        out = kernel(**call, variant=variant, poison_outputs=True)["outputT"]
        shapes = {k: v.shape for k, v in call.items()}
        _close(out, _oracle(call), 1e-4, 1e-4, f"random case {i} {shapes}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_float16_cases(device, rng, variant):
    if not device.has_f16:
        pytest.skip("adapter has no shader-f16")
    kernel = get_kernel("GroupedMatMul")
    for i in range(20):
        call = _random_call(rng, np.float16)
        out = kernel(**call, variant=variant, poison_outputs=True)["outputT"]
        # float16 output rounding dominates: compare with a float32 reference, cast.
        ref = _oracle(
            {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in call.items()}
        ).astype(np.float16)
        _close(out, ref, 2e-2, 2e-2, f"random f16 case {i}")


def test_plan_prefers_decode_for_few_rows_and_tiles_for_many(device, rng):
    kernel = get_kernel("GroupedMatMul")
    weights = rng.standard_normal((4, 16, 8)).astype(np.float32)
    few = kernel.plan(
        inputT=np.ones((1, 16), np.float32),
        weightsT=weights,
        groupIndicesT=np.zeros((1, 2), np.int64),
    )
    many = kernel.plan(
        inputT=np.ones((1024, 16), np.float32),
        weightsT=weights,
        groupIndicesT=np.zeros((1024, 2), np.int64),
    )
    # Both variants can run both calls; the choice is valid either way (the priorities
    # follow measurements; on a GPU tests/kernels/test_planner_choices.py times them).
    assert few.rejected == {} and many.rejected == {}
    assert_valid_choice(few)
    assert_valid_choice(many)


def test_forcing_a_variant_whose_condition_fails_names_the_condition(device, rng):
    kernel = get_kernel("GroupedMatMul")
    call = {
        "inputT": np.ones((64, 16), np.float32),
        "weightsT": rng.standard_normal((4, 16, 8)).astype(np.float32),
        "groupIndicesT": np.zeros((64, 2), np.int64),
    }
    limits = {"maxComputeWorkgroupStorageSize": 2000}  # decode needs 1024 bytes, tiled 4224
    plan = kernel.plan(**call, device_limits=limits)
    assert assert_valid_choice(plan) == "decode"  # the only one that fits the memory
    assert "tiledMemoryOk" in plan.rejected["tiled"]
    with pytest.raises(KernelCallError, match="tiledOk -> tiledMemoryOk -> tileSharedBytes"):
        kernel(**call, variant="tiled", device_limits=limits)
    with pytest.raises(KernelCallError, match="unknown variant 'fast'"):
        kernel(**call, variant="fast")


@pytest.mark.parametrize("variant", VARIANTS)
def test_grids_fold_past_the_workgroups_per_dimension_limit(device, rng, variant):
    kernel = get_kernel("GroupedMatMul")
    call = {
        "inputT": rng.standard_normal((70, 3)).astype(np.float32),
        "weightsT": rng.standard_normal((2, 3, 300)).astype(np.float32),
        "groupIndicesT": rng.integers(0, 2, (70, 4)).astype(np.int64),
    }
    # 70 * 4 slots * 5 column blocks = 1400 decode workgroups: more than 40 per dimension.
    limits = {"maxComputeWorkgroupsPerDimension": 40}
    if variant == "tiled":
        # 9 row tiles + 2 groups = 11 workgroups along x: more than 10 is refused.
        with pytest.raises(KernelCallError, match="tiledDispatchOk"):
            kernel(**call, variant=variant, device_limits={"maxComputeWorkgroupsPerDimension": 10})
        return
    with pytest.raises(KernelCallError, match="decodeOk -> decodeDispatchOk"):
        kernel(**call, variant=variant, device_limits={"maxComputeWorkgroupsPerDimension": 10})
    out = kernel(**call, variant=variant, device_limits=limits, poison_outputs=True)
    _close(out["outputT"], _oracle(call), 1e-5, 1e-5, "folded grid")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inputT": np.ones((2, 3), np.float64)}, "inputT has dtype float64"),
        ({"weightsT": np.ones((2, 3, 4), np.float16)}, "weightsT is float16 but inputT is float32"),
        ({"inputT": np.ones((2, 5), np.float32)}, "inputT has K = 5 columns"),
        ({"groupIndicesT": np.zeros((3, 1), np.int64)}, "groupIndicesT has 3 rows"),
        ({"groupIndicesT": np.zeros((2, 1), np.float32)}, "groupIndicesT has dtype float32"),
        ({"biasT": np.ones((2, 5), np.float32)}, "biasT must be \\[G, N\\] = \\[2, 4\\]"),
        ({"inputT": np.ones((2, 3, 1), np.float32)}, "inputT has rank 3"),
        ({"extraT": np.ones(1)}, "unknown tensor 'extraT'"),
    ],
)
def test_bad_calls_are_clear_errors(device, change, message):
    call = {
        "inputT": np.ones((2, 3), np.float32),
        "weightsT": np.ones((2, 3, 4), np.float32),
        "groupIndicesT": np.zeros((2, 1), np.int64),
        **change,
    }
    with pytest.raises(KernelCallError, match=message):
        get_kernel("GroupedMatMul")(**call)


def test_unknown_kernel_and_attribute_and_tunable(device):
    with pytest.raises(KeyError, match="no kernel package 'Nope'"):
        get_kernel("Nope")
    call = {
        "inputT": np.ones((2, 3), np.float32),
        "weightsT": np.ones((2, 3, 4), np.float32),
        "groupIndicesT": np.zeros((2, 1), np.int64),
    }
    with pytest.raises(KernelCallError, match="unknown attribute 'axis'"):
        get_kernel("GroupedMatMul")(**call, attrs={"axis": 1})
    with pytest.raises(KernelCallError, match="unknown tunable 'speed'"):
        get_kernel("GroupedMatMul")(**call, tunables={"speed": 2})
    with pytest.raises(KernelCallError, match="limits can only be lowered"):
        get_kernel("GroupedMatMul")(**call, device_limits={"maxComputeWorkgroupStorageSize": 2**40})
