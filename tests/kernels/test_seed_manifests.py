"""The two seed manifests (QMoE, MatMulNBitsQkv) load, evaluate and select variants.

The seeds live in the shared folder beside the checkout (``../shared/seeds``, or
``ONNX_MOE_FUSE_SEEDS``). Every derive rule, constant and ``when`` condition is
evaluated for a set of shapes and attributes on two device descriptions (lavapipe's
and an H200's), and the planner must choose the variant the contract implies. No GPU is
needed: the planner works on shapes, dtypes and device facts only.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from onnx_moe_fuse.kernels.expressions import ExpressionError
from onnx_moe_fuse.kernels.manifest import iter_passes, load_manifest
from onnx_moe_fuse.kernels.planner import DeviceFacts, make_plan

ON_CI = os.environ.get("CI", "").lower() == "true"


def _seeds_folder() -> Path:
    """``ONNX_MOE_FUSE_SEEDS``, else the first ``shared/seeds`` beside the checkout or above it."""
    if os.environ.get("ONNX_MOE_FUSE_SEEDS"):
        return Path(os.environ["ONNX_MOE_FUSE_SEEDS"])
    repo = Path(__file__).resolve().parents[2]
    for folder in repo.parents:
        if (folder / "shared" / "seeds").is_dir():
            return folder / "shared" / "seeds"
    return repo.parent / "shared" / "seeds"


SEEDS = _seeds_folder()


def _seed(name: str):
    path = SEEDS / name
    if not path.is_file():
        if ON_CI:
            pytest.fail(f"seed manifest {path} is missing on CI")
        pytest.skip(f"seed manifests not found at {SEEDS} (set ONNX_MOE_FUSE_SEEDS)")
    return load_manifest(path)


_COMMON_LIMITS = {
    "maxComputeInvocationsPerWorkgroup": 1024,
    "maxComputeWorkgroupSizeX": 1024,
    "maxComputeWorkgroupSizeY": 1024,
    "maxComputeWorkgroupSizeZ": 64,
    "maxComputeWorkgroupsPerDimension": 65535,
}
LAVAPIPE = DeviceFacts(
    {
        **_COMMON_LIMITS,
        "maxStorageBufferBindingSize": 134217728,
        "maxBufferSize": 2147483647,
        "maxComputeWorkgroupStorageSize": 32768,
    },
    frozenset({"subgroups", "subgroup-barrier", "shader-f16"}),
    {"subgroupMinSize": 8, "subgroupMaxSize": 8},
)
H200 = DeviceFacts(
    {
        **_COMMON_LIMITS,
        "maxStorageBufferBindingSize": 2147483644,
        "maxBufferSize": 4292870144,
        "maxComputeWorkgroupStorageSize": 49152,
    },
    frozenset({"subgroups", "subgroup-barrier", "shader-f16"}),
    {"subgroupMinSize": 32, "subgroupMaxSize": 32},
)
NO_F16_GL = DeviceFacts(
    {**LAVAPIPE.limits, "maxComputeWorkgroupStorageSize": 16384}, frozenset(), {}
)


def _evaluate_everything(manifest, plan):
    """Evaluate every derive, constant, condition and pass expression of the plan's variant."""
    scope = plan.scope
    for name in manifest.derive:
        scope.lookup(name)
    for variant in manifest.variants:
        for condition in (*manifest.when, *variant.when):
            assert isinstance(scope.evaluate(condition), bool | int)
    variant = plan.variant
    constants = {**(manifest.constants or {}), **variant.constants}
    values = {name: scope.evaluate(expr) for name, expr in constants.items()}
    from onnx_moe_fuse.kernels.expressions import Record

    vscope = scope.child(
        values={
            "constants": Record("constants", values),
            "repeat": Record("repeat", {"chunk": 0, "index": 0}),
        }
    )
    for p in iter_passes(variant.passes):
        pscope = vscope.child(derived=p.derive)
        for name in p.derive:
            pscope.lookup(name)
        for expr in p.shader_inputs.values():
            pscope.evaluate(expr)
        d = p.dispatch
        for expr in (d.threads, d.workgroup_size, d.x, d.y, d.z):
            if expr is not None:
                pscope.evaluate(expr)
        for b in p.bindings:
            for f in b.fields:
                pscope.evaluate(f.value)
            if b.length is not None:
                pscope.evaluate(b.length)
            if b.element_type.startswith("$"):
                pscope.evaluate(b.element_type[1:])
    for inter in variant.intermediates:
        assert all(
            d >= 0
            for d in scope.child(values={"constants": Record("c", values)}).evaluate(inter.shape)
        )


