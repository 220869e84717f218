"""The routed decode variants (issue 20): routing folded into FC1, two dispatches.

``quant_decode_routed`` / ``moe_decode_routed`` rank each token's router logits inside every
FC1 workgroup (moe-route-select) and split a workgroup's invocations into G selection
groups with butterfly subgroup reductions. The random and test.json runs of
test_kernel_qmoe.py / test_kernel_moe.py force them at their default tunables; here the
shapes those leave out: every group count G (1 to 8, dividing k or not), rows per
workgroup not dividing I, several trips over a row's pieces (small workgroups), more
experts than invocations (each ranks several), exact ties among the logits (the higher
expert index first, as ORT), codes dequantised in place (the default) and shifted down, 1
to 16 tokens, and the plan a described H200 gets. Each run
poisons the outputs, is compared with the numpy oracle and with ORT CPU where ORT has the
mode, fresh random inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import checked
from planning import assert_valid_choice
from test_kernel_moe import oracle as moe_oracle
from test_kernel_moe import ort_reference as run_ort_moe
from test_kernel_moe import random_call as moe_call
from test_kernel_qmoe import _facts, ort_has_mode, run_ort_qmoe
from test_kernel_qmoe import oracle as qmoe_oracle
from test_kernel_qmoe import random_call as qmoe_call

from onnx_moe_fuse.kernels.manifest import load_manifest
from onnx_moe_fuse.kernels.planner import make_plan
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders

#: (E, H, I, k, bits, block, activation, swiglu_fusion, fc1 bias, fc2 bias, swiglu_limit)
QMOE = [
    (32, 64, 32, 4, 4, 32, "swiglu", 1, True, True, 7.0),  # E > invocations
    (8, 128, 32, 3, 4, None, "swiglu", 1, False, False, None),  # 4 pieces a row
    (8, 64, 48, 8, 8, 16, "gelu", 0, True, False, None),
]
#: (E, H, I, k, activation, swiglu_fusion, FC3, fc1 bias, fc2 bias, fc3 bias, swiglu_limit)
MOE = [
    (32, 32, 16, 4, "swiglu", 0, True, True, True, True, None),
    (8, 64, 24, 3, "silu", 0, True, False, True, False, None),
    (8, 32, 16, 2, "swiglu", 1, False, True, False, False, 7.0),
]


def for_lanes(configs: list[tuple], lanes: int) -> list[tuple]:
    """The configs at this adapter's subgroup width (``lanes``; the H200: 32).

    Sized at lavapipe's 8 lanes: the first's experts (more than a workgroup's invocations)
    and the second's hidden size (several trips over a row's pieces) scale with the lanes,
    as the routed workgroups do.
    """
    scale = max(1, lanes // 8)
    (e, *first), (e2, h2, *second), *rest = configs
    return [(e * scale, *first), (e2, h2 * scale, *second), *rest]


#: tunables: group counts, rows, and workgroups small enough for several trips a row
SETTINGS = [
    {},
    {"decodeRoutedGroups": 1, "decodeRoutedRows": 3},
    # workgroups of 2 and 1 subgroups (in lanes, resolved per adapter by ``for_adapter``):
    # several trips over a row's pieces (16 and 8 invocations on lavapipe, 64 and 32 on the H200)
    {"decodeRoutedGroups": 2, "decodeRoutedRows": 1, "decodeRoutedWorkgroup": ("lanes", 2)},
    {"decodeRoutedGroups": 8, "decodeRoutedRows": 5},
    {"decodeRoutedGroups": 4, "decodeRoutedRows": 2, "decodeRoutedWorkgroup": ("lanes", 1)},
    {"decodeInPlaceCodes": 0},  # codes shifted down, as decode_fused
]
OPS = {
    "QMoE": ("quant_decode_routed", QMOE, qmoe_call, qmoe_oracle, run_ort_qmoe),
    "MoE": ("moe_decode_routed", MOE, moe_call, moe_oracle, run_ort_moe),
}


def for_adapter(tunables: dict, lanes: int) -> dict:
    """``("lanes", n)`` -> n subgroups' invocations on this adapter (its measured width)."""
    return {
        name: value[1] * lanes if isinstance(value, tuple) else value
        for name, value in tunables.items()
    }


