"""The planner's choices on the benchmark shapes: valid everywhere, near the fastest on a GPU.

For every bench.json case of every package (Qwen3-30B-A3B and gpt-oss-20b layers at 1, 16,
128 and 512 tokens, the reduced-expert copies, the GroupedMatMul and MatMulNBitsQkv shapes)
the plan's variant must be able to run the call and win by priority
(:func:`planning.assert_valid_choice`); cases larger than one storage binding of this
adapter (the full layers on lavapipe's 128 MiB) are planned on a GPU only.

On a real GPU the full-size model layers are also timed: every variant that can run the
call, forced, on the same random inputs, GPU timestamps, and the planner's choice must be
within 10% of the fastest (:func:`planning.measure_choice`). The reduced-expert copies
exist to fit lavapipe and the test-sized calls of the other files measure dispatch overhead
on a GPU, so those are checked for validity only. On CPU adapters (lavapipe) speed is not
checked at all: they are for correctness. With ``ONNX_MOE_FUSE_SPEED_LOG=PATH`` every timed
case is appended to PATH as a JSON line (op, case, choice, median seconds per variant).
"""

from __future__ import annotations

import json
import os

import pytest
from planning import (
    CaseInputs,
    assert_valid_choice,
    binding_overflow,
    measure_choice,
    zeros_call,
)

from onnx_moe_fuse.kernels.cases import load_cases
from onnx_moe_fuse.kernels.planner import DeviceFacts, make_plan
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders

PACKAGES = {
    "qmoe": "com.microsoft.QMoE",
    "moe": "com.microsoft.MoE",
    "grouped_matmul": "GroupedMatMul",
    "matmul_nbits_qkv": "com.microsoft.MatMulNBitsQkv",
}
#: Inputs shared by the cases of one layer (drawn once per layer on the GPU).
WEIGHTS = {
    "qmoe": ("fc1T", "fc1ScalesT", "fc2T", "fc2ScalesT"),
    "moe": ("fc1T", "fc2T", "fc3T"),
}


def _bench_cases():
    out = []
    for folder in package_folders():
        if folder.name in PACKAGES and (folder / "bench.json").exists():
            out += [(folder.name, case) for case in load_cases(folder / "bench.json")]
    return out


BENCH_CASES = _bench_cases()


def _layer(name: str) -> str:
    """``prefill128_qwen3_30b_a3b`` -> ``qwen3_30b_a3b``."""
    return name.split("_", 1)[1]


def _full_size(name: str) -> bool:
    return not name.endswith("experts")


#: The full-size model layers of the MoE packages, one test per layer (its token counts).
GPU_LAYERS = sorted(
    {(op, _layer(c.name)) for op, c in BENCH_CASES if op in WEIGHTS and _full_size(c.name)}
)


def test_every_package_has_bench_cases():
    assert {op for op, _ in BENCH_CASES} >= {"qmoe", "moe"}
    assert len(GPU_LAYERS) >= 4, GPU_LAYERS


@pytest.mark.parametrize(
    ("op", "case"), BENCH_CASES, ids=[f"{op}-{c.name}" for op, c in BENCH_CASES]
)
def test_choice_is_valid_on_bench_shapes(device, op, case):
    """The chosen variant's conditions and requirements hold, and it has the top priority."""
    too_big = binding_overflow(case, device.limits)
    if too_big:
        if device.kind == "gpu":
            pytest.fail(f"{case.name}: {too_big} bytes exceed one storage binding on a GPU")
        pytest.skip(f"{case.name}: inputs {too_big} exceed this adapter's storage binding")
    kernel = get_kernel(PACKAGES[op])
    plan = kernel.plan(attrs=case.attrs, tunables=case.tunables, **zeros_call(case))
    chosen = assert_valid_choice(plan)
    print(f"{op}/{case.name}: {chosen} of {sorted(plan.priorities.items(), key=lambda x: -x[1])}")


def _described_h200(device) -> DeviceFacts:
    """The H200 as wgpu-py 0.32 reports it through Vulkan (docs/kernels-moe.md), on this device."""
    limits = dict(device.limits)
    limits.update(
        maxStorageBufferBindingSize=2147483644,
        maxBufferSize=4292870144,
        maxComputeWorkgroupStorageSize=49152,
        maxComputeInvocationsPerWorkgroup=1024,
        maxComputeWorkgroupSizeX=1024,
        maxComputeWorkgroupsPerDimension=65535,
    )
    features = frozenset(
        {"subgroups", "subgroup-barrier", "shader-f16", "shader-f64", "shader-int64",
         "timestamp-query", "timestamp-query-inside-passes"}
    )  # fmt: skip
    info = {"subgroupMinSize": 32, "subgroupMaxSize": 32, "adapterType": "DiscreteGPU"}
    return DeviceFacts(limits, features, info)


@pytest.mark.parametrize(
    ("op", "case"), BENCH_CASES, ids=[f"{op}-{c.name}" for op, c in BENCH_CASES]
)
def test_choice_is_valid_on_a_described_h200(device, op, case):
    """The full-size layers planned for an H200 description, on any adapter (no GPU needed)."""
    kernel = get_kernel(PACKAGES[op])
    facts = _described_h200(device)
    plan = make_plan(kernel.manifest, facts, zeros_call(case), case.attrs, case.tunables)
    chosen = assert_valid_choice(plan)
    print(f"{op}/{case.name} on a described H200: {chosen}")


@pytest.mark.parametrize(("op", "layer"), GPU_LAYERS, ids=[f"{o}-{ly}" for o, ly in GPU_LAYERS])
def test_choice_is_near_the_fastest_on_a_gpu(device, rng, op, layer):
    """On a GPU: the planner's choice within 10% of the fastest variant, per token count."""
    if device.kind != "gpu":
        pytest.skip(f"speed is checked on GPUs only ({device.description}: validity only)")
    kernel = get_kernel(PACKAGES[op])
    inputs = CaseInputs(rng, WEIGHTS[op])
    cases = [c for o, c in BENCH_CASES if o == op and _layer(c.name) == layer]
    assert cases
    log = os.environ.get("ONNX_MOE_FUSE_SPEED_LOG")
    slow = []
    for case in cases:  # every token count, then the verdict
        call = inputs.call(case)
        what = f"{op}/{case.name}"
        chosen, times, why = measure_choice(kernel, call, case.attrs, what, case.tunables)
        if log:
            line = {"op": op, "case": case.name, "chosen": chosen, "seconds": times, "slow": why}
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        if why:
            slow.append(why)
    assert not slow, "\n".join(slow)
