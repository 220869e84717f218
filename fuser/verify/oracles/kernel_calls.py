"""The numpy oracles called the way the kernel packages are: tensors and outputs by bind key.

:data:`KERNEL_ORACLES` maps a kernel name as the manifests spell it (``GroupedMatMul``,
``QMoE``, ``MoE``, ``MatMulNBitsQkv``) to a function ``(inputs, attrs) -> outputs``: ``inputs``
are the call's tensors by bind key (``inputT``, ``fc1ScalesT``, ``aT`` ...; an absent optional
input is missing or ``None``), ``attrs`` its attributes under their ONNX names, and the result
holds every output the oracle computes, by bind key (``outputT``; ``qT``, ``kT``, ``vT`` and,
where a skip input is given, ``residualT``). An attribute the call leaves out takes the default
its manifest declares (:data:`ATTRIBUTE_DEFAULTS`: ONNX Runtime's, from
:mod:`onnx_moe_fuse.contract.ops`, and pinned against the manifests by the tests).
:data:`BIND_KEYS` names the bind key of each ONNX input and output, as the manifests' ``args``
map them (``semantic``): the wgpu evaluator and the ORT node builders translate with it.

The kernel tests, the kernel benchmark and ``onnx-moe-fuse --self-check`` all use these, so a
kernel is always held to the same reference. One case goes beyond the oracles themselves: QMoE
and MoE with ``inter_size`` 0 (which the oracles, like ONNX Runtime, refuse) are defined here as
what the formula gives, the routed FC2 bias or zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from onnx_moe_fuse.contract.ops import MATMUL_NBITS_QKV, MOE, QMOE
from onnx_moe_fuse.verify.oracles.grouped_matmul import grouped_matmul
from onnx_moe_fuse.verify.oracles.matmul_nbits_qkv import matmul_nbits_qkv
from onnx_moe_fuse.verify.oracles.moe import moe, qmoe, route_moe, route_qmoe

__all__ = ["ATTRIBUTE_DEFAULTS", "BIND_KEYS", "KERNEL_ORACLES", "KernelOracle"]

#: ``(inputs by bind key, attributes) -> outputs by bind key``.
KernelOracle = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, np.ndarray]]

#: The attributes whose default changes an oracle's result, by kernel name: the defaults are
#: ONNX Runtime's (the manifests declare the same ones, as ``tests/verify/test_selfcheck.py``
#: checks).
_RESULT_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "GroupedMatMul": (),
    "QMoE": (
        "k",
        "activation_type",
        "expert_weight_bits",
        "swiglu_fusion",
        "activation_alpha",
        "activation_beta",
        "normalize_routing_weights",
    ),
    "MoE": (
        "k",
        "activation_type",
        "swiglu_fusion",
        "activation_alpha",
        "activation_beta",
        "normalize_routing_weights",
    ),
    "MatMulNBitsQkv": ("bits", "epsilon"),
}
_OPS = {op.name: op for op in (QMOE, MOE, MATMUL_NBITS_QKV)}
#: The attribute defaults of each kernel that change an oracle's result.
ATTRIBUTE_DEFAULTS: dict[str, dict[str, Any]] = {
    kernel: {name: _OPS[kernel].default(name) for name in names}
    for kernel, names in _RESULT_ATTRIBUTES.items()
}

_MOE_BIND_KEYS = {
    "input": "inputT",
    "router_probs": "routerT",
    "fc1_experts_weights": "fc1T",
    "fc1_experts_bias": "fc1BiasT",
    "fc2_experts_weights": "fc2T",
    "fc2_experts_bias": "fc2BiasT",
    "fc3_experts_weights": "fc3T",
    "fc3_experts_bias": "fc3BiasT",
    "output": "outputT",
}
#: Kernel name -> ``{ONNX input or output name: bind key}`` (an input missing here has no
#: bind key: no kernel implements it).
BIND_KEYS: dict[str, dict[str, str]] = {
    "GroupedMatMul": {
        "input": "inputT",
        "weights": "weightsT",
        "group_indices": "groupIndicesT",
        "bias": "biasT",
        "output": "outputT",
    },
    "QMoE": {
        **_MOE_BIND_KEYS,
        "fc1_scales": "fc1ScalesT",
        "fc2_scales": "fc2ScalesT",
        "fc3_scales": "fc3ScalesT",
        "fc1_zero_points": "fc1ZeroPointsT",
        "fc2_zero_points": "fc2ZeroPointsT",
        "fc3_zero_points": "fc3ZeroPointsT",
        "router_weights": "routerWeightsT",
    },
    "MoE": _MOE_BIND_KEYS,
    "MatMulNBitsQkv": {
        "A": "aT",
        "skip": "skipT",
        "norm_scale": "normScaleT",
        "q_B": "qBT",
        "q_scales": "qScalesT",
        "q_bias": "qBiasT",
        "k_B": "kBT",
        "k_scales": "kScalesT",
        "k_bias": "kBiasT",
        "v_B": "vBT",
        "v_scales": "vScalesT",
        "v_bias": "vBiasT",
        "Q": "qT",
        "K": "kT",
        "V": "vT",
        "input_skip_bias_sum": "residualT",
    },
}


def _with_defaults(kernel: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {**ATTRIBUTE_DEFAULTS[kernel], **attrs}


def grouped_matmul_call(
    inputs: Mapping[str, Any], attrs: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """``GroupedMatMul``: ``inputT, weightsT, groupIndicesT[, biasT]`` -> ``outputT``."""
    del attrs  # the operator has none
    return {
        "outputT": grouped_matmul(
            inputs["inputT"], inputs["weightsT"], inputs["groupIndicesT"], inputs.get("biasT")
        )
    }


def _zero_inter(
    inputs: Mapping[str, Any], route: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
) -> np.ndarray:
    """``inter_size`` 0: each token gets its routed FC2 biases (zeros without a bias)."""
    x = inputs["inputT"]
    out = np.zeros((x.size // x.shape[-1], x.shape[-1]))
    bias = inputs.get("fc2BiasT")
    if bias is not None and out.shape[0]:
        idx, weights = route(inputs["routerT"])
        out = (weights[..., None] * bias[idx].astype(np.float64)).sum(axis=1)
    return out.reshape(x.shape).astype(np.float32)


def qmoe_call(inputs: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``com.microsoft.QMoE`` -> ``outputT``; ``block_size`` 0 means column-wise.

    Inputs: ``inputT, routerT, fc1T, fc1ScalesT, fc2T, fc2ScalesT``; optional ``fc1BiasT``,
    ``fc2BiasT``, ``routerWeightsT``.
    """
    a = _with_defaults("QMoE", attrs)
    mix = inputs.get("routerWeightsT")
    normalize = a["normalize_routing_weights"]
    if inputs["fc2T"].shape[2] == 0:
        out = _zero_inter(
            inputs,
            lambda router: route_qmoe(
                router, a["k"], router_weights=mix, normalize_routing_weights=normalize
            ),
        )
        return {"outputT": out}
    out = qmoe(
        *(inputs[key] for key in ("inputT", "routerT", "fc1T", "fc1ScalesT", "fc2T", "fc2ScalesT")),
        k=a["k"],
        activation_type=a["activation_type"],
        expert_weight_bits=a["expert_weight_bits"],
        block_size=a.get("block_size") or None,
        swiglu_fusion=a["swiglu_fusion"],
        activation_alpha=a["activation_alpha"],
        activation_beta=a["activation_beta"],
        swiglu_limit=a.get("swiglu_limit"),
        fc1_bias=inputs.get("fc1BiasT"),
        fc2_bias=inputs.get("fc2BiasT"),
        normalize_routing_weights=normalize,
        router_weights=mix,
    )
    return {"outputT": out}


