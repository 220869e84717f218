"""The ``com.microsoft`` ops the fuser writes or reads: their inputs, outputs and attributes.

One :class:`ContribOp` per op (:data:`MOE`, :data:`QMOE`, :data:`MATMUL_NBITS_QKV` and
:data:`MATMUL_NBITS`, which the canonical passes, the reference path and the QKV rule read):
ONNX Runtime's ordered inputs (name, optional), outputs, and every attribute with its default
(None where the schema has none: the attribute is required, or its absence means something of
its own, as ``swiglu_limit``'s "no clamp" and ``block_size``'s "column-wise").

A node's inputs are positional, an absent optional one written ``""``; code that builds or
reads a node does it by name through :meth:`ContribOp.input_list` and
:meth:`ContribOp.named_inputs`, so no module counts positions by hand.

Source: onnxruntime 1.32.0's schema registry (``onnxruntime.capi.onnxruntime_pybind11_state.
get_all_operator_schema()``), read 2026-12-01; ``tests/contract/test_ops.py`` checks every input,
output and default against the installed ORT 1.32. QMoE's inputs 15-20 (FP4/FP8 global and
activation scales) are new in 1.32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "ACTIVATION_TYPES",
    "CONTRIB_OPS",
    "MATMUL_NBITS",
    "MATMUL_NBITS_QKV",
    "MOE",
    "MS_DOMAIN",
    "QMOE",
    "ContribOp",
    "Port",
]

#: The domain of ONNX Runtime's contrib ops.
MS_DOMAIN = "com.microsoft"

#: MoE's and QMoE's ``activation_type`` values (ORT 1.32's MoE/QMoE CPU kernels run them all).
ACTIVATION_TYPES: tuple[str, ...] = ("relu", "gelu", "silu", "swiglu", "identity")

V = TypeVar("V")


@dataclass(frozen=True)
class Port:
    """One input or output of an op: its ONNX name, and whether it may be absent."""

    name: str
    optional: bool = False


@dataclass(frozen=True)
class ContribOp:
    """One ``com.microsoft`` op: ordered inputs and outputs, attributes with ORT's defaults.

    ``attributes`` maps every attribute name to its default, None where the schema gives none
    (see the module docstring); ``required`` names the attributes a node must carry.
    """

    name: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: Mapping[str, Any] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    domain: str = MS_DOMAIN

    @property
    def qualified_name(self) -> str:
        """``com.microsoft.QMoE``."""
        return f"{self.domain}.{self.name}"

    @property
    def input_names(self) -> tuple[str, ...]:
        """The input names in ONNX order."""
        return tuple(p.name for p in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The output names in ONNX order."""
        return tuple(p.name for p in self.outputs)

    @property
    def attribute_names(self) -> frozenset[str]:
        """Every attribute the schema declares."""
        return frozenset(self.attributes)

    @property
    def defaults(self) -> dict[str, Any]:
        """The attributes that have a default, with it."""
        return {k: v for k, v in self.attributes.items() if v is not None}

    def index(self, name: str) -> int:
        """The position of input ``name`` (``KeyError`` for a name the op does not have)."""
        try:
            return self.input_names.index(name)
        except ValueError:
            raise KeyError(f"{self.qualified_name} has no input {name!r}") from None

    def default(self, name: str) -> Any:
        """ORT's default for attribute ``name`` (None where it has none)."""
        if name not in self.attributes:
            raise KeyError(f"{self.qualified_name} has no attribute {name!r}")
        return self.attributes[name]

    def with_defaults(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """``attrs`` over the defaults: what a node with these attributes means."""
        return {**self.defaults, **attrs}

    def checked_attributes(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`with_defaults` of a node's ``attrs``, refusing what ORT's schema would.

        ``ValueError`` for an attribute the op does not have, or a required one missing.
        """
        unknown = sorted(set(attrs) - set(self.attributes))
        if unknown:
            raise ValueError(f"{self.qualified_name} has no attributes {unknown}")
        missing = sorted(self.required - set(attrs))
        if missing:
            raise ValueError(f"{self.qualified_name} needs the attributes {missing}")
        return self.with_defaults(attrs)

    def input_list(
        self, values: Mapping[str, V | None], *, every_slot: bool = False
    ) -> list[V | None]:
        """The node's inputs in ONNX order from ``{input name: value}``.

        An input left out or None is absent (None in the list); trailing absent inputs are
        dropped, as ORT writes a node, unless ``every_slot`` (one entry per input of the op).
        ``KeyError`` for a name the op does not have, ``ValueError`` for a required input that
        is absent.
        """
        unknown = set(values) - set(self.input_names)
        if unknown:
            raise KeyError(f"{self.qualified_name} has no inputs {sorted(unknown)}")
        out = [values.get(p.name) for p in self.inputs]
        missing = [p.name for p, v in zip(self.inputs, out, strict=True) if v is None]
        required = [n for n in missing if not self._port(n).optional]
        if required:
            raise ValueError(f"{self.qualified_name} needs the inputs {required}")
        while out and out[-1] is None and not every_slot:
            out.pop()
        return out

    def named_inputs(self, values: Sequence[V | None]) -> dict[str, V | None]:
        """``{input name: value}`` for every input of the op from a node's positional inputs.

        Positions past ``values`` are None (absent). ``ValueError`` when there are more values
        than the op has inputs.
        """
        if len(values) > len(self.inputs):
            raise ValueError(
                f"{self.qualified_name} has {len(self.inputs)} inputs, got {len(values)}"
            )
        padded = list(values) + [None] * (len(self.inputs) - len(values))
        return dict(zip(self.input_names, padded, strict=True))

    def _port(self, name: str) -> Port:
        return self.inputs[self.index(name)]


def _in_order(*ports: tuple[str, bool]) -> tuple[Port, ...]:
    """Ports from ``(name, optional)`` pairs, in ONNX order."""
    return tuple(Port(name, optional) for name, optional in ports)


_R, _O = False, True  # required, optional

# The attributes MoE and QMoE share, with ORT 1.32's defaults.
_MOE_ATTRIBUTES: dict[str, Any] = {
    "k": 1,
    "activation_type": "relu",
    "normalize_routing_weights": 0,
    "use_sparse_mixer": 0,
    "swiglu_fusion": 0,
    "activation_alpha": 1.0,
    "activation_beta": 0.0,
    "swiglu_limit": None,  # absent: no clamp
    "swiglu_limit_after_activation": 0,  # 0: clamp before the activation
}

#: ``com.microsoft.MoE``: float experts.
MOE = ContribOp(
    name="MoE",
    inputs=_in_order(
        ("input", _R),
        ("router_probs", _R),
        ("fc1_experts_weights", _R),
        ("fc1_experts_bias", _O),
        ("fc2_experts_weights", _R),
        ("fc2_experts_bias", _O),
        ("fc3_experts_weights", _O),
        ("fc3_experts_bias", _O),
    ),
    outputs=_in_order(("output", _R)),
    attributes=_MOE_ATTRIBUTES,
)

#: ``com.microsoft.QMoE``: integer experts (raw ``[E, N, K / pack]`` layout, see ``packing``).
QMOE = ContribOp(
    name="QMoE",
    inputs=_in_order(
        ("input", _R),
        ("router_probs", _R),
        ("fc1_experts_weights", _R),
        ("fc1_scales", _O),
        ("fc1_experts_bias", _O),
        ("fc2_experts_weights", _R),
        ("fc2_scales", _O),
        ("fc2_experts_bias", _O),
        ("fc3_experts_weights", _O),
        ("fc3_scales", _O),
        ("fc3_experts_bias", _O),
        ("fc1_zero_points", _O),
        ("fc2_zero_points", _O),
        ("fc3_zero_points", _O),
        ("router_weights", _O),
        ("fc1_global_scale", _O),
        ("fc2_global_scale", _O),
        ("fc1_act_scale", _O),
        ("fc2_act_scale", _O),
        ("fc1_act_block_scale", _O),
        ("fc2_act_block_scale", _O),
    ),
    outputs=_in_order(("output", _R)),
    attributes={
        **_MOE_ATTRIBUTES,
        "expert_weight_bits": 4,
        "fc1_expert_weight_bits": None,  # absent: expert_weight_bits
        "fc2_expert_weight_bits": None,
        "fc3_expert_weight_bits": None,
        "block_size": None,  # absent: one scale per output row (column-wise)
        "quant_type": "int",
        "weights_prepacked": -1,  # -1: the provider's choice (CUDA: CUTLASS-prepacked)
        "accuracy_level": 0,
    },
)

#: ``com.microsoft.MatMulNBits``: ``Y = A @ dequant(B).T (+ bias)``.
MATMUL_NBITS = ContribOp(
    name="MatMulNBits",
    inputs=_in_order(
        ("A", _R),
        ("B", _R),
        ("scales", _R),
        ("zero_points", _O),
        ("g_idx", _O),
        ("bias", _O),
    ),
    outputs=_in_order(("Y", _R)),
    attributes={
        "K": None,
        "N": None,
        "bits": 4,
        "block_size": None,
        "accuracy_level": 0,
        "weight_prepacked": 0,
    },
    required=frozenset({"K", "N", "block_size"}),
)

#: ``com.microsoft.MatMulNBitsQkv``: RMS norm (+ skip) and three 4-bit projections.
MATMUL_NBITS_QKV = ContribOp(
    name="MatMulNBitsQkv",
    inputs=_in_order(
        ("A", _R),
        ("skip", _O),
        ("norm_scale", _R),
        ("q_B", _R),
        ("q_scales", _R),
        ("q_bias", _O),
        ("k_B", _R),
        ("k_scales", _R),
        ("k_bias", _O),
        ("v_B", _R),
        ("v_scales", _R),
        ("v_bias", _O),
    ),
    outputs=_in_order(("Q", _R), ("K", _R), ("V", _R), ("input_skip_bias_sum", _O)),
    attributes={
        "K": None,
        "Nq": None,
        "Nkv": None,
        "bits": 4,
        "block_size": None,
        "epsilon": 9.999999974752427e-07,  # 1e-6 as float32
        "accuracy_level": 0,
    },
    required=frozenset({"K", "Nq", "Nkv", "block_size"}),
)

#: Every op above by name.
CONTRIB_OPS: dict[str, ContribOp] = {
    op.name: op for op in (MOE, QMOE, MATMUL_NBITS, MATMUL_NBITS_QKV)
}
