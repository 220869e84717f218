"""The QMoE oracle's ``router_weights`` (input 14) against ONNX Runtime's CPU QMoE, and its facts.

ORT 1.32 CPU (measured by these tests; onnxruntime 1.30 and onnxruntime-webgpu 1.27's CPU
provider gave the same numbers when this was written, so tests/ort_compat.py needs no skip for
it): the top-k of ``router_probs`` selects the experts, the mixing weights are
``router_weights`` at the selected experts, divided by their sum when
``normalize_routing_weights=1`` (0 for a zero sum) and used as they are with 0. ORT CPU also
skips a selected expert whose weight is ``<= 1e-8``; the oracle does not (its docstring says
so), which a pinned test shows with a negative weight.

Each call is one QMoE node (:func:`onnx_moe_fuse.verify.ort_nodes.run_kernel_node`: inputs at
ORT's positions, every attribute written, weights as graph inputs so ORT's block-wise 8-bit path
is exact). Error measure: ``max|ort - oracle| / max|oracle|``. Data is fresh each run (the seed
is in the messages; ``TEST_SEED`` replays one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import rel_err, seeded_rng

from onnx_moe_fuse.verify.oracles.moe import qmoe, select_top_k
from onnx_moe_fuse.verify.oracles.quant import quantize_symmetric
from onnx_moe_fuse.verify.ort_nodes import run_kernel_node

ort = pytest.importorskip("onnxruntime")

EXACT = 1e-4

#: (bits, block, activation, k, experts, tokens, rank, biases, normalize)
CONFIGS = [
    (4, None, "relu", 2, 4, 6, 2, False, 0),
    (4, None, "relu", 2, 4, 6, 2, False, 1),
    (4, 32, "swiglu", 1, 4, 5, 2, True, 0),
    (4, 32, "swiglu", 1, 4, 5, 2, True, 1),
    (8, None, "gelu", 4, 4, 7, 3, True, 0),
    (8, 16, "silu", 4, 4, 7, 3, False, 1),
    (4, 16, "swiglu", 3, 8, 1, 2, True, 1),
    (8, None, "identity", 5, 8, 17, 3, False, 0),
    (4, None, "swiglu", 8, 8, 9, 2, True, 1),
    (8, 32, "swiglu", 2, 8, 40, 3, True, 0),
]


def _call(rng: np.random.Generator, config: tuple) -> tuple[dict, dict]:
    """A QMoE call by bind key with fresh non-negative router_weights, and its attributes."""
    bits, block, act, k, e, tokens, rank, biases, normalize = config
    h, inter = 64, 32
    rows = (2 if act == "swiglu" else 1) * inter
    lead = (tokens,) if rank == 2 else (1, tokens)
    fc1, s1 = quantize_symmetric(rng.standard_normal((e, rows, h)) / math.sqrt(h), bits, block, rng)
    fc2, s2 = quantize_symmetric(
        rng.standard_normal((e, h, inter)) / math.sqrt(inter), bits, block, rng
    )
    call = {
        "inputT": rng.standard_normal((*lead, h)).astype(np.float32),
        "routerT": rng.standard_normal((tokens, e)).astype(np.float32),
        "fc1T": fc1,
        "fc1ScalesT": s1,
        "fc2T": fc2,
        "fc2ScalesT": s2,
        "routerWeightsT": rng.uniform(0.0, 1.0, (tokens, e)).astype(np.float32),
    }
    if biases:
        call["fc1BiasT"] = rng.standard_normal((e, rows)).astype(np.float32)
        call["fc2BiasT"] = rng.standard_normal((e, h)).astype(np.float32)
    attrs = {
        "k": k,
        "activation_type": act,
        "expert_weight_bits": bits,
        "swiglu_fusion": 1 if act == "swiglu" else 0,
        "normalize_routing_weights": normalize,
    }
    if block:
        attrs["block_size"] = block
    if act == "swiglu":
        attrs.update(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    return call, attrs


def _oracle(call: dict, attrs: dict, **override) -> np.ndarray:
    a = {**attrs, **override}
    return qmoe(
        call["inputT"],
        call["routerT"],
        call["fc1T"],
        call["fc1ScalesT"],
        call["fc2T"],
        call["fc2ScalesT"],
        k=a["k"],
        activation_type=a["activation_type"],
        expert_weight_bits=a["expert_weight_bits"],
        block_size=a.get("block_size"),
        swiglu_fusion=a["swiglu_fusion"],
        activation_alpha=a.get("activation_alpha", 1.0),
        activation_beta=a.get("activation_beta", 0.0),
        swiglu_limit=a.get("swiglu_limit"),
        fc1_bias=call.get("fc1BiasT"),
        fc2_bias=call.get("fc2BiasT"),
        normalize_routing_weights=a["normalize_routing_weights"],
        router_weights=call.get("routerWeightsT"),
    )


def _ort(call: dict, attrs: dict, **override) -> np.ndarray:
    return run_kernel_node("QMoE", call, {**attrs, **override})


def _ids(config: tuple) -> str:
    bits, block, act, k, e, tokens, rank, biases, normalize = config
    return f"{bits}b-{block or 'col'}-{act}-k{k}of{e}-T{tokens}-rank{rank}-bias{int(biases)}-n{normalize}"


@pytest.mark.parametrize("config", CONFIGS, ids=[_ids(c) for c in CONFIGS])
def test_router_weights_match_ort(config: tuple):
    rng, seed = seeded_rng()
    call, attrs = _call(rng, config)
    want = _oracle(call, attrs)
    assert want.dtype == np.float32 and want.shape == call["inputT"].shape
    err = rel_err(_ort(call, attrs), want)
    assert err <= EXACT, f"{_ids(config)}: rel err {err:.3g} (seed={seed})"
    if attrs["k"] > 1 or not attrs["normalize_routing_weights"]:  # else the one weight is 1
        # router_weights change the answer: without them QMoE softmaxes the k logits
        without = {key: v for key, v in call.items() if key != "routerWeightsT"}
        assert rel_err(_oracle(without, attrs), want) > 1e-3, f"seed={seed}"


def _selected(call: dict, k: int) -> np.ndarray:
    """``[T, E]`` True at the experts the top-k of router_probs selects (ORT's ties)."""
    idx = select_top_k(call["routerT"], k)
    mask = np.zeros(call["routerT"].shape, dtype=bool)
    np.put_along_axis(mask, idx, True, axis=1)
    return mask


@pytest.mark.parametrize("normalize", [0, 1])
def test_pin_only_the_selected_router_weights_count(normalize: int):
    """Row 0 holds router_weights only at its selected experts; elsewhere values are unread."""
    rng, seed = seeded_rng()
    call, attrs = _call(rng, (4, None, "relu", 2, 6, 5, 2, True, normalize))
    picked = _selected(call, 2)
    call["routerWeightsT"][0, ~picked[0]] = 0.0
    base = _ort(call, attrs)
    assert rel_err(base, _oracle(call, attrs)) <= EXACT, f"seed={seed}"
    poked = {**call, "routerWeightsT": np.where(picked, call["routerWeightsT"], 50.0)}
    poked["routerWeightsT"] = poked["routerWeightsT"].astype(np.float32)
    np.testing.assert_array_equal(_ort(poked, attrs), base, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(_oracle(poked, attrs), _oracle(call, attrs))


def test_pin_normalize_divides_the_selected_weights_by_their_sum():
    """normalize 1 is normalize 0 with the selected weights pre-divided by their sum."""
    rng, seed = seeded_rng()
    call, attrs = _call(rng, (8, None, "swiglu", 3, 6, 7, 2, True, 0))
    out0, out1 = _ort(call, attrs), _ort(call, attrs, normalize_routing_weights=1)
    assert rel_err(out0, out1) > 1e-2, f"normalize 0 and 1 agree (seed={seed})"
    assert rel_err(out0, _oracle(call, attrs)) <= EXACT, f"seed={seed}"
    assert rel_err(out1, _oracle(call, attrs, normalize_routing_weights=1)) <= EXACT
    picked = _selected(call, 3)
    rw = call["routerWeightsT"]
    total = np.where(picked, rw, 0.0).sum(axis=1, keepdims=True)
    scaled = {**call, "routerWeightsT": np.where(picked, rw / total, 0.0).astype(np.float32)}
    assert rel_err(_ort(scaled, attrs), out1) <= EXACT, f"seed={seed}"
    assert (
        rel_err(_oracle(scaled, attrs), _oracle(call, attrs, normalize_routing_weights=1)) <= 1e-6
    )


def test_pin_zero_sum_row_gives_zero_weights_when_normalising():
    """A row whose selected router_weights are all 0: no expert (nor its FC2 bias) counts."""
    rng, seed = seeded_rng()
    call, attrs = _call(rng, (4, None, "relu", 2, 4, 4, 2, True, 1))
    call["routerWeightsT"][1] = 0.0
    got, want = _ort(call, attrs), _oracle(call, attrs)
    assert not np.any(got[1]) and not np.any(want[1]), f"seed={seed}"
    assert rel_err(got, want) <= EXACT, f"seed={seed}"


def test_pin_ort_cpu_skips_weights_at_most_1e_8():
    """ORT CPU drops a selected expert whose weight is <= 1e-8 (negative here); the oracle keeps it.

    The oracle documents the skip and does not model it: a negative weight is where they differ.
    """
    rng, seed = seeded_rng()
    call, attrs = _call(rng, (4, None, "relu", 2, 4, 4, 2, False, 0))
    picked = _selected(call, 2)
    first = int(np.flatnonzero(picked[0])[0])
    call["routerWeightsT"][0, first] = -0.5
    got = _ort(call, attrs)
    assert rel_err(got[0], _oracle(call, attrs)[0]) > 1e-3, f"seed={seed}"
    dropped = {**call, "routerWeightsT": call["routerWeightsT"].copy()}
    dropped["routerWeightsT"][0, first] = 0.0
    assert rel_err(got, _oracle(dropped, attrs)) <= EXACT, f"seed={seed}"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.zeros((3, 4), np.float32), r"router_weights must have shape \[T, E\] = \(2, 4\)"),
        (np.zeros((2, 4), np.float64), "router_weights has dtype float64, but input has"),
        (np.zeros((2, 4), np.int32), "router_weights must be float16, float32 or float64"),
        (np.zeros(8, np.float32), r"router_weights must have shape \[T, E\]"),
    ],
)
def test_router_weights_arguments_are_checked(value: np.ndarray, match: str):
    rng = np.random.default_rng(0)
    call, attrs = _call(rng, (4, None, "relu", 2, 4, 2, 2, False, 0))
    with pytest.raises(ValueError, match=match):
        _oracle({**call, "routerWeightsT": value}, attrs)
