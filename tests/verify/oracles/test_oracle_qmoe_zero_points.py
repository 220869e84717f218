"""QMoE's zero-point inputs (11, 12): the packing, the oracle against ORT 1.32 CPU, the facts.

Pinned on ORT 1.32 CPU (measured): column-wise zero points are ``[E, ceil(N * bits / 8)]``,
packed along the output channels; block-wise ``[E, N, ceil(blocks * bits / 8)]``, packed along
the blocks of a row, the earliest lowest; ``value = (q - zp) * scale``. Every case draws fresh
random codes, zero points and scales (never the symmetric point), so a wrong layout, nibble
order or sign fails. Block-wise 8-bit is compared loosely: ORT CPU quantises the activations
to int8 there (semantics.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_moe_fuse.contract.packing import (
    pack_bits,
    pack_qmoe_zero_points,
    unpack_qmoe_zero_points,
)
from onnx_moe_fuse.verify.oracles.moe import qmoe
from onnx_moe_fuse.verify.oracles.quant import dequantize_qmoe
from onnx_moe_fuse.verify.ort_nodes import run_node

pytest.importorskip("onnxruntime")

EXACT = 1e-5
BLOCKWISE_8BIT = 6e-2  # ORT CPU's int8 activations (semantics.md)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    e=st.integers(1, 3),
    n=st.integers(1, 9),
    blocks=st.one_of(st.none(), st.integers(1, 5)),
    seed=st.integers(0, 2**31),
)
def test_zero_point_packing_round_trips(bits, e, n, blocks, seed) -> None:
    rng = np.random.default_rng(seed)
    z = rng.integers(0, 1 << bits, (e, n, blocks or 1)).astype(np.uint8)
    packed = pack_qmoe_zero_points(z, bits, blocks is not None)
    per = 8 // bits
    want = (e, -(-n // per)) if blocks is None else (e, n, -(-blocks // per))
    assert packed.shape == want and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_qmoe_zero_points(packed, bits, n, blocks), z)


def test_zero_point_packing_is_earliest_lowest_and_pads_with_zero_bits() -> None:
    z = np.array([[[1], [2], [3]]], np.uint8)  # E 1, N 3, one block: column-wise
    assert pack_qmoe_zero_points(z, 4, False).tolist() == [[0x21, 0x03]]
    blocked = np.array([[[1, 2, 3]]], np.uint8)  # E 1, N 1, 3 blocks
    assert pack_qmoe_zero_points(blocked, 4, True).tolist() == [[[0x21, 0x03]]]
    assert pack_qmoe_zero_points(blocked, 8, True).tolist() == [[[1, 2, 3]]]
    with pytest.raises(ValueError, match="one block per row"):
        pack_qmoe_zero_points(blocked, 4, False)
    with pytest.raises(ValueError, match="shape"):
        unpack_qmoe_zero_points(np.zeros((1, 3), np.uint8), 4, 3, None)


def _data(rng, bits, block, act, e=4, tokens=6):
    inter = max(32, block)  # the block divides H and I (ORT's rule)
    h = 2 * inter
    fusion = 2 if act == "swiglu" else 1
    top = 1 << bits
    shapes = {"fc1": (e, fusion * inter, h), "fc2": (e, h, inter)}
    d = {
        "input": rng.standard_normal((tokens, h)).astype(np.float32),
        "router_probs": rng.standard_normal((tokens, e)).astype(np.float32),
    }
    for name, (ee, nn, kk) in shapes.items():
        nb = kk // block if block else 1
        codes = rng.integers(0, top, (ee, nn, kk))
        zp = rng.integers(0, top, (ee, nn, nb)).astype(np.uint8)
        scale = (rng.random((ee, nn, nb)) * 0.2 / np.sqrt(kk) + 0.01).astype(np.float32)
        d[name] = pack_bits(codes, bits)
        d[f"{name}_scales"] = scale if block else scale[:, :, 0]
        d[f"{name}_zp"] = zp
        d[f"{name}_zero_points"] = pack_qmoe_zero_points(zp, bits, bool(block))
    return d


def _attrs(bits, block, act, k):
    attrs = {
        "k": k,
        "activation_type": act,
        "expert_weight_bits": bits,
        "normalize_routing_weights": 1,
        "use_sparse_mixer": 0,
        "swiglu_fusion": 1 if act == "swiglu" else 0,
        "activation_alpha": 1.0,
        "activation_beta": 0.0,
        "weights_prepacked": 0,
        "accuracy_level": 0,
        "quant_type": "int",
    }
    if block:
        attrs["block_size"] = block
    return attrs


def _ort(d, attrs):
    inputs = [
        d["input"],
        d["router_probs"],
        d["fc1"],
        d["fc1_scales"],
        None,
        d["fc2"],
        d["fc2_scales"],
        None,
        None,
        None,
        None,
        d["fc1_zero_points"],
        d["fc2_zero_points"],
    ]
    return run_node("QMoE", inputs, attrs, const=set(range(2, 13)))


def _oracle(d, bits, block, act, k, zero_points=True):
    return qmoe(
        d["input"],
        d["router_probs"],
        d["fc1"],
        d["fc1_scales"],
        d["fc2"],
        d["fc2_scales"],
        k=k,
        activation_type=act,
        expert_weight_bits=bits,
        block_size=block or None,
        swiglu_fusion=1 if act == "swiglu" else 0,
        fc1_zero_points=d["fc1_zero_points"] if zero_points else None,
        fc2_zero_points=d["fc2_zero_points"] if zero_points else None,
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [0, 16, 32, 64])
@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_qmoe_zero_points_match_ort(bits, block, act, rng) -> None:
    k = int(rng.integers(1, 4))
    d = _data(rng, bits, block, act)
    got = _ort(d, _attrs(bits, block, act, k))
    want = _oracle(d, bits, block, act, k)
    bound = BLOCKWISE_8BIT if bits == 8 and block else EXACT
    assert rel_err(got, want) < bound
    # the zero points matter: the symmetric reading is far off
    assert rel_err(_oracle(d, bits, block, act, k, zero_points=False), want) > 1e-2


def test_dequantize_with_zero_points_is_code_minus_zero_point_times_scale(rng) -> None:
    d = _data(rng, 4, 16, "relu")
    w = dequantize_qmoe(d["fc2"], d["fc2_scales"], 4, 16, zero_points=d["fc2_zp"])
    codes = np.stack([d["fc2"] & 15, d["fc2"] >> 4], axis=-1).reshape(w.shape).astype(float)
    z = np.repeat(d["fc2_zp"].astype(float), 16, axis=2)
    s = np.repeat(d["fc2_scales"].astype(float), 16, axis=2)
    np.testing.assert_allclose(w, ((codes - z) * s).astype(np.float32), rtol=0, atol=0)
    with pytest.raises(ValueError, match="zero points must have the scales' shape"):
        dequantize_qmoe(d["fc2"], d["fc2_scales"], 4, 16, zero_points=d["fc2_zp"][:, :, :1])