def _qmoe_call(tokens, hidden, inter, experts, k, bits, block, activation, rank3=False):
    pack = 2 if bits == 4 else 1
    fusion = 2 if activation == "swiglu" else 1
    shape = (2, tokens // 2, hidden) if rank3 else (tokens, hidden)
    fc1_scales = (experts, fusion * inter) + ((hidden // block,) if block else ())
    fc2_scales = (experts, hidden) + ((inter // block,) if block else ())
    attrs = {
        "k": k,
        "expert_weight_bits": bits,
        "activation_type": activation,
        "swiglu_fusion": 1 if activation == "swiglu" else 0,
        "normalize_routing_weights": 1,
    }
    if block:
        attrs["block_size"] = block
    if activation == "swiglu":
        attrs.update(swiglu_limit=7.0, activation_alpha=1.702, activation_beta=1.0)
    tensors = {
        "inputT": np.empty(shape, np.float32),
        "routerT": np.empty((tokens, experts), np.float32),
        "fc1T": np.empty((experts, fusion * inter, hidden // pack), np.uint8),
        "fc1ScalesT": np.empty(fc1_scales, np.float32),
        "fc2T": np.empty((experts, hidden, inter // pack), np.uint8),
        "fc2ScalesT": np.empty(fc2_scales, np.float32),
    }
    return tensors, attrs


QMOE_CASES = [
    # (tokens, hidden, inter, experts, k, bits, block, activation, rank3, device, expected)
    (1, 128, 128, 8, 2, 4, 32, "swiglu", False, LAVAPIPE, "quant_gemv_routed"),
    (512, 128, 128, 8, 2, 4, 32, "swiglu", False, LAVAPIPE, "quant_grouped_routed"),
    (64, 64, 32, 4, 4, 8, None, "relu", True, LAVAPIPE, "quant_grouped_routed"),
    (3, 64, 0, 4, 1, 4, None, "relu", False, LAVAPIPE, "quant_zero_inter"),
    (1, 2048, 768, 128, 8, 4, 32, "swiglu", False, H200, "quant_gemv_routed"),
    (512, 2048, 768, 128, 8, 4, 32, "swiglu", False, H200, "quant_grouped_routed"),
    (2, 16, 16, 2, 2, 8, 16, "relu", False, NO_F16_GL, "quant_split_routed"),
]


@pytest.mark.parametrize("case", QMOE_CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}")
def test_qmoe_seed_evaluates_and_selects(case):
    manifest = _seed("qmoe.manifest.json")
    *call, device, expected = case
    tensors, attrs = _qmoe_call(*call)
    plan = make_plan(manifest, device, tensors, attrs)
    _evaluate_everything(manifest, plan)
    assert plan.variant_id == expected, plan.explain()
    # The subgroup-matrix variant needs a feature wgpu cannot report: always explained.
    assert "quant_grouped_sgmat_routed" in plan.rejected


def test_qmoe_seed_chunks_tokens_under_small_limits():
    manifest = _seed("qmoe.manifest.json")
    tensors, attrs = _qmoe_call(40, 64, 64, 4, 2, 4, 32, "swiglu")
    small = DeviceFacts(
        {**LAVAPIPE.limits, "maxStorageBufferBindingSize": 2 * 64 * 4 * 7},
        LAVAPIPE.features,
        LAVAPIPE.adapter_info,
    )
    plan = make_plan(manifest, small, tensors, attrs)
    assert plan.scope.lookup("hiddenChunkTokens") == 7
    assert plan.scope.lookup("hiddenChunkCount") == 6


def test_qmoe_seed_rejections_name_the_rule():
    manifest = _seed("qmoe.manifest.json")
    tensors, attrs = _qmoe_call(4, 64, 64, 4, 2, 4, 32, "swiglu")
    with pytest.raises(ValueError, match="quant_type='fp4' is not supported"):
        make_plan(manifest, LAVAPIPE, tensors, {**attrs, "quant_type": "fp4"})
    with pytest.raises(ValueError, match="quantContract"):
        make_plan(manifest, LAVAPIPE, tensors, {**attrs, "k": 5})
    with pytest.raises(ValueError, match="quantBlockSizeOk"):
        make_plan(manifest, LAVAPIPE, tensors, {**attrs, "block_size": 24})


def _qkv_call(rows, k, nq, nkv, dtype, skip, residual, rank3=False):
    blocks = k // 32
    shape = (2, rows // 2, k) if rank3 else (rows, k)
    tensors = {
        "aT": np.empty(shape, dtype),
        "normScaleT": np.empty((k,), dtype),
        "qBT": np.empty((nq, blocks, 16), np.uint8),
        "qScalesT": np.empty((nq, blocks), dtype),
        "kBT": np.empty((nkv, blocks, 16), np.uint8),
        "kScalesT": np.empty((nkv, blocks), dtype),
        "vBT": np.empty((nkv, blocks, 16), np.uint8),
        "vScalesT": np.empty((nkv, blocks), dtype),
    }
    if skip:
        tensors["skipT"] = np.empty(shape, dtype)
    return tensors, {"K": k, "Nq": nq, "Nkv": nkv, "block_size": 32}


QKV_CASES = [
    (1, 2048, 2048, 512, np.float32, False, "norm"),
    (128, 2048, 2048, 512, np.float16, True, "skip"),
    (6, 64, 64, 32, np.float32, True, "skip"),
]


@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: f"rows{c[0]}K{c[1]}")
def test_matmul_nbits_qkv_seed_evaluates_and_selects(case):
    manifest = _seed("matmul-nbits-qkv.manifest.json")
    *call, expected = case
    tensors, attrs = _qkv_call(*call, residual=False)
    plan = make_plan(manifest, LAVAPIPE, tensors, attrs)
    _evaluate_everything(manifest, plan)
    assert plan.variant_id == expected, plan.explain()
    forced = "split_" + expected
    assert make_plan(manifest, LAVAPIPE, tensors, attrs, variant=forced).variant_id == forced


def test_matmul_nbits_qkv_seed_output_shapes_and_f16_rule():
    manifest = _seed("matmul-nbits-qkv.manifest.json")
    tensors, attrs = _qkv_call(8, 64, 64, 32, np.float16, False, False, rank3=True)
    plan = make_plan(manifest, LAVAPIPE, tensors, attrs)
    assert plan.output_shapes["qT"] == (2, 4, 64) and plan.output_shapes["kT"] == (2, 4, 32)
    with pytest.raises(ValueError, match="dtypeOk"):
        make_plan(manifest, NO_F16_GL, tensors, attrs)


def test_every_seed_expression_parses():
    for name in ("qmoe.manifest.json", "matmul-nbits-qkv.manifest.json"):
        manifest = _seed(name)
        assert len(manifest.expressions()) > 100
        for where, expr in manifest.expressions():
            try:
                from onnx_moe_fuse.kernels.expressions import parse

                parse(expr)
            except ExpressionError as exc:  # pragma: no cover - reported with its path
                pytest.fail(f"{name}: {where}: {exc}")
