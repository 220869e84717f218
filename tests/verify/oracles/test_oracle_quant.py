"""Tests for the packing and symmetric quantisation helpers (QMoE and MatMulNBits layouts).

The layouts themselves are checked against ONNX Runtime in the QMoE, MoE and MatMulNBitsQkv test
modules; here: nibble order, zero points, shapes, round trips and errors. Random inputs are fresh
each run (seed in the messages; ``TEST_SEED`` replays one).
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from onnx_moe_fuse.verify.oracles import quant


def _rng() -> tuple[np.random.Generator, int]:
    seed = int(os.environ.get("TEST_SEED", secrets.randbits(32)))
    return np.random.default_rng(seed), seed


def test_4bit_low_nibble_holds_the_even_element():
    codes = np.array([[1, 2, 3, 4, 15, 0]], dtype=np.uint8)
    packed = quant.pack_bits(codes, 4)
    np.testing.assert_array_equal(packed, np.array([[0x21, 0x43, 0x0F]], dtype=np.uint8))
    np.testing.assert_array_equal(quant.unpack_bits(packed, 4), codes)


def test_2bit_and_8bit_packing_order():
    codes = np.array([1, 2, 3, 0, 3, 3, 3, 3], dtype=np.uint8)
    np.testing.assert_array_equal(quant.pack_bits(codes, 2), [0b00111001, 0xFF])
    c8 = np.array([0, 7, 200, 255], dtype=np.uint8)
    np.testing.assert_array_equal(quant.pack_bits(c8, 8), c8)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    rng, seed = _rng()
    codes = rng.integers(0, 1 << bits, size=(3, 5, 16), dtype=np.uint8)
    packed = quant.pack_bits(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8), f"seed={seed}"
    np.testing.assert_array_equal(quant.unpack_bits(packed, bits), codes, err_msg=f"seed={seed}")


def test_zero_points_and_pack_sizes():
    assert [quant.zero_point(b) for b in (2, 4, 8)] == [2, 8, 128]
    assert [quant.pack_size(b) for b in (2, 4, 8)] == [4, 2, 1]


def test_dequantize_qmoe_by_hand():
    # 4-bit: code 8 is zero, 15 is +7 * scale, 0 is -8 * scale.
    codes = np.array([[[8, 15, 0, 9]]], dtype=np.uint8)
    packed = quant.pack_qmoe(codes, 4)
    got = quant.dequantize_qmoe(packed, np.array([[0.5]], np.float32), 4)
    np.testing.assert_array_equal(got, [[[0.0, 3.5, -4.0, 0.5]]])
    # 8-bit: zero point 128.
    codes8 = np.array([[[128, 255, 0, 129]]], dtype=np.uint8)
    got8 = quant.dequantize_qmoe(codes8, np.array([[2.0]], np.float32), 8)
    np.testing.assert_array_equal(got8, [[[0.0, 254.0, -256.0, 2.0]]])
    # block-wise: block 2 of 4 elements uses the second scale.
    got_b = quant.dequantize_qmoe(packed, np.array([[[1.0, 3.0]]], np.float32), 4, 2)
    np.testing.assert_array_equal(got_b, [[[0.0, 7.0, -24.0, 3.0]]])
    assert got_b.dtype == np.float32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block_size", [None, 16, 32])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_symmetric_round_trip(bits, block_size, stochastic):
    rng, seed = _rng()
    e, n, k = 3, 6, 64
    w = rng.standard_normal((e, n, k))
    packed, scales = quant.quantize_symmetric(w, bits, block_size, rng if stochastic else None)
    assert packed.dtype == np.uint8 and packed.shape == (e, n, k // quant.pack_size(bits))
    want_scales = (e, n) if block_size is None else (e, n, k // block_size)
    assert scales.shape == want_scales and scales.dtype == np.float32, f"seed={seed}"
    deq = quant.dequantize_qmoe(packed, scales, bits, block_size, dtype=np.float64)
    per_elem = scales[..., None] if block_size is None else np.repeat(scales, block_size, -1)
    # Nearest rounding is within half a step, stochastic rounding within one step.
    bound = per_elem * (1.0 if stochastic else 0.5) * (1 + 1e-6)
    assert np.all(np.abs(deq - w) <= bound), f"seed={seed}"
    codes = quant.unpack_qmoe(packed, bits).astype(int) - quant.zero_point(bits)
    qmax = (1 << (bits - 1)) - 1
    assert codes.max() <= qmax and codes.min() >= -qmax, f"seed={seed}"


def test_quantize_all_zero_row_stays_zero():
    w = np.zeros((1, 2, 8))
    w[0, 1] = np.linspace(-1, 1, 8)
    packed, scales = quant.quantize_symmetric(w, 4)
    deq = quant.dequantize_qmoe(packed, scales, 4)
    np.testing.assert_array_equal(deq[0, 0], 0.0)
    assert scales[0, 0] == 1.0


@pytest.mark.parametrize("k", [32, 64, 80])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_matmul_nbits_layout_round_trip(k, bits):
    rng, seed = _rng()
    n, block = 5, 32
    w = rng.standard_normal((n, k))
    packed, scales = quant.quantize_matmul_nbits(w, bits, block)
    kb = -(-k // block)
    assert packed.shape == (n, kb, block * bits // 8) and scales.shape == (n, kb), f"seed={seed}"
    codes = quant.unpack_matmul_nbits(packed, k, bits, block)
    assert codes.shape == (n, k)
    np.testing.assert_array_equal(quant.pack_matmul_nbits(codes, bits, block), packed)
    if k % block:  # the padding of the last block is the zero-point code
        full = quant.unpack_bits(packed, bits).reshape(n, kb * block)
        np.testing.assert_array_equal(full[:, k:], quant.zero_point(bits))
    deq = quant.dequantize_matmul_nbits(packed, scales, k, bits, block, dtype=np.float64)
    per_elem = np.repeat(scales.astype(np.float64), block, axis=1)[:, :k]
    assert np.all(np.abs(deq - w) <= 0.5 * per_elem * (1 + 1e-6)), f"seed={seed}"


def test_matmul_nbits_first_block_nibbles():
    codes = np.full((1, 32), 8, dtype=np.uint8)
    codes[0, 0], codes[0, 1] = 9, 3
    packed = quant.pack_matmul_nbits(codes, 4, 32)
    assert packed.shape == (1, 1, 16)
    assert packed[0, 0, 0] == 0x39 and packed[0, 0, 1] == 0x88


def test_matmul_nbits_float16_scales():
    rng, seed = _rng()
    _, scales = quant.quantize_matmul_nbits(rng.standard_normal((4, 64)), scale_dtype=np.float16)
    assert scales.dtype == np.float16, f"seed={seed}"


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: quant.pack_bits(np.zeros(3, np.uint8), 4), r"not a multiple of 2"),
        (lambda: quant.pack_bits(np.array([16, 0], np.uint8), 4), r"codes must lie in \[0, 16\)"),
        (lambda: quant.pack_bits(np.zeros(2), 4), r"integer array"),
        (lambda: quant.pack_bits(np.zeros(2, np.uint8), 3), r"bits must be one of"),
        (lambda: quant.unpack_bits(np.zeros(2, np.int8), 4), r"packed must be uint8"),
        (lambda: quant.pack_qmoe(np.zeros((2, 4), np.uint8), 4), r"rank 3 \[E, N, K\]"),
        (lambda: quant.quantize_symmetric(np.ones((1, 2, 8)), 2), r"expert_weight_bits"),
        (lambda: quant.quantize_symmetric(np.ones((1, 2, 7)), 4), r"even K"),
        (lambda: quant.quantize_symmetric(np.ones((1, 2, 48)), 4, 32), r"does not divide"),
        (lambda: quant.quantize_symmetric(np.ones((1, 2, 48)), 4, 0), r"positive integer"),
        (
            lambda: quant.dequantize_qmoe(np.zeros((1, 2, 4), np.uint8), np.ones((1, 3)), 4),
            r"column-wise scales must have shape \[E, N\] = \(1, 2\)",
        ),
        (
            lambda: quant.dequantize_qmoe(np.zeros((1, 2, 8), np.uint8), np.ones((1, 2, 2)), 4, 4),
            r"block-wise scales must have shape \[E, N, K/block_size\] = \(1, 2, 4\)",
        ),
        (
            lambda: quant.dequantize_qmoe(np.zeros((1, 2, 8), np.uint8), np.ones((1, 2)), 4, 5),
            r"block_size = 5 does not divide K = 16",
        ),
        (
            lambda: quant.unpack_matmul_nbits(np.zeros((2, 1, 16), np.uint8), 64),
            r"B must have shape \[N, 2, 16\]",
        ),
        (
            lambda: quant.dequantize_matmul_nbits(
                np.zeros((2, 1, 16), np.uint8), np.ones((2, 2)), 32
            ),
            r"scales must have shape \[N, k_blocks\] = \(2, 1\)",
        ),
    ],
)
def test_errors(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
