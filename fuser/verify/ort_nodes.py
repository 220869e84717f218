"""Single ONNX Runtime nodes (and the MatMulNBitsQkv composition) as references on the CPU.

The tests, the benchmarks and the oracle checks all run ORT the same way, from here:

* :func:`node_model` / :func:`run_node`: one node with its inputs at ORT's positions (``None``
  becomes ``""``, trailing absent inputs are dropped), the chosen positions as initializers and
  the others as graph inputs, opsets ``"" 21`` and ``com.microsoft 1``, IR version 10.
* :func:`kernel_node_model` / :func:`run_kernel_node`: a QMoE or MoE kernel call (tensors by bind
  key, attributes as the kernel takes them) as that one node, its inputs at the positions of
  :mod:`onnx_moe_fuse.contract.ops` (bind keys translated by
  :data:`onnx_moe_fuse.verify.oracles.kernel_calls.BIND_KEYS`), every attribute written
  explicitly (absent ones at ORT's defaults, which the manifests declare too) and ORT's exact
  modes chosen: ``accuracy_level`` 0
  (no int8 activations), no sparse mixer, no prepacked weights (QMoE's ``quant_type``,
  ``weights_prepacked`` and ``accuracy_level`` are the ort-cpu target's, from
  :mod:`onnx_moe_fuse.contract.targets`).
* :func:`qkv_composition_model` / :func:`run_qkv_composition`: the graph ``MatMulNBitsQkv``
  replaces (ORT has no CPU kernel for it): ``SimplifiedLayerNormalization`` or
  ``com.microsoft.SkipSimplifiedLayerNormalization``, then three ``com.microsoft.MatMulNBits``
  (bits 4, block 32, ``accuracy_level`` 0), weights and norm scale as initializers.
* :func:`session`: graph optimisations off (ORT's optimiser would fuse or quantise), one
  intra-op thread, quiet logging, CPU provider, unless told otherwise.

``onnxruntime`` (an optional dependency: the ``test`` extra) is imported only by :func:`session`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_moe_fuse.contract.ops import (
    MATMUL_NBITS,
    MATMUL_NBITS_QKV,
    MOE,
    MS_DOMAIN,
    QMOE,
    ContribOp,
)
from onnx_moe_fuse.contract.targets import CONTRACTS
from onnx_moe_fuse.verify.oracles.kernel_calls import BIND_KEYS

__all__ = [
    "kernel_node_attributes",
    "kernel_node_inputs",
    "kernel_node_model",
    "make_model",
    "node_model",
    "qkv_composition_model",
    "run_kernel_node",
    "run_node",
    "run_qkv_composition",
    "session",
]

#: Opsets of every model built here.
OPSETS = {"": 21, MS_DOMAIN: 1}
IR_VERSION = 10

#: The ops :func:`kernel_node_model` builds, by kernel name (the contract has their inputs).
_KERNEL_NODES: dict[str, ContribOp] = {"QMoE": QMOE, "MoE": MOE}


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    name: str = "g",
    opsets: Mapping[str, int] | None = None,
) -> onnx.ModelProto:
    """A model of one graph at :data:`OPSETS` (or ``opsets``) and IR version 10."""
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(initializers))
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in (opsets or OPSETS).items()],
        ir_version=IR_VERSION,
    )


def session(
    model: onnx.ModelProto,
    *,
    threads: int | None = 1,
    optimize: bool = False,
    log_severity_level: int = 4,
) -> Any:
    """An ``onnxruntime.InferenceSession`` on the CPU provider.

    Graph optimisations are off unless ``optimize``; ``threads=None`` keeps ORT's default
    intra-op thread count.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = log_severity_level
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def node_model(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    attrs: Mapping[str, Any],
    *,
    const: Collection[int] = (),
    domain: str = MS_DOMAIN,
    outputs: Sequence[str] = ("out",),
    output_dtype: Any = None,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One node: input ``i`` is named ``in{i}``, an initializer when ``i`` is in ``const``.

    Returns the model and its feeds. The outputs have ``output_dtype`` (default: the first
    input's dtype) and no declared shape.
    """
    names: list[str] = []
    graph_inputs, initializers, feeds = [], [], {}
    for i, arr in enumerate(inputs):
        if arr is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if i in const:
            initializers.append(numpy_helper.from_array(arr, name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(arr.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, arr.shape))
            feeds[name] = arr
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op_type, names, list(outputs), domain=domain, **attrs)
    dtype = np.dtype(output_dtype if output_dtype is not None else inputs[0].dtype)
    out_elem = helper.np_dtype_to_tensor_dtype(dtype)
    value_infos = [helper.make_tensor_value_info(o, out_elem, None) for o in outputs]
    opsets = {**OPSETS, domain: 1} if domain else OPSETS
    return make_model([node], graph_inputs, value_infos, initializers, opsets=opsets), feeds


def run_node(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    attrs: Mapping[str, Any],
    *,
    const: Collection[int] = (),
    domain: str = MS_DOMAIN,
    **session_options: Any,
) -> np.ndarray:
    """Run one node (:func:`node_model`) on ORT CPU; return its only output."""
    model, feeds = node_model(op_type, inputs, attrs, const=const, domain=domain)
    return session(model, **session_options).run(["out"], feeds)[0]


# -- QMoE / MoE kernel calls ----------------------------------------------------------------


def kernel_node_inputs(kernel: str, call: Mapping[str, Any]) -> list[np.ndarray | None]:
    """The call's tensors (by bind key) at the ONNX input positions of ``kernel``'s op.

    None for an absent input; trailing absent ones are left out.
    """
    keys = BIND_KEYS[kernel]
    op = _KERNEL_NODES[kernel]
    return op.input_list({name: call.get(keys[name]) for name in op.input_names if name in keys})


def kernel_node_attributes(kernel: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Every attribute of the QMoE / MoE node for a kernel call, written explicitly."""
    a = _KERNEL_NODES[kernel].with_defaults(attrs)  # absent ones at ORT's (the manifests') defaults
    full: dict[str, Any] = {
        "k": a["k"],
        "activation_type": a["activation_type"],
        "swiglu_fusion": a["swiglu_fusion"],
        "normalize_routing_weights": a["normalize_routing_weights"],
        "activation_alpha": float(a["activation_alpha"]),
        "activation_beta": float(a["activation_beta"]),
        "use_sparse_mixer": 0,
        "swiglu_limit_after_activation": 0,
    }
    if kernel == "QMoE":
        full["expert_weight_bits"] = a["expert_weight_bits"]
        # what ORT CPU needs for the raw layout and exact activations: the target contract's
        full.update(CONTRACTS["ort-cpu"]["QMoE"].fixed)
        if a.get("block_size"):
            full["block_size"] = a["block_size"]
    if "swiglu_limit" in a:
        full["swiglu_limit"] = float(a["swiglu_limit"])
    return full


def kernel_node_model(
    kernel: str,
    call: Mapping[str, Any],
    attrs: Mapping[str, Any],
    *,
    const_keys: Iterable[str] = (),
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A ``QMoE`` / ``MoE`` kernel call as one ORT node; ``const_keys`` become initializers.

    Returns the model (output ``out``, float32) and its feeds.
    """
    keys = set(const_keys)
    bind_keys = BIND_KEYS[kernel]
    const = {
        i for i, name in enumerate(_KERNEL_NODES[kernel].input_names) if bind_keys.get(name) in keys
    }
    return node_model(
        kernel,
        kernel_node_inputs(kernel, call),
        kernel_node_attributes(kernel, attrs),
        const=const,
        output_dtype=np.float32,
    )


def run_kernel_node(
    kernel: str,
    call: Mapping[str, Any],
    attrs: Mapping[str, Any],
    *,
    const_keys: Iterable[str] = (),
    **session_options: Any,
) -> np.ndarray:
    """ORT CPU's ``outputT`` for a QMoE / MoE kernel call (:func:`kernel_node_model`)."""
    model, feeds = kernel_node_model(kernel, call, attrs, const_keys=const_keys)
    return session(model, **session_options).run(["out"], feeds)[0]


# -- the MatMulNBitsQkv composition --------------------------------------------------------------


def qkv_composition_model(
    call: Mapping[str, Any], attrs: Mapping[str, Any]
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, str]]:
    """The graph MatMulNBitsQkv replaces, for a kernel call by bind key.

    Returns the model, its feeds and its output names by bind key (``qT``, ``kT``, ``vT`` and,
    with ``skipT``, ``residualT``).
    """
    a = call["aT"]
    elem = helper.np_dtype_to_tensor_dtype(a.dtype)
    epsilon = MATMUL_NBITS_QKV.with_defaults(attrs)["epsilon"]
    inputs = [helper.make_tensor_value_info("A", elem, a.shape)]
    feeds = {"A": a}
    inits = [numpy_helper.from_array(call["normScaleT"], "gamma")]
    skip = call.get("skipT")
    if skip is not None:
        inputs.append(helper.make_tensor_value_info("skip", elem, skip.shape))
        feeds["skip"] = skip
        norm = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["A", "skip", "gamma"],
            ["normed", "", "", "residual"],
            domain=MS_DOMAIN,
            epsilon=epsilon,
        )
    else:
        norm = helper.make_node(
            "SimplifiedLayerNormalization",
            ["A", "gamma"],
            ["normed"],
            axis=-1,
            epsilon=epsilon,
            stash_type=1,
        )
    nodes = [norm]
    names = {"qT": "Q", "kT": "K", "vT": "V"}
    for p, n in (("q", attrs["Nq"]), ("k", attrs["Nkv"]), ("v", attrs["Nkv"])):
        inits += [
            numpy_helper.from_array(call[f"{p}BT"], f"{p}_B"),
            numpy_helper.from_array(call[f"{p}ScalesT"], f"{p}_scales"),
        ]
        nodes.append(
            helper.make_node(
                MATMUL_NBITS.name,
                MATMUL_NBITS.input_list({"A": "normed", "B": f"{p}_B", "scales": f"{p}_scales"}),
                [names[f"{p}T"]],
                domain=MATMUL_NBITS.domain,
                K=attrs["K"],
                N=n,
                bits=4,
                block_size=32,
                accuracy_level=0,
            )
        )
    if skip is not None:
        names["residualT"] = "residual"
    outputs = [helper.make_tensor_value_info(o, elem, None) for o in names.values()]
    return make_model(nodes, inputs, outputs, inits, name="qkv_composition"), feeds, names


def run_qkv_composition(
    call: Mapping[str, Any], attrs: Mapping[str, Any], **session_options: Any
) -> dict[str, np.ndarray]:
    """ORT CPU runs :func:`qkv_composition_model`; returns the outputs by bind key."""
    model, feeds, names = qkv_composition_model(call, attrs)
    got = session(model, **session_options).run(list(names.values()), feeds)
    return dict(zip(names, got, strict=True))
