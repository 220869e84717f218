"""Random inputs for a model's graph inputs, sized before anything is allocated.

:func:`random_feeds` makes fresh random inputs for every graph input, symbolic dims given small
values (:data:`DEFAULT_DIM_VALUES`). It refuses, before allocating anything, inputs that would
take more than :data:`MAX_FEED_BYTES` in all (a model with a fixed 1e8-row input once asked for
48 GB): :class:`FeedTooLargeError` names the input, its shape and its size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import onnx

from onnx_moe_fuse.errors import MoEFuseError

__all__ = [
    "DEFAULT_DIM_VALUES",
    "MAX_FEED_BYTES",
    "FeedTooLargeError",
    "feed_shapes",
    "random_feeds",
]

#: Values for the symbolic dims the samples use; other names get ``default_dim``.
DEFAULT_DIM_VALUES: dict[str, int] = {"T": 5, "B": 2, "S": 3}

_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))

#: The most bytes :func:`random_feeds` makes for one model's inputs together (256 MiB): the
#: checker runs every path on them and keeps intermediates, so far more than this is used.
MAX_FEED_BYTES = 256 * 2**20


class FeedTooLargeError(MoEFuseError, ValueError):
    """The random inputs of a model would be too large to make; the message names the input.

    A bad input (the CLI's exit code 2), not a failed verification: ``input_name`` is the graph
    input that went over the limit, ``nbytes`` its size.
    """

    input_name: str
    nbytes: int
    #: the message without its advice (the command line gives its own: it has no dims option)
    detail: str

    def __init__(self, message: str, input_name: str, nbytes: int, detail: str | None = None):
        """One line naming the input, its shape and size."""
        super().__init__(message, input_name=input_name, nbytes=nbytes, detail=detail or message)


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _dim_value(dim: Any, dim_values: Mapping[str, int], default_dim: int) -> int:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    if dim.HasField("dim_param") and dim.dim_param in dim_values:
        return int(dim_values[dim.dim_param])
    return default_dim


def feed_shapes(
    model: onnx.ModelProto,
    dim_values: Mapping[str, int] | None = None,
    *,
    default_dim: int = 3,
    max_bytes: int = MAX_FEED_BYTES,
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """``{input: (dtype, shape)}`` of the inputs :func:`random_feeds` makes, checked for size.

    Raises :class:`FeedTooLargeError` when they would take more than ``max_bytes`` together,
    naming the input that goes over; ``TypeError`` / ``ValueError`` for an input it cannot make
    (not a tensor, no shape, a dtype it has no random values for).
    """
    dims = {**DEFAULT_DIM_VALUES, **(dim_values or {})}
    initialized = {init.name for init in model.graph.initializer}
    shapes: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    total = 0
    for value in model.graph.input:
        if value.name in initialized:
            continue
        if not value.type.HasField("tensor_type"):
            raise TypeError(f"input {value.name!r} is not a tensor; random_feeds makes tensors")
        tensor_type = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        if not tensor_type.HasField("shape"):
            raise ValueError(f"input {value.name!r} has no shape; pass it yourself")
        shape = tuple(_dim_value(d, dims, default_dim) for d in tensor_type.shape.dim)
        if not (dtype in _FLOAT_DTYPES or dtype.kind in "iub"):
            raise TypeError(f"input {value.name!r} has dtype {dtype}; pass it yourself")
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        total += nbytes
        if total > max_bytes:
            detail = (
                f"input {value.name!r} of shape {list(shape)} ({dtype}) would take "
                f"{_size_text(nbytes)} of random values; the checker makes at most "
                f"{_size_text(max_bytes)} of inputs per model"
            )
            raise FeedTooLargeError(
                f"{detail}: pass smaller dim_values for its symbolic dims, or verify a smaller "
                "model",
                value.name,
                nbytes,
                detail=detail,
            )
        shapes[value.name] = (dtype, shape)
    return shapes


def random_feeds(
    model: onnx.ModelProto,
    seed: int,
    dim_values: Mapping[str, int] | None = None,
    *,
    default_dim: int = 3,
    scale: float = 1.0,
    max_bytes: int = MAX_FEED_BYTES,
) -> dict[str, np.ndarray]:
    """Fresh random values for every graph input that no initializer provides.

    Float inputs (float16/bfloat16/float32/float64) get ``scale * N(0, 1)`` values; integer inputs
    get integers in ``[0, 4)``; bool inputs random booleans. A symbolic dim takes its value from
    ``dim_values`` (over :data:`DEFAULT_DIM_VALUES`), an unnamed or unknown one ``default_dim``.
    The same ``seed`` gives the same feeds. Inputs over ``max_bytes`` in all raise
    :class:`FeedTooLargeError` before anything is allocated (:func:`feed_shapes`).
    """
    shapes = feed_shapes(model, dim_values, default_dim=default_dim, max_bytes=max_bytes)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in shapes.items():
        if dtype in _FLOAT_DTYPES:
            feeds[name] = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, 4, shape).astype(dtype)
        else:
            feeds[name] = rng.random(shape) < 0.5
    return feeds
