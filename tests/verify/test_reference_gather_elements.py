"""The reference path's GatherElements: negative axes read from the end, as ONNX Runtime does."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_moe_fuse.verify.ort_nodes import session
from onnx_moe_fuse.verify.reference import run_reference


def _model(axis: int, data: tuple[int, ...], index: tuple[int, ...]) -> onnx.ModelProto:
    node = helper.make_node("GatherElements", ["data", "idx"], ["out"], axis=axis)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, list(data)),
            helper.make_tensor_value_info("idx", TensorProto.INT64, list(index)),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(index))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(
    "axis, data, index",
    [(-1, (5, 8), (5, 2)), (1, (5, 8), (5, 3)), (0, (6, 4), (2, 4)), (-2, (3, 6, 4), (3, 2, 4))],
)
def test_matches_ort(axis: int, data: tuple, index: tuple, rng: np.random.Generator) -> None:
    model = _model(axis, data, index)
    size = data[axis]
    feeds = {
        "data": rng.standard_normal(data).astype(np.float32),
        # negative ids count from the end
        "idx": rng.integers(-size, size, index).astype(np.int64),
    }
    want = session(model).run(None, feeds)[0]
    got = run_reference(model, feeds)["out"]
    np.testing.assert_array_equal(got, want)
