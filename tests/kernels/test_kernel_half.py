"""Float16 QMoE and MoE kernels (issue 20): float16 I/O, float32 accumulation, every variant.

Each variant is forced wherever its ``when`` holds, on float16 tensors (input, router logits
and weights, biases, QMoE scales, MoE expert weights), with poisoned outputs, and compared
with the numpy oracle (``onnx_moe_fuse.verify.oracles``, written apart from the kernels) run
on the same float16 values widened to float32 (exact). The inputs are then no error source:
what is left is the kernel's one rounding of each output element to float16 (at most 2^-11
of the element, so of the largest element: the error measure is ``max|kernel - oracle| /
max|oracle|``) plus the float32 accumulation error the float32 tests bound by ``TOL``
(1e-4). So the bound is ``2^-11 + TOL`` (5.9e-4); a float16 accumulation (10 mantissa bits
over H or I terms) or an unwidened bias would miss it by far. Random inputs are fresh per
run (the ``rng`` fixture prints the seed).

Decode token counts (1-3) run the decode variants (fused, routed, gemv, split/stage) on every
config; 64 tokens run each prefill variant (grouped, tiled) once, on one of the two SwiGLU
configs, since lavapipe compiles a tiled pipeline in several seconds (the float32 tests cover
the fusion modes on every variant; the float16 forms differ only in their loads and stores).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import TOL, eligible, rel_err
from test_kernel_moe import random_call as moe_call
from test_kernel_qmoe import SGMAT, _kernel_at_width
from test_kernel_qmoe import random_call as qmoe_call

from onnx_moe_fuse.kernels.device import default_device
from onnx_moe_fuse.kernels.manifest import load_manifest
from onnx_moe_fuse.kernels.planner import DeviceFacts, KernelCallError, make_plan
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders
from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES

#: output rounding to float16 (half an ulp: 2^-11 relative) plus the float32 bound
HALF_TOL = 2.0**-11 + TOL

#: (E, H, I, k, bits, block, activation, swiglu_fusion, fc1 bias, fc2 bias, swiglu_limit);
#: 4-bit rows of H, I multiples of 32 so that the fused decode path runs too
QMOE_CONFIGS = [
    (4, 64, 32, 2, 4, 16, "swiglu", 1, True, True, 7.0),
    (4, 64, 32, 1, 8, None, "swiglu", 2, False, False, None),
    (8, 64, 32, 8, 4, None, "gelu", 0, True, False, None),
    (4, 32, 32, 2, 8, 16, "silu", 0, False, True, None),
    (4, 64, 32, 2, 4, None, "relu", 0, False, False, None),
]
#: (E, H, I, k, activation, swiglu_fusion, FC3, fc1 bias, fc2 bias, fc3 bias, swiglu_limit);
#: the last has rows not a multiple of 4 (one value a word)
MOE_CONFIGS = [
    (4, 32, 16, 2, "swiglu", 1, False, True, True, False, 7.0),
    (4, 32, 16, 1, "swiglu", 0, True, False, True, True, None),
    (8, 32, 16, 8, "relu", 0, False, True, False, False, None),
    (4, 32, 16, 2, "silu", 0, True, True, False, True, None),
    (3, 18, 10, 2, "gelu", 0, False, False, True, False, None),
]
DECODE_VARIANTS = {
    "quant_decode_fused",
    "quant_decode_routed",
    "quant_gemv_routed",
    "quant_split_routed",
    "moe_decode_fused",
    "moe_decode_routed",
    "moe_gemv",
    "moe_stage",
}


def as_half(call: dict) -> dict:
    """The call with every float32 tensor rounded to float16 (uint8 weights stay)."""
    return {k: a.astype(np.float16) if a.dtype == np.float32 else a for k, a in call.items()}


def widened(call: dict) -> dict:
    """The float16 tensors widened to float32 (exact): what the oracle reads."""
    return {k: a.astype(np.float32) if a.dtype == np.float16 else a for k, a in call.items()}


def checked_half(out: np.ndarray, want: np.ndarray, what: str) -> float:
    """Assert a float16 kernel output is written and within ``HALF_TOL`` of ``want``."""
    assert out.dtype == np.float16, f"{what}: dtype {out.dtype}"
    assert out.shape == want.shape, f"{what}: shape {out.shape} != {want.shape}"
    assert not np.isnan(out).any(), f"{what}: unwritten (poisoned) or NaN output elements"
    err = rel_err(out, want, zero_scale=1.0)
    assert err <= HALF_TOL, f"{what}: relative error {err:.3g} > {HALF_TOL:.3g}"
    return err


def run_half(kernel, op: str, call: dict, attrs: dict, what: str, keep) -> dict[str, float]:
    """Every eligible variant that ``keep(variant)`` accepts, forced, vs the oracle."""
    half = as_half(call)
    want = KERNEL_ORACLES[op](widened(half), attrs)["outputT"]
    errors = {}
    for vid, tun in eligible(kernel, half, attrs, {}, {}).items():
        if not keep(vid):
            continue
        out = kernel(attrs=attrs, variant=vid, tunables=tun, poison_outputs=True, **half)
        errors[vid] = checked_half(out["outputT"], want, f"{what} [{vid}]")
    return errors


@pytest.fixture
def f16_device(device):
    if not device.has_f16:
        pytest.skip("adapter has no shader-f16")
    return device


@pytest.mark.parametrize(
    ("op", "configs", "make_call"),
    [("QMoE", QMOE_CONFIGS, qmoe_call), ("MoE", MOE_CONFIGS, moe_call)],
)
def test_float16_every_variant(f16_device, rng, op, configs, make_call):
    """Decode variants on every config; prefill variants split over the two SwiGLU configs."""
    kernel = get_kernel(f"com.microsoft.{op}")
    covered: Counter = Counter()
    worst = 0.0
    ids = {v.id for v in kernel.manifest.variants}
    expected = {v for v in ids if "zero_inter" not in v and v != SGMAT}  # tested apart
    prefill_ids = sorted(expected - DECODE_VARIANTS)
    for i, config in enumerate(configs):
        tokens = int(rng.integers(1, 4))
        call, attrs = make_call(rng, config, tokens, int(rng.integers(2, 4)))
        what = f"{op} {config} T={tokens} attrs={attrs}"
        errors = run_half(kernel, op, call, attrs, what, DECODE_VARIANTS.__contains__)
        if i < 2:  # SwiGLU interleaved, and non-interleaved (QMoE fusion 2, MoE FC3)
            call, attrs = make_call(rng, config, 64, 2)
            what = f"{op} {config} T=64 attrs={attrs}"
            half_of = prefill_ids[i::2]  # each prefill variant once: tiled ones compile slowly
            prefill = run_half(kernel, op, call, attrs, what, half_of.__contains__)
            assert prefill, f"{what}: no prefill variant ran"
            errors.update(prefill)
        covered.update(errors.keys())
        worst = max(worst, *errors.values())
    print(f"{op} float16: runs per variant {dict(covered)}, worst rel err {worst:.2e}")
    assert expected <= set(covered), f"variants never run in float16: {expected - set(covered)}"


def test_float16_subgroup_variant_at_the_measured_width(f16_device, rng):
    """The QMoE subgroup variant (retargeted to this adapter's subgroup width) in float16."""
    width = f16_device.adapter_info.get("subgroupMinSize")
    if "subgroups" not in f16_device.features or width not in (8, 16, 32):
        pytest.skip("adapter without a fixed 8/16/32-lane subgroup width")
    kernel = _kernel_at_width(width)
    call, attrs = qmoe_call(rng, QMOE_CONFIGS[0], 40, 2)
    errors = run_half(kernel, "QMoE", call, attrs, f"sgmat@{width}", SGMAT.__eq__)
    assert SGMAT in errors


def test_float16_zero_inter_and_float32_scales(f16_device, rng):
    """Float16 edges: inter_size 0, zero points, float32 scales with float16 activations.

    inter_size 0 writes float16 zeros; explicit zero points are refused; float32 scales with
    a float16 input (T2 != T) run.
    """
    kernel = get_kernel("com.microsoft.QMoE")
    call, attrs = qmoe_call(rng, QMOE_CONFIGS[0], 3, 2)
    half = as_half(call)
    e, h = call["fc2T"].shape[0], call["inputT"].shape[-1]
    empty = {
        **half,
        "fc1T": np.zeros((e, 0, h // 2), np.uint8),
        "fc1ScalesT": np.zeros((e, 0, h // 16), np.float16),
        "fc2T": np.zeros((e, h, 0), np.uint8),
        "fc2ScalesT": np.zeros((e, h, 0), np.float16),
    }
    empty = {k: v for k, v in empty.items() if not k.endswith("BiasT")}
    out = kernel(attrs=attrs, poison_outputs=True, **empty)["outputT"]
    assert out.dtype == np.float16 and not np.isnan(out).any() and not out.any()
    # explicit zero points: refused in float16 as in float32 (the kernel is symmetric; the
    # verifier runs asymmetric nodes on the oracle)
    points = np.full((e, call["fc1T"].shape[1], 1), 0x88, np.uint8)
    with pytest.raises(KernelCallError, match="zero point"):
        kernel(attrs=attrs, fc1ZeroPointsT=points, **half)
    mixed = {**half, "fc1ScalesT": call["fc1ScalesT"], "fc2ScalesT": call["fc2ScalesT"]}
    want = KERNEL_ORACLES["QMoE"](widened(mixed), attrs)["outputT"]
    checked_half(kernel(attrs=attrs, poison_outputs=True, **mixed)["outputT"], want, "T2 float32")


def test_float16_needs_shader_f16(rng):
    """Without the adapter feature every float16 call is refused by the f16Ok check."""
    dev = default_device()
    facts = DeviceFacts(dict(dev.limits), frozenset({"subgroups"}), dict(dev.adapter_info))
    for folder, call_of, config in [
        ("qmoe", qmoe_call, QMOE_CONFIGS[0]),
        ("moe", moe_call, MOE_CONFIGS[0]),
    ]:
        manifest = load_manifest(
            next(f for f in package_folders() if f.name == folder) / "manifest.json"
        )
        call, attrs = call_of(rng, config, 2, 2)
        with pytest.raises(KernelCallError, match="float16 needs the adapter feature shader-f16"):
            make_plan(manifest, facts, as_half(call), attrs)
        assert make_plan(manifest, facts, call, attrs).variant  # float32 still plans