def moe_call(inputs: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``com.microsoft.MoE`` -> ``outputT``.

    Inputs: ``inputT, routerT, fc1T, fc2T``; optional ``fc1BiasT, fc2BiasT, fc3T, fc3BiasT``.
    """
    a = _with_defaults("MoE", attrs)
    normalize = a["normalize_routing_weights"]
    if inputs["fc2T"].shape[2] == 0:
        out = _zero_inter(inputs, lambda router: route_moe(router, a["k"], normalize))
        return {"outputT": out}
    out = moe(
        inputs["inputT"],
        inputs["routerT"],
        inputs["fc1T"],
        inputs["fc2T"],
        fc1_bias=inputs.get("fc1BiasT"),
        fc2_bias=inputs.get("fc2BiasT"),
        fc3=inputs.get("fc3T"),
        fc3_bias=inputs.get("fc3BiasT"),
        k=a["k"],
        activation_type=a["activation_type"],
        swiglu_fusion=a["swiglu_fusion"],
        normalize_routing_weights=normalize,
        activation_alpha=a["activation_alpha"],
        activation_beta=a["activation_beta"],
        swiglu_limit=a.get("swiglu_limit"),
    )
    return {"outputT": out}


def matmul_nbits_qkv_call(
    inputs: Mapping[str, Any], attrs: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """``com.microsoft.MatMulNBitsQkv`` -> ``qT, kT, vT`` and, with ``skipT``, ``residualT``.

    Inputs: ``aT, normScaleT, qBT, qScalesT, kBT, kScalesT, vBT, vScalesT``; optional ``skipT``.
    ``residualT`` is ``A + skip``.
    """
    a = _with_defaults("MatMulNBitsQkv", attrs)
    weights = ("qBT", "qScalesT", "kBT", "kScalesT", "vBT", "vScalesT")
    q, k, v, residual = matmul_nbits_qkv(
        inputs["aT"],
        inputs.get("skipT"),
        inputs["normScaleT"],
        *(inputs[key] for key in weights),
        K=a["K"],
        Nq=a["Nq"],
        Nkv=a["Nkv"],
        block_size=a["block_size"],
        bits=a["bits"],
        epsilon=a["epsilon"],
    )
    out = {"qT": q, "kT": k, "vT": v}
    if residual is not None:
        out["residualT"] = residual
    return out


#: Kernel name (as in the manifests) -> its oracle by bind key.
KERNEL_ORACLES: dict[str, KernelOracle] = {
    "GroupedMatMul": grouped_matmul_call,
    "QMoE": qmoe_call,
    "MoE": moe_call,
    "MatMulNBitsQkv": matmul_nbits_qkv_call,
}
