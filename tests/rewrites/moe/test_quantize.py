"""The ``--quantize`` scheme (rewrites/moe/quantize.py) against independent numpy references.

Two references, neither the code under test: the oracles' ``quantize_symmetric`` (the test-data
quantiser of ``verify/oracles/quant.py``, written apart, same scheme) bit for bit, and the
scheme's defining properties checked from the dequantised values: every weight lands on the
nearest point of its block's grid, the scale is ``max|w| / qmax`` of its block, and the codes
stay in range.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_moe_fuse.contract.packing import unpack_qmoe
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.quantize import BlockSizeRefusal, Quantization, quantize_weights
from onnx_moe_fuse.verify.oracles.quant import dequantize_qmoe, quantize_symmetric


@pytest.mark.parametrize(("bits", "block"), [(4, 0), (4, 16), (4, 32), (8, 0), (8, 64)])
def test_codes_and_scales_equal_the_oracles_quantiser(rng, bits, block):
    w = rng.standard_normal((3, 24, 128)).astype(np.float32) * rng.uniform(0.01, 3)
    w[1, 5, : block or 128] = 0  # an all-zero block (or row): scale 1, codes at the zero point
    packed, scales = quantize_weights(w, bits, block)
    want_packed, want_scales = quantize_symmetric(w, bits, block or None)
    np.testing.assert_array_equal(packed, want_packed)
    np.testing.assert_array_equal(scales, want_scales)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    block=st.sampled_from([0, 16, 32]),
    experts=st.integers(1, 3),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(1e-3, 1e3),
)
def test_each_weight_is_the_nearest_point_of_its_blocks_grid(
    bits, block, experts, rows, blocks, seed, scale
):
    k = (block or 32) * blocks
    w = np.random.default_rng(seed).standard_normal((experts, rows, k)).astype(np.float32) * scale
    packed, scales = quantize_weights(w, bits, block)
    qmax = 2 ** (bits - 1) - 1
    width = block or k
    per_block = np.asarray(scales, np.float64).reshape(experts, rows, -1)
    assert per_block.shape[2] == k // width
    amax = np.abs(w.astype(np.float64)).reshape(experts, rows, k // width, width).max(axis=3)
    np.testing.assert_allclose(per_block, amax / qmax, rtol=1e-6)  # float32-rounded max|w|/qmax
    codes = unpack_qmoe(packed, bits).astype(np.int64)
    assert codes.min() >= 0 and codes.max() <= 2 * qmax + 1
    deq = dequantize_qmoe(packed, scales, bits, block or None, dtype=np.float64)
    step = np.repeat(per_block, width, axis=2)
    # nearest grid point: within half a step (the float32 scale's rounding aside)
    assert np.all(np.abs(deq - w) <= step * (0.5 + 1e-6))
    # and no other grid point is nearer: one step towards the weight overshoots it
    towards = deq + np.sign(w - deq) * step
    assert np.all(np.abs(towards - w) >= np.abs(deq - w) - step * 1e-6)


def test_the_options_quantize_refuses_what_qmoe_cannot_take():
    for bits, block in ((3, 0), (4, 8), (4, 24), (8, 48)):
        with pytest.raises(ValueError):
            Quantization(bits, block)
    assert Quantization(4, 32).describe() == "int4, blocks of 32"
    assert Quantization(8, 0).describe() == "int8, per channel"


def test_a_block_that_does_not_divide_h_or_i_is_the_users_mistake():
    q = Quantization(4, 64, default_block=True)
    assert q.layer_block(128, 256) == 64
    with pytest.raises(
        BlockSizeRefusal, match=r"64 \(the default for int4\) does not divide I = 96"
    ):
        q.layer_block(128, 96)
    with pytest.raises(Refusal, match="pairs"):  # int4 packs two codes a byte
        Quantization(4, 0).layer_block(33, 64)
    assert Quantization(8, 0).layer_block(33, 65) == 0
