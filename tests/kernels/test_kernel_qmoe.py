"""QMoE kernel package: test.json and random cases, every variant, vs oracle and ORT.

Each variant is forced wherever its ``when`` holds and compared with the numpy oracle and
ONNX Runtime's CPU ``com.microsoft.QMoE``.

The oracle (``onnx_moe_fuse.verify.oracles.moe.qmoe``) is written apart from the kernels and pinned
against ORT in ``tests/verify/oracles``. ORT is asked too wherever it has the mode: every case but
swiglu_fusion 2 (ORT CPU refuses it), inter_size 0 and zero tokens (ORT refuses / we skip).
Weights go to ORT as graph inputs, not initializers: with constant block-wise 8-bit weights
ORT CPU quantises the activations to int8 and is about 1% off (semantics.md).

About a third of the random calls carry ``router_weights`` (fresh non-negative values; test.json
has fixed cases of it for every routing variant), so the route stage's weighting by them runs in
the random, chunked and subgroup-width tests too.

Error measure: ``max|kernel - reference| / max|reference|``, at most 1e-4 (float32). Every
run poisons the outputs first, so an element no pass writes shows up as NaN. Random inputs
are fresh per run (the ``rng`` fixture prints the seed). Shapes come from a small pool so
that pipelines (cached by their rendered WGSL) are compiled a few hundred times, not
thousands: lavapipe compiles a pipeline in 5-40 ms.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import numpy as np
import pytest
from helpers import (
    SMALL_TUNABLES,
    TOL,
    checked,
    chunk_limits,
    draw_configs,
    rel_err,
    run_all_variants,
)
from ort_compat import run_kernel_node
from planning import assert_valid_choice

from onnx_moe_fuse.kernels.cases import load_cases
from onnx_moe_fuse.kernels.device import default_device
from onnx_moe_fuse.kernels.manifest import load_manifest, parse_manifest
from onnx_moe_fuse.kernels.planner import DeviceFacts, KernelCallError, make_plan
from onnx_moe_fuse.kernels.runtime import Kernel, get_kernel, package_folders
from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES
from onnx_moe_fuse.verify.oracles.quant import quantize_symmetric

ort = pytest.importorskip("onnxruntime")

FOLDER = next(f for f in package_folders() if f.name == "qmoe")
CASES = load_cases(FOLDER / "test.json")
VARIANTS = [
    "quant_decode_fused",
    "quant_decode_routed",
    "quant_zero_inter",
    "quant_grouped_sgmat_routed",
    "quant_grouped_routed",
    "quant_gemv_routed",
    "quant_split_routed",
    "quant_grouped_tiled8_routed",
    "quant_grouped_tiled16_routed",
]
SGMAT = "quant_grouped_sgmat_routed"
FUSED = "quant_decode_fused"
ROUTED = "quant_decode_routed"


# -- references ---------------------------------------------------------------------------


def oracle(call: dict, attrs: dict) -> np.ndarray:
    """The numpy oracle; inter_size 0 (which the oracle and ORT refuse) by definition."""
    return KERNEL_ORACLES["QMoE"](call, attrs)["outputT"]


def ort_has_mode(call: dict, attrs: dict) -> bool:
    """Whether ORT CPU's QMoE runs this call (interleaved SwiGLU only; I > 0; tokens > 0)."""
    return (
        attrs["swiglu_fusion"] in (0, 1)
        and call["fc2T"].shape[2] > 0
        and call["routerT"].shape[0] > 0
    )


def run_ort_qmoe(call: dict, attrs: dict) -> np.ndarray:
    """One QMoE node on ORT CPU, inputs at ORT's positions, every attribute written."""
    return run_kernel_node("QMoE", call, attrs)


def _subgroup_rejection_ok(plan_rejected: dict, device) -> None:
    width = device.adapter_info.get("subgroupMinSize")
    if width == 32 and device.adapter_info.get("subgroupMaxSize") == 32:
        return
    assert SGMAT in plan_rejected
    assert "sgmatSubgroupOk" in plan_rejected[SGMAT], plan_rejected[SGMAT]


# -- test.json ----------------------------------------------------------------------------


def _listed(ids: list[str]) -> list[str]:
    """The variants this file knows, in manifest order.

    The tiled prefill variants are tests/kernels/test_kernel_prefill.py's to list.
    """
    return [v for v in ids if not v.startswith("quant_grouped_tiled")]