def with_ties(rng: np.random.Generator, call: dict) -> dict:
    """Router logits on a coarse grid, so that exact ties occur among the top k."""
    logits = np.round(rng.standard_normal(call["routerT"].shape) * 2.0) / 2.0
    return {**call, "routerT": logits.astype(np.float32)}


@pytest.mark.parametrize("op", sorted(OPS))
def test_routed_decode_shapes(device, rng, op):
    vid, configs, make_call, oracle, run_ort = OPS[op]
    kernel = get_kernel(f"com.microsoft.{op}")
    runs, trips, several_experts = 0, set(), 0
    lanes = int(device.adapter_info.get("subgroupMaxSize", 32))
    for config in for_lanes(configs, lanes):
        for n, setting in enumerate(SETTINGS):
            tunables = for_adapter(setting, lanes)
            tokens = int(rng.choice([1, 2, 5, 16]))
            call, attrs = make_call(rng, config, tokens, 2)
            if n % 2:
                call = with_ties(rng, call)
            plan = kernel.plan(attrs=attrs, tunables=tunables, **call)
            if vid in plan.rejected:
                reason = plan.rejected[vid]
                # only G above the adapter's subgroup width may refuse (lavapipe: 8 lanes)
                assert "decodeRoutedGroupsOk" in reason, (config, tunables, reason)
                continue
            forced = kernel.plan(attrs=attrs, tunables=tunables, variant=vid, **call)
            trips.add(forced.scope.lookup("decodeRoutedTrips"))
            wg = forced.scope.lookup("decodeRoutedWorkgroupSize")
            several_experts += config[0] > wg
            out = kernel(attrs=attrs, tunables=tunables, variant=vid, poison_outputs=True, **call)
            what = f"{op} {config} T={tokens} {tunables} attrs={attrs}"
            checked(out["outputT"], oracle(call, attrs), f"{what} vs oracle")
            if op == "MoE" or ort_has_mode(call, attrs):
                checked(out["outputT"], run_ort(call, attrs), f"{what} vs ORT")
            runs += 1
    print(f"{op}: {runs} runs, trips {sorted(trips)}, {several_experts} with E > invocations")
    assert runs >= 12, runs
    assert max(trips) > 1, trips  # several trips over a row's pieces ran
    assert several_experts, "no run with more experts than invocations"


@pytest.mark.parametrize("op", sorted(OPS))
def test_routed_decode_plans_on_a_described_h200(rng, op):
    """At full Qwen3 sizes on an H200 description: the routed variant can run, two dispatches.

    Which decode variant wins is the measured priorities' business (docs/kernels-moe.md:
    routed wins where the H200 measured it faster); the choice must be valid either way.
    """
    vid, _, _, _, _ = OPS[op]
    folder = next(f for f in package_folders() if f.name == op.lower())
    manifest = load_manifest(folder / "manifest.json")
    e, h, inter, k = 128, 2048, 768, 8
    call = {
        "inputT": np.zeros((1, h), np.float32),
        "routerT": np.zeros((1, e), np.float32),
    }
    if op == "QMoE":
        attrs = {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1, "block_size": 32}
        attrs["expert_weight_bits"] = 4
        call |= {
            "fc1T": np.zeros((e, 2 * inter, h // 2), np.uint8),
            "fc1ScalesT": np.zeros((e, 2 * inter, h // 32), np.float32),
            "fc2T": np.zeros((e, h, inter // 2), np.uint8),
            "fc2ScalesT": np.zeros((e, h, inter // 32), np.float32),
        }
    else:
        attrs = {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1}
        attrs["normalize_routing_weights"] = 1
        call |= {
            "fc1T": np.zeros((e, 2 * inter, h), np.float32),
            "fc2T": np.zeros((e, h, inter), np.float32),
        }
    plan = make_plan(manifest, _facts(32), call, attrs)
    assert vid in plan.priorities, plan.rejected.get(vid)
    assert_valid_choice(plan)
    forced = make_plan(manifest, _facts(32), call, attrs, variant=vid)
    scope = forced.scope
    # Qwen3 QMoE: 64 pieces a row, 4 groups of 2 selections: 256 invocations, one trip
    if op == "QMoE":
        assert scope.lookup("decodeRoutedWorkgroupSize") == 256
        assert scope.lookup("decodeRoutedTrips") == 1
    assert len(forced.variant.passes) == 2
