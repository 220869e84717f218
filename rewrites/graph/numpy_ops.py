"""ONNX elementwise ops as the numpy functions that compute them, for evaluating small tables.

One home for the mapping that the proofs evaluating constant or enumerated values use (the
elementwise chains of :mod:`..canonical.experts.value_proofs`, the expert-id tables of the
analysis of meaning). On the inputs those evaluate (small integer or boolean arrays, or float
samples under ``np.errstate``) each numpy function computes what the ONNX op does, broadcasting
included.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["BINARY_OPS", "UNARY_OPS", "COMPARISONS"]

#: the ordering comparisons (a subset of BINARY_OPS), whose results depend on order, not equality
COMPARISONS = ("Less", "LessOrEqual", "Greater", "GreaterOrEqual")

BINARY_OPS: dict[str, Callable] = {
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Equal": np.equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Min": np.minimum,
    "Max": np.maximum,
}

UNARY_OPS: dict[str, Callable] = {
    "Not": np.logical_not,
    "IsNaN": np.isnan,
    "Neg": np.negative,
    "Abs": np.abs,
    "Identity": lambda a: a,
}