def test_kernel_lists_its_variants(device):
    assert _listed(get_kernel("com.microsoft.QMoE").variants) == _listed(VARIANTS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(device, rng, case):
    kernel = get_kernel("com.microsoft.QMoE")
    call = case.materialize(rng)
    call = {k: v for k, v in call.items() if v is not None}
    if case.error is not None:
        with pytest.raises(ValueError, match=re.escape(case.error)):
            kernel(attrs=case.attrs, device_limits=case.device_limits, **call)
        return
    plan = kernel.plan(attrs=case.attrs, device_limits=case.device_limits, **call)
    _subgroup_rejection_ok(plan.rejected, device)
    want = oracle(call, case.attrs)
    expected = case.expected_arrays()
    if expected is not None:
        np.testing.assert_allclose(want, expected["outputT"], rtol=1e-6, atol=1e-6)
    ort_out = run_ort_qmoe(call, case.attrs) if ort_has_mode(call, case.attrs) else None
    if ort_out is not None:
        # The oracle's own agreement with ORT (pinned in tests/verify/oracles) holds here too.
        assert rel_err(ort_out, want, zero_scale=1.0) <= TOL
    errors = run_all_variants(
        kernel, call, case.attrs, want, case.name, case.device_limits, case.tunables, ort_out
    )
    if case.device_limits:
        assert plan.scope.lookup("hiddenChunkCount") > 1 or plan.scope.lookup("numTokens") == 0
    print(case.name, {k: f"{v:.1e}" for k, v in errors.items()})


# -- random cases -------------------------------------------------------------------------

#: (E, H, I, k, bits, block, activation, swiglu_fusion, fc1 bias, fc2 bias, swiglu_limit)
CONFIGS = [
    (4, 32, 16, 2, 4, None, "relu", 0, False, False, None),
    (4, 32, 16, 2, 8, 16, "relu", 0, True, True, None),
    (4, 32, 16, 1, 4, 16, "gelu", 0, False, True, None),
    (4, 32, 16, 4, 8, None, "silu", 0, True, False, None),
    (4, 32, 16, 3, 4, None, "identity", 0, False, False, None),
    (4, 32, 16, 2, 4, None, "swiglu", 1, False, False, None),
    (4, 32, 16, 2, 4, 16, "swiglu", 1, True, True, 7.0),
    (4, 32, 16, 2, 8, None, "swiglu", 1, False, True, 1.5),
    (4, 32, 16, 2, 8, 16, "swiglu", 2, True, False, None),
    (4, 32, 16, 4, 4, 16, "swiglu", 2, False, False, 7.0),
    (8, 64, 32, 2, 4, 32, "swiglu", 1, True, True, 7.0),
    (8, 64, 32, 8, 4, 32, "swiglu", 1, False, False, None),
    (8, 64, 32, 3, 8, 32, "relu", 0, False, True, None),
    (8, 64, 32, 1, 8, None, "gelu", 0, True, True, None),
    (3, 20, 14, 2, 4, None, "relu", 0, True, True, None),
    (3, 18, 10, 3, 8, None, "swiglu", 1, False, False, 2.0),
    (2, 16, 64, 2, 4, 16, "silu", 0, False, False, None),
    (2, 48, 32, 1, 8, 16, "swiglu", 2, False, True, None),
    # Rows of whole 16-byte pieces (the fused decode path): 4-bit with block 16 (two
    # scales a piece) and column-wise 4-bit.
    (4, 64, 32, 2, 4, 16, "swiglu", 1, True, True, 7.0),
    (4, 64, 32, 3, 4, None, "gelu", 0, True, True, None),
]
TOKENS = [1, 2, 3, 5, 9, 17, 33, 40, 64]


def random_call(rng: np.random.Generator, config: tuple, tokens: int, rank: int):
    e, h, inter, k, bits, block, act, fusion, b1, b2, limit = config
    rows = (2 if act == "swiglu" else 1) * inter
    lead = (tokens,) if rank == 2 else ((1, tokens) if tokens % 2 else (2, tokens // 2))
    x_scale = 3.0 if limit else 1.0
    fc1, s1 = quantize_symmetric(rng.standard_normal((e, rows, h)) / math.sqrt(h), bits, block, rng)
    fc2, s2 = quantize_symmetric(
        rng.standard_normal((e, h, inter)) / math.sqrt(inter), bits, block, rng
    )
    call = {
        "inputT": (x_scale * rng.standard_normal((*lead, h))).astype(np.float32),
        "routerT": rng.standard_normal((tokens, e)).astype(np.float32),
        "fc1T": fc1,
        "fc1ScalesT": s1,
        "fc2T": fc2,
        "fc2ScalesT": s2,
    }
    if b1:
        call["fc1BiasT"] = rng.standard_normal((e, rows)).astype(np.float32)
    if b2:
        call["fc2BiasT"] = rng.standard_normal((e, h)).astype(np.float32)
    if rng.random() < 0.3:  # QMoE input 14: router_probs selects, these weigh
        call["routerWeightsT"] = rng.uniform(0.0, 1.0, (tokens, e)).astype(np.float32)
    attrs = {
        "k": k,
        "activation_type": act,
        "expert_weight_bits": bits,
        "swiglu_fusion": fusion,
        "normalize_routing_weights": int(rng.integers(0, 2)),
    }
    if block:
        attrs["block_size"] = block
    elif rng.random() < 0.3:
        attrs["block_size"] = 0  # 0 means column-wise, as an absent block_size
    if act == "swiglu":
        attrs["activation_alpha"] = float(rng.choice([1.0, 1.702, rng.uniform(0.5, 2.0)]))
        attrs["activation_beta"] = float(rng.choice([0.0, 1.0, rng.uniform(-1.0, 1.0)]))
    if limit:
        attrs["swiglu_limit"] = limit
    return call, attrs


def test_random_cases(device, rng):
    """At least 200 (case, variant) runs over every option, each against oracle and ORT."""
    kernel = get_kernel("com.microsoft.QMoE")
    runs, ort_runs, per_variant, worst = 0, 0, Counter(), 0.0
    for i, config, tokens, rank in draw_configs(rng, CONFIGS, 120, TOKENS):
        call, attrs = random_call(rng, config, tokens, rank)
        want = oracle(call, attrs)
        ort_out = run_ort_qmoe(call, attrs) if ort_has_mode(call, attrs) else None
        what = f"random {i}: {config} T={tokens} rank={rank} attrs={attrs}"
        errors = run_all_variants(kernel, call, attrs, want, what, ort_out=ort_out)
        runs += len(errors)
        ort_runs += len(errors) if ort_out is not None else 0
        per_variant.update(errors.keys())
        worst = max(worst, *errors.values())
    print(f"{runs} kernel runs ({ort_runs} also vs ORT), worst rel err {worst:.2e}: {per_variant}")
    assert runs >= 200
    for vid in ("quant_grouped_routed", "quant_gemv_routed", "quant_split_routed"):
        assert per_variant[vid] >= 30, per_variant
    assert per_variant[FUSED] >= 20, per_variant
    assert per_variant[ROUTED] >= 20, per_variant


def test_random_chunked_cases(device, rng):
    """Lowered binding limits: several token chunks, every variant, rank 2 and 3."""
    kernel = get_kernel("com.microsoft.QMoE")
    configs = [
        (2, 16, 32, 2, 4, None, "swiglu", 1, True, True, 7.0),
        (2, 16, 32, 2, 8, 16, "relu", 0, False, True, None),
        (3, 16, 16, 3, 4, 16, "gelu", 0, True, False, None),
    ]
    runs = 0
    for i in range(12):
        config = configs[i % len(configs)]
        tokens = int(rng.choice([23, 40]))
        call, attrs = random_call(rng, config, tokens, int(rng.integers(2, 4)))
        limits = chunk_limits(rng, call, k=config[3], inter=config[2])
        plan = kernel.plan(attrs=attrs, device_limits=limits, **call)
        assert plan.scope.lookup("hiddenChunkCount") > 1, limits
        want = oracle(call, attrs)
        ort_out = run_ort_qmoe(call, attrs) if ort_has_mode(call, attrs) else None
        errors = run_all_variants(kernel, call, attrs, want, f"chunked {i}", limits, {}, ort_out)
        runs += len(errors)
    assert runs >= 24


# -- the subgroup variant -----------------------------------------------------------------


def test_grouped_sgmat_runs_only_with_32_wide_subgroups(device, rng):
    """Runnable on a 32-lane adapter (whether it wins is the measured priorities' business)."""
    kernel = get_kernel("com.microsoft.QMoE")
    call, attrs = random_call(rng, CONFIGS[6], 40, 2)
    plan = kernel.plan(attrs=attrs, **call)
    assert_valid_choice(plan)
    wave32 = (
        "subgroups" in device.features
        and device.adapter_info.get("subgroupMinSize") == 32
        and device.adapter_info.get("subgroupMaxSize") == 32
    )
    if wave32:
        assert SGMAT not in plan.rejected, plan.rejected.get(SGMAT)
        return
    assert plan.variant_id != SGMAT
    reason = plan.rejected[SGMAT]
    assert "sgmatSubgroupOk" in reason and "subgroupMinSize == 32" in reason, reason
    with pytest.raises(KernelCallError, match="sgmatSubgroupOk"):
        kernel(attrs=attrs, variant=SGMAT, **call)


def _facts(
    width: int, features=("subgroups",), storage=49152, adapter_type="DiscreteGPU"
) -> DeviceFacts:
    limits = dict(default_device().limits)
    limits["maxStorageBufferBindingSize"] = 2147483644
    limits["maxComputeWorkgroupStorageSize"] = storage
    info = {"subgroupMinSize": width, "subgroupMaxSize": width, "adapterType": adapter_type}
    return DeviceFacts(limits, frozenset(features), info)


def test_planner_on_described_adapters(device, rng):
    """Selection on an H200-like description (32 lanes) and others, no GPU needed.

    Whichever variant wins (the priorities follow measurements, docs/kernels-moe.md), it
    must be able to run the call and have the top priority; the variants that cannot run
    name the rule that failed.
    """
    manifest = load_manifest(FOLDER / "manifest.json")
    prefill, attrs = random_call(rng, CONFIGS[10], 40, 2)
    decode, _ = random_call(rng, CONFIGS[10], 1, 2)
    described = {
        "h200": _facts(32),
        "cpu": _facts(8, adapter_type="CPU"),  # lavapipe: 8 lanes
        "no_subgroups": _facts(32, features=()),
    }
    plans = {
        (name, which): make_plan(manifest, facts, call, attrs)
        for name, facts in described.items()
        for which, call in (("prefill", prefill), ("decode", decode))
    }
    for plan in plans.values():
        assert_valid_choice(plan)
    # A 32-lane GPU can run the subgroup variant for prefill and the fused path for decode.
    assert SGMAT in plans["h200", "prefill"].priorities
    assert FUSED in plans["h200", "decode"].priorities
    assert FUSED in plans["cpu", "decode"].priorities
    assert "requires device feature 'subgroups'" in plans["no_subgroups", "decode"].rejected[FUSED]
    for facts, reason in (
        (_facts(16), "sgmatSubgroupOk"),
        (_facts(32, features=()), "requires device feature 'subgroups'"),
        (_facts(32, storage=8192), "groupedSgmatSharedBytes"),
    ):
        plan = make_plan(manifest, facts, prefill, attrs)
        assert_valid_choice(plan)
        assert SGMAT not in plan.priorities
        assert reason in plan.rejected[SGMAT], plan.rejected[SGMAT]
    # Real decode sizes (H = I = 256 here): the fused decode path can run them with
    # subgroups, gemv without; 17 tokens are past the fused path.
    e, h, inter = 4, 256, 256
    big = {
        "inputT": np.zeros((1, h), np.float32),
        "routerT": np.zeros((1, e), np.float32),
        "fc1T": np.zeros((e, 2 * inter, h // 2), np.uint8),
        "fc1ScalesT": np.zeros((e, 2 * inter), np.float32),
        "fc2T": np.zeros((e, h, inter // 2), np.uint8),
        "fc2ScalesT": np.zeros((e, h), np.float32),
    }
    column_wise = {**attrs, "block_size": 0}
    plan = make_plan(manifest, _facts(32), big, column_wise)
    assert_valid_choice(plan)
    assert FUSED in plan.priorities
    plan = make_plan(manifest, _facts(32, features=()), big, column_wise)
    assert_valid_choice(plan)
    assert "quant_gemv_routed" in plan.priorities and FUSED in plan.rejected
    many = {
        **big,
        "inputT": np.zeros((17, h), np.float32),
        "routerT": np.zeros((17, e), np.float32),
    }
    plan = make_plan(manifest, _facts(32), many, column_wise)
    assert_valid_choice(plan)
    assert "decodeFusedTokensOk" in plan.rejected[FUSED], plan.rejected[FUSED]


def _kernel_at_width(width: int) -> Kernel:
    """The package with its subgroup variant retargeted to ``width``-lane subgroups."""
    data = json.loads((FOLDER / "manifest.json").read_text())
    data["derive"]["wave32Adapter"] = (
        f"device.adapterInfo.subgroupMinSize == {width} "
        f"and device.adapterInfo.subgroupMaxSize == {width}"
    )
    data["derive"]["sgmatLanes"] = str(width)
    return Kernel(parse_manifest(data, FOLDER / "manifest.json"), FOLDER)


def test_grouped_subgroup_kernel_at_the_measured_subgroup_width(device, rng):
    """The subgroup kernel's template is generic in its width: run it at this adapter's.

    On lavapipe (8 lanes) this checks every line of the grouped-sgmat templates; on a
    32-lane GPU it is the shipped configuration.
    """
    width = device.adapter_info.get("subgroupMinSize")
    if "subgroups" not in device.features or width != device.adapter_info.get("subgroupMaxSize"):
        pytest.skip("adapter without a fixed subgroup width")
    if width not in (8, 16, 32):
        pytest.skip(f"subgroup width {width}: the kernel's tile needs 8, 16 or 32 lanes")
    kernel = _kernel_at_width(width)
    runs = 0
    for i in range(24):
        config = CONFIGS[i % len(CONFIGS)]
        tokens = int(rng.choice([33, 40]))
        call, attrs = random_call(rng, config, tokens, int(rng.integers(2, 4)))
        plan = kernel.plan(attrs=attrs, **call)
        if SGMAT in plan.rejected:
            assert "groupedShapeOk" in plan.rejected[SGMAT], plan.rejected[SGMAT]
            continue
        assert SGMAT not in plan.rejected  # runnable at this width (retargeted manifest)
        out = kernel(attrs=attrs, variant=SGMAT, poison_outputs=True, **call)["outputT"]
        checked(out, oracle(call, attrs), f"sgmat@{width} {i}: {config} T={tokens}")
        runs += 1
    assert runs >= 12


# -- plans and errors ---------------------------------------------------------------------


def test_decode_and_prefill_choices_can_run_their_calls(device, rng):
    """Decode and prefill plans: valid choices; the rules that rule variants out hold."""
    kernel = get_kernel("com.microsoft.QMoE")
    call, attrs = random_call(rng, CONFIGS[10], 1, 2)
    plan = kernel.plan(attrs=attrs, tunables=SMALL_TUNABLES, **call)
    assert_valid_choice(plan)
    assert (FUSED in plan.priorities) == ("subgroups" in device.features), plan.explain()
    assert "groupedShapeOk" in plan.rejected["quant_grouped_routed"]
    call, attrs = random_call(rng, CONFIGS[10], 64, 2)
    plan = kernel.plan(attrs=attrs, tunables={**SMALL_TUNABLES, "decodeBlockTarget": 16}, **call)
    assert_valid_choice(plan)
    assert "quant_grouped_routed" in plan.priorities
    assert "decodeOccupancyOk" in plan.rejected["quant_gemv_routed"]
    assert "decodeFusedTokensOk" in plan.rejected[FUSED]


def test_chunk_size_follows_the_binding_limit(device, rng):
    kernel = get_kernel("com.microsoft.QMoE")
    config = (2, 16, 32, 2, 4, None, "relu", 0, False, False, None)
    call, attrs = random_call(rng, config, 40, 2)  # 256 bytes of hidden activations a token
    for limit, tokens_per_chunk in ((1 << 27, 40), (4096, 16), (2560, 10)):
        plan = kernel.plan(
            attrs=attrs, device_limits={"maxStorageBufferBindingSize": limit}, **call
        )
        assert plan.scope.lookup("hiddenChunkTokens") == tokens_per_chunk
        assert plan.scope.lookup("hiddenChunkCount") == -(-40 // tokens_per_chunk)


def test_binding_sets_name_only_declared_intermediates():
    manifest = load_manifest(FOLDER / "manifest.json")
    assert _listed([v.id for v in manifest.variants]) == _listed(VARIANTS)
    by_id = {v.id: v for v in manifest.variants}
    assert by_id[SGMAT].requires.features == ("subgroups",)
    assert by_id[FUSED].requires.features == ("subgroups",)
