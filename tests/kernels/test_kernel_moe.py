"""MoE (float32) kernel package: test.json and random cases, every variant, vs oracle and ORT.

Each variant is forced wherever its ``when`` holds and compared with the numpy oracle and
ONNX Runtime's CPU ``com.microsoft.MoE``.

ORT 1.32's CPU MoE runs relu, gelu, silu and identity without FC3 and swiglu with interleaved
FC1 (swiglu_fusion 1) only. The other modes are checked against the oracle and, by
equivalence, against ORT on the same weights rearranged into the interleaved form:
swiglu_fusion 0 (FC1 gate + FC3 linear) and 2 (concatenated) become interleaved FC1 rows,
and silu times FC3 is swiglu with alpha 1, beta 0 and no limit.

Error measure: ``max|kernel - reference| / max|reference|``, at most 1e-4. Outputs are
poisoned before every run; inputs are fresh per run (the ``rng`` fixture prints the seed);
shapes come from a small pool so that few pipelines are compiled.
"""

from __future__ import annotations

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
from planning import assert_valid_choice, runnable

from onnx_moe_fuse.kernels.cases import load_cases
from onnx_moe_fuse.kernels.planner import KernelCallError
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders
from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES

ort = pytest.importorskip("onnxruntime")

FOLDER = next(f for f in package_folders() if f.name == "moe")
CASES = load_cases(FOLDER / "test.json")
VARIANTS = [
    "moe_decode_fused",
    "moe_decode_routed",
    "moe_zero_inter",
    "moe_grouped",
    "moe_gemv",
    "moe_stage",
    "moe_grouped_tiled8",
    "moe_grouped_tiled16",
]
FUSED = "moe_decode_fused"
ROUTED = "moe_decode_routed"


# -- references ---------------------------------------------------------------------------


def oracle(call: dict, attrs: dict) -> np.ndarray:
    """The numpy oracle; inter_size 0 (which the oracle and ORT refuse) by definition."""
    return KERNEL_ORACLES["MoE"](call, attrs)["outputT"]


def interleaved_form(call: dict, attrs: dict) -> tuple[dict, dict]:
    """The same layer in a form ORT CPU runs: FC3 / concatenated SwiGLU -> interleaved FC1."""
    act, fusion = attrs["activation_type"], attrs.get("swiglu_fusion", 0)
    has_fc3 = call.get("fc3T") is not None
    if not (act == "swiglu" and fusion in (0, 2)) and not (act == "silu" and has_fc3):
        return call, attrs
    e, rows, _ = call["fc1T"].shape
    inter = call["fc2T"].shape[2]
    if fusion == 2:
        gate_w, lin_w = call["fc1T"][:, :inter], call["fc1T"][:, inter:]
        b1 = call.get("fc1BiasT")
        gate_b = None if b1 is None else b1[:, :inter]
        lin_b = None if b1 is None else b1[:, inter:]
    else:
        gate_w, lin_w = call["fc1T"], call["fc3T"]
        gate_b, lin_b = call.get("fc1BiasT"), call.get("fc3BiasT")
    fc1 = np.empty((e, 2 * inter, gate_w.shape[2]), np.float32)
    fc1[:, 0::2], fc1[:, 1::2] = gate_w, lin_w
    new = {k: v for k, v in call.items() if k not in ("fc1T", "fc1BiasT", "fc3T", "fc3BiasT")}
    new["fc1T"] = fc1
    if gate_b is not None or lin_b is not None:
        bias = np.zeros((e, 2 * inter), np.float32)
        if gate_b is not None:
            bias[:, 0::2] = gate_b
        if lin_b is not None:
            bias[:, 1::2] = lin_b
        new["fc1BiasT"] = bias
    new_attrs = {**attrs, "activation_type": "swiglu", "swiglu_fusion": 1}
    if act == "silu":  # silu(g) * l == swiglu with alpha 1, beta 0, no clamp
        new_attrs.update(activation_alpha=1.0, activation_beta=0.0)
        new_attrs.pop("swiglu_limit", None)
    return new, new_attrs


def ort_reference(call: dict, attrs: dict) -> np.ndarray | None:
    """ORT CPU's MoE on the call (or its interleaved form); None where ORT cannot say."""
    if call["fc2T"].shape[2] == 0 or call["routerT"].shape[0] == 0:
        return None
    call, attrs = interleaved_form(call, attrs)
    return run_kernel_node("MoE", call, attrs)


# -- test.json ----------------------------------------------------------------------------


def _listed(ids: list[str]) -> list[str]:
    """The variants this file knows, in manifest order.

    The tiled prefill variants are tests/kernels/test_kernel_prefill.py's to list.
    """
    return [v for v in ids if not v.startswith("moe_grouped_tiled")]


