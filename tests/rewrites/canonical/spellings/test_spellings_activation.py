"""``Swish``/``QuickGelu`` -> ``x * Sigmoid(alpha * x)``; ``HardSwish`` and inexact alphas stay.

Tolerance: the rewritten graph agrees with the runtime's Swish/QuickGelu kernels to relative
1e-6 in float32 (same formula, kernels may order it differently), as the module says.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from test_spellings_common import (
    assert_same,
    assert_untouched,
    constant_names,
    normalise,
    ops,
    parse,
    producer,
)

RTOL, ATOL = 1e-6, 1e-7


def _swish(alpha: str = "", dtype: str = "float") -> str:
    attr = f" <alpha = {alpha}>" if alpha else ""
    return f"""<ir_version: 10, opset_import: ["" : 24]>
    g ({dtype}[N, 16] x) => ({dtype}[N, 16] y) {{
      y = Swish{attr} (x)
    }}"""


def _quick_gelu(alpha: str = "") -> str:
    attr = f" <alpha = {alpha}>" if alpha else ""
    return f"""<ir_version: 10, opset_import: ["" : 24, "com.microsoft" : 1]>
    g (float[N, 16] x) => (float[N, 16] y) {{
      y = com.microsoft.QuickGelu{attr} (x)
    }}"""


def test_swish_default_alpha_is_silu(rng):
    model = parse(_swish())
    after, modified = normalise(model)
    assert modified and ops(after) == {"Mul": 1, "Sigmoid": 1}
    mul = producer(after, "y")
    sig = producer(after, mul.input[1])
    assert mul.input[0] == "x" and sig.op_type == "Sigmoid" and sig.input == ["x"]
    assert_same(model, after, rng, rtol=RTOL, atol=ATOL, dims={"N": 7})


def _assert_scaled(after, alpha: float) -> None:
    mul = producer(after, "y")
    sig = producer(after, mul.input[1])
    scale = producer(after, sig.input[0])
    assert mul.input[0] == "x" and sig.op_type == "Sigmoid" and scale.op_type == "Mul"
    assert scale.input[0] == "x" and scale.input[1] in constant_names(after)
    const = producer(after, scale.input[1])
    assert numpy_helper.to_array(const.attribute[0].t) == np.float32(alpha)


@settings(max_examples=12, deadline=None)
@given(alpha=st.floats(0.0625, 4.0, width=32).filter(lambda a: a != 1.0))
def test_swish_alpha_is_scaled_sigmoid(alpha):
    rng = np.random.default_rng(int(alpha * 1e6))
    model = parse(_swish(repr(float(alpha))))
    after, modified = normalise(model)
    assert modified and ops(after) == {"Mul": 2, "Sigmoid": 1, "Constant": 1}
    _assert_scaled(after, alpha)
    assert_same(model, after, rng, rtol=RTOL, atol=ATOL, dims={"N": 5})


def test_quick_gelu_default_alpha(rng):
    model = parse(_quick_gelu())
    after, modified = normalise(model)
    assert modified and "QuickGelu" not in ops(after)
    _assert_scaled(after, 1.702)
    assert_same(model, after, rng, rtol=RTOL, atol=ATOL, dims={"N": 9})


def test_quick_gelu_alpha_one_is_silu(rng):
    model = parse(_quick_gelu("1.0"))
    after, _ = normalise(model)
    assert ops(after) == {"Mul": 1, "Sigmoid": 1}
    assert_same(model, after, rng, rtol=RTOL, atol=ATOL, dims={"N": 4})


def test_hard_swish_is_not_silu():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 24]>
        g (float[N, 16] x) => (float[N, 16] y) {
          y = HardSwish(x)
        }""")
    )


def test_alpha_not_exact_in_float16_stays():
    # 1.702 has no float16 value: a constant of x's type would change the function
    assert_untouched(parse(_swish("1.702", dtype="float16")))


def test_float16_exact_alpha_is_rewritten(rng):
    model = parse(_swish("0.5", dtype="float16"))
    after, modified = normalise(model)
    assert modified and "Swish" not in ops(after)
    assert_same(model, after, rng, rtol=2e-3, atol=2e-3, dims={"N": 3})
