"""The tiled prefill variants of the QMoE and MoE packages, forced, vs oracle and ORT.

``quant_grouped_tiled{8,16}[_loop]_routed`` (QMoE) and ``moe_grouped_tiled{8,16}`` (MoE) keep a
tile of 8 or 16 slots of one expert in every invocation's registers and dequantise each weight
once per tile (``kernels/common/moe-ffn-tiled.wgsl.jinja``). Each is forced on random calls
over every weight layout (4/8-bit, block-wise/column-wise, unaligned rows; float32 with and
without FC3), activation and fusion mode, with ragged routing (experts with no rows, experts
with several tiles), several token chunks, and tile shapes other than the shipped one, and
compared with the numpy oracle and ONNX Runtime CPU (through ``ort_compat``, which also runs
the older ORT of the lent GPU machine); outputs are poisoned first.

Pipelines are cached by their WGSL, and lavapipe compiles one of these unrolled stages in
about a second: the configurations are few and each runs several token counts. On CPU
adapters the manifests choose a shorter K step (a quarter of the unrolled code); the GPU's
tile shapes run here through a retargeted manifest.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import test_kernel_moe as moe_tests
import test_kernel_qmoe as qmoe_tests
from helpers import TOL, checked, chunk_limits, rel_err
from ort_compat import run_kernel_node

from onnx_moe_fuse.kernels.manifest import parse_manifest
from onnx_moe_fuse.kernels.runtime import Kernel, get_kernel, package_folders
from onnx_moe_fuse.verify.oracles.moe import route_moe, route_qmoe

ort = pytest.importorskip("onnxruntime")

QMOE_TILED = [
    "quant_grouped_tiled8_routed",
    "quant_grouped_tiled16_routed",
    "quant_grouped_tiled8_loop_routed",
    "quant_grouped_tiled16_loop_routed",
]
MOE_TILED = ["moe_grouped_tiled8", "moe_grouped_tiled16"]
TILE_ROWS = {vid: int(vid.split("tiled")[1].split("_")[0]) for vid in QMOE_TILED + MOE_TILED}

#: QMoE configurations (as test_kernel_qmoe.CONFIGS): every layout and activation once.
QMOE_CONFIGS = [
    (4, 64, 32, 2, 4, 32, "swiglu", 1, True, True, 7.0),  # 4-bit block-wise, biases, limit
    (4, 64, 32, 2, 4, None, "swiglu", 2, False, False, None),  # 4-bit column-wise, concat
    (4, 32, 48, 3, 8, 16, "gelu", 0, True, False, None),  # 8-bit block-wise
    (4, 32, 16, 4, 8, None, "silu", 0, False, True, None),  # 8-bit column-wise, k = E
    (3, 20, 14, 2, 4, None, "relu", 0, True, True, None),  # unaligned rows (one value a word)
    (3, 18, 10, 2, 8, None, "identity", 0, False, False, None),  # unaligned 8-bit
]
#: MoE configurations (as test_kernel_moe.CONFIGS).
MOE_CONFIGS = [
    (4, 64, 32, 2, "swiglu", 0, True, True, True, True, 7.0),  # FC3 gate/linear
    (4, 32, 48, 2, "swiglu", 1, False, True, True, False, None),
    (4, 32, 16, 2, "swiglu", 2, False, False, True, False, 1.5),
    (4, 32, 16, 3, "silu", 0, True, False, False, True, None),  # silu x FC3
    (3, 18, 10, 3, "gelu", 0, False, True, False, False, None),  # unaligned rows
]
TOKENS = [9, 24, 40, 57]


# -- references -----------------------------------------------------------------------------


def qmoe_reference(call: dict, attrs: dict) -> tuple[np.ndarray, np.ndarray | None]:
    ort_out = run_kernel_node("QMoE", call, attrs) if qmoe_tests.ort_has_mode(call, attrs) else None
    return qmoe_tests.oracle(call, attrs), ort_out


def moe_reference(call: dict, attrs: dict) -> tuple[np.ndarray, np.ndarray | None]:
    if call["fc2T"].shape[2] == 0 or call["routerT"].shape[0] == 0:
        return moe_tests.oracle(call, attrs), None
    ort_call, ort_attrs = moe_tests.interleaved_form(call, attrs)
    return moe_tests.oracle(call, attrs), run_kernel_node("MoE", ort_call, ort_attrs)


def skew_routing(rng: np.random.Generator, call: dict) -> None:
    """Ragged experts: one popular expert (several tiles), the last one never chosen."""
    router = call["routerT"]
    router[:, 0] += 3.0
    router[:, -1] -= 30.0
    if router.shape[1] > 3:
        router[rng.random(router.shape[0]) < 0.5, 1] += 2.0


def rows_per_expert(op: str, call: dict, attrs: dict) -> np.ndarray:
    if op == "qmoe":
        idx, _ = route_qmoe(call["routerT"], attrs["k"])
    else:
        idx, _ = route_moe(call["routerT"], attrs["k"], attrs.get("normalize_routing_weights", 0))
    return np.bincount(np.asarray(idx).ravel(), minlength=call["routerT"].shape[1])


def force(kernel, vid: str, call: dict, attrs: dict, refs, what: str, **kw) -> float:
    """Run ``vid`` (outputs poisoned) and check it against the oracle and ORT."""
    want, ort_out = refs
    out = kernel(attrs=attrs, variant=vid, poison_outputs=True, **kw, **call)["outputT"]
    assert out.shape == want.shape, f"{what} {vid}: shape {out.shape} != {want.shape}"
    err = checked(out, want, f"{what} [{vid}] vs oracle")
    if ort_out is not None:
        checked(out, ort_out, f"{what} [{vid}] vs ORT")
    return err


def forced_runs(op: str, kernel, variants, configs, rng, runs_per_config: int) -> Counter:
    """Each config at a few token counts, ragged routing every other run; every variant."""
    tests = qmoe_tests if op == "qmoe" else moe_tests
    reference = qmoe_reference if op == "qmoe" else moe_reference
    done, ragged = Counter(), 0
    for config in configs:
        for i in range(runs_per_config):
            tokens = TOKENS[i % len(TOKENS)]
            call, attrs = tests.random_call(rng, config, tokens, 2 + i % 2)
            if i % 2 == 0:
                skew_routing(rng, call)
            rows = rows_per_expert(op, call, attrs)
            refs = reference(call, attrs)
            if refs[1] is not None:  # the oracle's agreement with ORT holds on these calls
                assert rel_err(refs[1], refs[0], zero_scale=1.0) <= TOL
            # Every config runs the first variant and one other in turn (MoE: every other
            # config): each (configuration, variant) costs two compiled pipelines.
            at, others = configs.index(config), variants[1:]
            extra = [others[at % len(others)]] if len(others) > 1 or at % 2 == 0 else []
            for vid in variants[:1] + extra:
                plan = kernel.plan(attrs=attrs, variant=None, **call)
                if vid in plan.rejected:
                    assert "numTokens * topK >=" in plan.rejected[vid], plan.rejected[vid]
                    continue
                what = f"{op} {config} T={tokens} rows/expert={rows.tolist()}"
                force(kernel, vid, call, attrs, refs, what)
                done[vid] += 1
                tile = TILE_ROWS[vid]
                ragged += int(rows.min() == 0 and rows.max() > tile)
    assert ragged >= len(variants), "no run had both an empty expert and a multi-tile one"
    return done


# -- the shipped variants -------------------------------------------------------------------


def test_the_packages_list_the_tiled_variants(device):
    assert set(QMOE_TILED) <= set(get_kernel("com.microsoft.QMoE").variants)
    assert set(MOE_TILED) <= set(get_kernel("com.microsoft.MoE").variants)


def test_qmoe_tiled_variants_forced(device, rng):
    kernel = get_kernel("com.microsoft.QMoE")
    done = forced_runs("qmoe", kernel, QMOE_TILED, QMOE_CONFIGS, rng, 4)
    print(dict(done))
    assert done[QMOE_TILED[0]] >= 20 and all(done[vid] >= 4 for vid in QMOE_TILED), done


def test_moe_tiled_variants_forced(device, rng):
    kernel = get_kernel("com.microsoft.MoE")
    done = forced_runs("moe", kernel, MOE_TILED, MOE_CONFIGS, rng, 4)
    print(dict(done))
    assert done[MOE_TILED[0]] >= 16 and done[MOE_TILED[1]] >= 4, done


@pytest.mark.parametrize("op", ["qmoe", "moe"])
def test_tiled_variants_over_token_chunks(device, rng, op):
    """Lowered binding limits: 2-4 chunks, each regrouped and tiled on its own."""
    kernel = get_kernel("com.microsoft.QMoE" if op == "qmoe" else "com.microsoft.MoE")
    tests = qmoe_tests if op == "qmoe" else moe_tests
    # Configurations whose hidden activations outweigh every tensor (so that a lowered
    # binding limit splits tokens), already compiled by the forced tests.
    config = QMOE_CONFIGS[2] if op == "qmoe" else MOE_CONFIGS[4]
    reference = qmoe_reference if op == "qmoe" else moe_reference
    for i in range(2):
        call, attrs = tests.random_call(rng, config, 57, 2 + i)
        skew_routing(rng, call)
        limits = chunk_limits(rng, call, k=config[3], inter=config[2])
        plan = kernel.plan(attrs=attrs, device_limits=limits, **call)
        assert plan.scope.lookup("groupChunkCount") > 1, limits
        refs = reference(call, attrs)
        vid = QMOE_TILED[0] if op == "qmoe" else MOE_TILED[0]
        force(kernel, vid, call, attrs, refs, f"{op} chunked {i}", device_limits=limits)


def test_tiled_variant_is_refused_with_too_few_slots_per_expert(device, rng):
    kernel = get_kernel("com.microsoft.QMoE")
    call, attrs = qmoe_tests.random_call(rng, QMOE_CONFIGS[0], 10, 2)  # 20 slots, 4 experts
    plan = kernel.plan(attrs=attrs, **call)
    assert "numTokens * topK >= 8 * numExperts" in plan.rejected[QMOE_TILED[1]]
    assert QMOE_TILED[0] not in plan.rejected


# -- other tile shapes (the template is generic in them) ------------------------------------


def _retiled(op: str, threads: int, cols: int, step: int) -> Kernel:
    """The package with its tiled variants' invocation count, columns and K step changed."""
    folder = next(f for f in package_folders() if f.name == op)
    data = json.loads((folder / "manifest.json").read_text())
    for variant in data["variants"]:
        if "tiled" not in variant["id"]:
            continue
        for chunk in variant["passes"][1]["passes"]:
            inputs = chunk.get("source", {}).get("inputs", {})
            if "tiledThreads" in inputs:
                shipped = f"{inputs['tiledThreads']} * {inputs['tiledCols']})"
                inputs.update(tiledThreads=str(threads), tiledCols=str(cols), tiledK=str(step))
                y = chunk["dispatch"]["y"]
                assert shipped in y, y
                chunk["dispatch"]["y"] = y.replace(shipped, f"{threads} * {cols})")
    return Kernel(parse_manifest(data, folder / "manifest.json"), folder)


@pytest.mark.parametrize(
    ("op", "vid", "threads", "cols", "step"),
    [
        # The GPU's tile (CPU adapters get a shorter K step; see the manifests).
        ("qmoe", QMOE_TILED[0], 64, 4, 32),
        ("moe", MOE_TILED[0], 64, 2, 16),
        # Other shapes: the template is generic in them.
        ("qmoe", QMOE_TILED[2], 32, 8, 16),
        ("moe", MOE_TILED[1], 32, 4, 8),
    ],
)
def test_tiled_templates_at_other_tile_shapes(device, rng, op, vid, threads, cols, step):
    kernel = _retiled(op, threads, cols, step)
    tests = qmoe_tests if op == "qmoe" else moe_tests
    reference = qmoe_reference if op == "qmoe" else moe_reference
    config = QMOE_CONFIGS[0] if op == "qmoe" else MOE_CONFIGS[1]
    for tokens in (24, 57):
        call, attrs = tests.random_call(rng, config, tokens, 2)
        skew_routing(rng, call)
        refs = reference(call, attrs)
        force(kernel, vid, call, attrs, refs, f"{op} {threads}x{cols} K{step} T={tokens}")