def test_kernel_lists_its_variants(device):
    assert _listed(get_kernel("com.microsoft.MoE").variants) == _listed(VARIANTS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(device, rng, case):
    kernel = get_kernel("com.microsoft.MoE")
    call = {k: v for k, v in case.materialize(rng).items() if v is not None}
    if case.error is not None:
        with pytest.raises(ValueError, match=re.escape(case.error)):
            kernel(attrs=case.attrs, device_limits=case.device_limits, **call)
        return
    want = oracle(call, case.attrs)
    expected = case.expected_arrays()
    if expected is not None:
        np.testing.assert_allclose(want, expected["outputT"], rtol=1e-6, atol=1e-6)
    ort_out = ort_reference(call, case.attrs)
    if ort_out is not None:
        # The equivalence of the rearranged form.
        assert rel_err(ort_out, want, zero_scale=1.0) <= TOL
    errors = run_all_variants(
        kernel, call, case.attrs, want, case.name, case.device_limits, case.tunables, ort_out
    )
    if case.device_limits:
        plan = kernel.plan(attrs=case.attrs, device_limits=case.device_limits, **call)
        assert plan.scope.lookup("hiddenChunkCount") > 1
    print(case.name, {k: f"{v:.1e}" for k, v in errors.items()})


# -- random cases -------------------------------------------------------------------------

#: (E, H, I, k, activation, swiglu_fusion, FC3, fc1 bias, fc2 bias, fc3 bias, swiglu_limit)
CONFIGS = [
    (4, 32, 16, 2, "relu", 0, False, False, False, False, None),
    (4, 32, 16, 1, "relu", 0, False, True, True, False, None),
    (4, 32, 16, 2, "gelu", 0, False, True, False, False, None),
    (4, 32, 16, 4, "silu", 0, False, False, True, False, None),
    (4, 32, 16, 2, "silu", 0, True, True, False, True, None),
    (4, 32, 16, 3, "identity", 0, False, False, False, False, None),
    (4, 32, 16, 2, "swiglu", 0, True, False, True, True, 7.0),
    (4, 32, 16, 2, "swiglu", 1, False, True, True, False, 7.0),
    (4, 32, 16, 2, "swiglu", 1, False, False, False, False, None),
    (4, 32, 16, 2, "swiglu", 2, False, True, False, False, 1.5),
    (8, 64, 32, 2, "swiglu", 1, False, True, True, False, 7.0),
    (8, 64, 32, 8, "gelu", 0, False, False, False, False, None),
    (8, 64, 32, 3, "swiglu", 0, True, True, True, True, None),
    (3, 18, 10, 2, "silu", 0, True, False, False, False, None),
    (3, 18, 10, 3, "swiglu", 2, False, False, True, False, 2.0),
    (2, 16, 64, 1, "relu", 0, False, True, True, False, None),
]
TOKENS = [1, 2, 3, 5, 9, 17, 33, 40, 64]


def random_call(rng: np.random.Generator, config: tuple, tokens: int, rank: int):
    e, h, inter, k, act, fusion, fc3, b1, b2, b3, limit = config
    rows = (2 if act == "swiglu" and fusion in (1, 2) else 1) * inter
    lead = (tokens,) if rank == 2 else ((1, tokens) if tokens % 2 else (2, tokens // 2))
    x_scale = 3.0 if limit else 1.0

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    call = {
        "inputT": normal(*lead, h, scale=x_scale),
        "routerT": normal(tokens, e),
        "fc1T": normal(e, rows, h, scale=1 / math.sqrt(h)),
        "fc2T": normal(e, h, inter, scale=1 / math.sqrt(inter)),
    }
    if fc3:
        call["fc3T"] = normal(e, inter, h, scale=1 / math.sqrt(h))
    if b1:
        call["fc1BiasT"] = normal(e, rows)
    if b2:
        call["fc2BiasT"] = normal(e, h)
    if b3:
        call["fc3BiasT"] = normal(e, inter)
    attrs = {
        "k": k,
        "activation_type": act,
        "swiglu_fusion": fusion,
        "normalize_routing_weights": int(rng.integers(0, 2)),
    }
    if act == "swiglu":
        attrs["activation_alpha"] = float(rng.choice([1.0, 1.702, rng.uniform(0.5, 2.0)]))
        attrs["activation_beta"] = float(rng.choice([0.0, 1.0, rng.uniform(-1.0, 1.0)]))
    if limit:
        attrs["swiglu_limit"] = limit
    return call, attrs


def test_random_cases(device, rng):
    """At least 200 (case, variant) runs over every option, each against oracle and ORT."""
    kernel = get_kernel("com.microsoft.MoE")
    runs, per_variant, worst, modes = 0, Counter(), 0.0, Counter()
    for i, config, tokens, rank in draw_configs(rng, CONFIGS, 110, TOKENS):
        call, attrs = random_call(rng, config, tokens, rank)
        want = oracle(call, attrs)
        ort_out = ort_reference(call, attrs)
        assert ort_out is not None
        assert rel_err(ort_out, want, zero_scale=1.0) <= TOL, f"ORT vs oracle, {config}"
        what = f"random {i}: {config} T={tokens} rank={rank} attrs={attrs}"
        errors = run_all_variants(kernel, call, attrs, want, what, ort_out=ort_out)
        runs += len(errors)
        per_variant.update(errors.keys())
        modes[(attrs["activation_type"], attrs["swiglu_fusion"], "fc3T" in call)] += len(errors)
        worst = max(worst, *errors.values())
    print(f"{runs} kernel runs, each vs oracle and ORT; worst rel err {worst:.2e}")
    print(dict(per_variant), dict(modes))
    assert runs >= 200
    for vid in ("moe_grouped", "moe_gemv", "moe_stage"):
        assert per_variant[vid] >= 25, per_variant
    assert per_variant[FUSED] >= 20, per_variant
    assert per_variant[ROUTED] >= 20, per_variant


def test_random_chunked_cases(device, rng):
    """Lowered binding limits: several token chunks, every variant, rank 2 and 3."""
    kernel = get_kernel("com.microsoft.MoE")
    configs = [
        (2, 8, 16, 2, "swiglu", 0, True, True, True, True, 7.0),
        (2, 8, 16, 2, "swiglu", 2, False, True, True, False, None),
        (3, 8, 16, 3, "gelu", 0, False, False, True, False, None),
    ]
    runs = 0
    for i in range(9):
        config = configs[i % len(configs)]
        tokens = int(rng.choice([23, 40]))
        call, attrs = random_call(rng, config, tokens, int(rng.integers(2, 4)))
        limits = chunk_limits(rng, call, k=config[3], inter=config[2])
        plan = kernel.plan(attrs=attrs, device_limits=limits, **call)
        assert plan.scope.lookup("hiddenChunkCount") > 1, limits
        errors = run_all_variants(
            kernel,
            call,
            attrs,
            oracle(call, attrs),
            f"chunked {i}",
            limits,
            {},
            ort_reference(call, attrs),
        )
        runs += len(errors)
    assert runs >= 18


def test_the_modes_ort_lacks_match_their_interleaved_form(device, rng):
    """FC3 SwiGLU, concatenated SwiGLU and SiLU x FC3 equal ORT on interleaved weights."""
    kernel = get_kernel("com.microsoft.MoE")
    for config in (CONFIGS[4], CONFIGS[6], CONFIGS[9], CONFIGS[12]):
        call, attrs = random_call(rng, config, 9, 2)
        new_call, new_attrs = interleaved_form(call, attrs)
        assert new_attrs["swiglu_fusion"] == 1 and "fc3T" not in new_call
        kernel_out = kernel(attrs=attrs, poison_outputs=True, **call)["outputT"]
        interleaved_out = kernel(attrs=new_attrs, poison_outputs=True, **new_call)["outputT"]
        assert rel_err(kernel_out, interleaved_out, zero_scale=1.0) <= TOL
        checked(kernel_out, ort_reference(call, attrs), f"{config} vs ORT (interleaved form)")


def test_decode_and_prefill_choices_can_run_their_calls(device, rng):
    """Decode and prefill plans: valid choices; the rules that rule variants out hold."""
    kernel = get_kernel("com.microsoft.MoE")
    call, attrs = random_call(rng, CONFIGS[10], 1, 2)
    plan = kernel.plan(attrs=attrs, tunables=SMALL_TUNABLES, **call)
    assert_valid_choice(plan)
    assert (FUSED in plan.priorities) == ("subgroups" in device.features), plan.explain()
    assert {"moe_gemv", "moe_stage"} <= set(plan.priorities), plan.explain()
    call, attrs = random_call(rng, CONFIGS[10], 64, 2)
    plan = kernel.plan(attrs=attrs, tunables={**SMALL_TUNABLES, "decodeBlockTarget": 16}, **call)
    assert_valid_choice(plan)
    assert "moe_grouped" in plan.priorities
    assert "decodeOccupancyOk" in plan.rejected["moe_gemv"]
    assert "decodeFusedTokensOk" in plan.rejected[FUSED]


def test_zero_inter_is_chosen_only_without_fc2_bias(device, rng):
    kernel = get_kernel("com.microsoft.MoE")
    call = {
        "inputT": rng.standard_normal((3, 8)).astype(np.float32),
        "routerT": rng.standard_normal((3, 4)).astype(np.float32),
        "fc1T": np.zeros((4, 0, 8), np.float32),
        "fc2T": np.zeros((4, 8, 0), np.float32),
    }
    plan = kernel.plan(attrs={"k": 2}, **call)
    assert assert_valid_choice(plan) == "moe_zero_inter"
    assert runnable(kernel, plan) == ["moe_zero_inter"]  # the only one that can run it
    call["fc2BiasT"] = rng.standard_normal((4, 8)).astype(np.float32)
    plan = kernel.plan(attrs={"k": 2}, **call)
    assert assert_valid_choice(plan) == "moe_stage"
    assert runnable(kernel, plan) == ["moe_stage"]
    assert "not present.fc2_experts_bias" in plan.rejected["moe_zero_inter"]
    with pytest.raises(KernelCallError, match="interSize > 0"):
        kernel(attrs={"k": 2}, variant="moe_gemv", **call)
