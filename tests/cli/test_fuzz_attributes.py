"""Fuzzing what the rules read: attribute values and dtypes, constants, non-finite weights.

Each case takes a small sample (the decomposed or the GroupedMatMul spelling of a Mixtral-like
int4 layer), changes one thing the rules look at, and runs the command in-process:

* an attribute of a TopK, Softmax, DequantizeLinear, Gather, Reshape, ReduceSum, Unsqueeze,
  Squeeze, Expand or Constant node set to a random value of a random type, added, or removed;
* a Constant's value (TopK's k, Reshape's shape, axes) replaced by random integers or dtypes;
* an initializer's or the graph input's element type changed (the bytes kept);
* weights, scales or router weights given NaN or infinities (valid models: they must fuse or
  be refused like any other, and a written model must load).

Properties (:func:`cli_cases.check_properties`): exit 0 or 2 (1 with ``--verify``), never a
traceback, the input byte-identical, nothing written on refusal.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from cli_cases import SMALL, case_folders, check_properties, fuzz_settings
from hypothesis import event, given
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from onnx_moe_fuse.samples import get_sample

_BASES = (SMALL, "mixtral_gmm_int4b32")
_RULE_OPS = (
    "TopK",
    "Softmax",
    "DequantizeLinear",
    "Gather",
    "Reshape",
    "ReduceSum",
    "Unsqueeze",
    "Squeeze",
    "Expand",
    "Constant",
    "MatMul",
)
_INT64 = st.integers(-(2**63), 2**63 - 1)
_SMALL_INTS = st.integers(-4, 70)
_DTYPES = st.sampled_from(
    [t for t in onnx.TensorProto.DataType.values() if t != onnx.TensorProto.UNDEFINED]
)


@functools.cache
def _base(name: str) -> bytes:
    return get_sample(name).model.SerializeToString()


def _model(name: str) -> onnx.ModelProto:
    return onnx.load_model_from_string(_base(name))


_VALUES = st.one_of(
    _SMALL_INTS,
    _INT64,
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.text(max_size=8),
    st.lists(_SMALL_INTS, min_size=1, max_size=4),
    st.lists(st.floats(width=32, allow_nan=True), min_size=1, max_size=3),
)


def _run(model: onnx.ModelProto, *extra: str, allowed=(0, 2)) -> int:
    with case_folders() as (inputs, outputs):
        src = inputs / "m.onnx"
        src.write_bytes(model.SerializeToString())
        argv = [str(src), "-o", str(outputs / "o.onnx"), "--report", str(outputs / "r.json")]
        code = check_properties([*argv, *extra], inputs, outputs, allowed)[0]
    event(f"exit {code}")
    return code


@fuzz_settings(50)
@given(data=st.data())
def test_random_attributes_on_the_ops_the_rules_read(data):
    model = _model(data.draw(st.sampled_from(_BASES)))
    nodes = [n for n in model.graph.node if n.op_type in _RULE_OPS]
    node = data.draw(st.sampled_from(nodes))
    try:
        known = sorted(onnx.defs.get_schema(node.op_type, 21, "").attributes)
    except onnx.defs.SchemaError:
        known = []
    name = data.draw(st.sampled_from([*known, "bogus"]) if known else st.just("bogus"))
    kind = data.draw(st.sampled_from(["set", "remove"]))
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    if kind == "set":
        node.attribute.append(helper.make_attribute(name, data.draw(_VALUES)))
    _run(model)


@fuzz_settings(25)
@given(data=st.data())
def test_random_constants_the_rules_read(data):
    model = _model(data.draw(st.sampled_from(_BASES)))
    constants = [n for n in model.graph.node if n.op_type == "Constant"]
    node = data.draw(st.sampled_from(constants))
    values = data.draw(st.lists(st.integers(-(2**40), 2**40), min_size=0, max_size=4))
    dtype = data.draw(st.sampled_from([np.int64, np.int32, np.float32, np.uint8]))
    array = np.asarray(values, dtype=np.int64).astype(dtype)  # wraps, as a bad exporter would
    tensor = numpy_helper.from_array(array, name="")
    del node.attribute[:]
    node.attribute.append(helper.make_attribute("value", tensor))
    _run(model)


@fuzz_settings(25)
@given(data=st.data())
def test_random_element_types(data):
    model = _model(data.draw(st.sampled_from(_BASES)))
    where = data.draw(st.sampled_from(["initializer", "input", "output"]))
    dtype = data.draw(_DTYPES)
    if where == "initializer":
        init = data.draw(st.sampled_from(list(model.graph.initializer)))
        init.data_type = dtype
    else:
        value = (model.graph.input if where == "input" else model.graph.output)[0]
        value.type.tensor_type.elem_type = dtype
    _run(model)


def _poisoned(model: onnx.ModelProto, data) -> onnx.ModelProto:
    floats = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    init = data.draw(st.sampled_from(floats))
    array = numpy_helper.to_array(init).copy()
    count = data.draw(st.integers(1, min(8, array.size)))
    for _ in range(count):
        at = data.draw(st.integers(0, array.size - 1))
        array.flat[at] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf, 3.4e38]))
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    return model


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # NaN arithmetic, on purpose
@fuzz_settings(10)
@given(data=st.data())
def test_non_finite_weights(data):
    _run(_poisoned(_model(data.draw(st.sampled_from(_BASES))), data))


@pytest.mark.usefixtures("device")
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
@fuzz_settings(2)
@given(data=st.data())
def test_non_finite_weights_verified(data):
    model = _poisoned(_model(SMALL), data)
    _run(model, "--verify", "--seeds", "0", allowed=(0, 1))
