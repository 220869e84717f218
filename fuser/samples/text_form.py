"""A small writer of ONNX text-form graphs (``onnx.parser`` syntax) with numpy initializers.

The samples are written as ONNX text, one line per node, so that a generated model reads like the
pattern it stands for. Weights are not spelled as text literals: they are attached as
initializers (``onnx.numpy_helper.from_array``) after the text is parsed. Small constants (axes,
``k``, shapes, clamp limits, alpha) are ``Constant`` nodes in the text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser

__all__ = ["GraphText"]

AttrValue = int | float | str


def _format_float(value: float) -> str:
    text = format(float(value), ".9g")
    if not any(c in text for c in ".eEn"):  # keep it a float literal ("nan"/"inf" aside)
        text += ".0"
    return text


def _format_attr(name: str, value: AttrValue) -> str:
    if isinstance(value, bool):
        raise TypeError(f"attribute {name}: write booleans as 0/1 ints")
    if isinstance(value, int):
        return f"{name}={value}"
    if isinstance(value, float):
        return f"{name}={_format_float(value)}"
    if isinstance(value, str):
        return f"{name}={json.dumps(value)}"
    raise TypeError(f"attribute {name}: unsupported value {value!r}")


class GraphText:
    """Accumulates the text of one ONNX graph and the initializers it refers to."""

    def __init__(self, name: str) -> None:
        """Start an empty graph called ``name`` (a valid identifier)."""
        self.name = name
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.lines: list[str] = []
        self.initializers: dict[str, np.ndarray] = {}
        self._names: set[str] = set()
        self._consts: dict[tuple[str, tuple[object, ...]], str] = {}

    # -- names -----------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """Return ``base`` or ``base_<n>``: a value name not used before in this graph."""
        name = base
        n = 1
        while name in self._names:
            n += 1
            name = f"{base}_{n}"
        self._names.add(name)
        return name

    # -- signature -------------------------------------------------------------------------
    def add_input(self, type_text: str, name: str) -> str:
        """Declare a graph input, e.g. ``add_input("float[T,64]", "x")``."""
        self._names.add(name)
        self.inputs.append(f"{type_text} {name}")
        return name

    def add_output(self, type_text: str, name: str) -> str:
        """Declare a graph output (the value must be produced by a node)."""
        self.outputs.append(f"{type_text} {name}")
        return name

    def add_initializer(self, name: str, array: np.ndarray) -> str:
        """Attach a numpy array as an initializer named ``name`` (ml_dtypes int4 included)."""
        if name in self._names:
            raise ValueError(f"value name {name!r} used twice")
        self._names.add(name)
        self.initializers[name] = array
        return name

    # -- nodes -----------------------------------------------------------------------------
    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        out: str | Sequence[str] | None = None,
        *,
        domain: str = "",
        **attrs: AttrValue,
    ) -> str:
        """Append ``out = op_type<attrs>(inputs)`` and return the (first) output name.

        ``out`` may be one name, several names (for multi-output ops: use :meth:`node_multi`),
        or None for a fresh name derived from the op type. An empty string in ``inputs`` is an
        omitted optional input.
        """
        outs = self._out_names(op_type, out)
        self._emit(op_type, inputs, outs, domain, attrs)
        return outs[0]

    def node_multi(
        self,
        op_type: str,
        inputs: Sequence[str],
        outs: Sequence[str],
        *,
        domain: str = "",
        **attrs: AttrValue,
    ) -> tuple[str, ...]:
        """Append a node with several outputs and return their names (made unique)."""
        names = [self.fresh(o) for o in outs]
        self._emit(op_type, inputs, names, domain, attrs)
        return tuple(names)

    def i64(self, *values: int) -> str:
        """Return the name of an ``int64[n]`` Constant (one node per distinct value list)."""
        key = ("i64", tuple(int(v) for v in values))
        if key not in self._consts:
            body = ",".join(str(int(v)) for v in values)
            base = "c_" + "_".join(str(int(v)).replace("-", "m") for v in values)
            if len(base) > 40:
                base = "c_i64"
            name = self.fresh(base)
            self.lines.append(f"{name} = Constant<value=int64[{len(values)}]{{{body}}}>()")
            self._consts[key] = name
        return self._consts[key]

    def f32(self, value: float) -> str:
        """Return the name of a scalar float Constant (one node per distinct value)."""
        key = ("f32", (float(value),))
        if key not in self._consts:
            text = _format_float(value)
            base = "c_f_" + text.replace("-", "m").replace(".", "p").replace("+", "")
            name = self.fresh(base)
            self.lines.append(f"{name} = Constant<value=float{{{text}}}>()")
            self._consts[key] = name
        return self._consts[key]

    # -- model -----------------------------------------------------------------------------
    def text(self, opset: int, ir_version: int, extra_opsets: Mapping[str, int]) -> str:
        """Return the model in ONNX text form (initializers excluded)."""
        imports = [f'"" : {opset}'] + [f'"{d}" : {v}' for d, v in extra_opsets.items()]
        header = (
            f"<ir_version: {ir_version}, opset_import: [{', '.join(imports)}], "
            f'producer_name: "onnx_moe_fuse.samples">'
        )
        sig = f"{self.name} ({', '.join(self.inputs)}) => ({', '.join(self.outputs)})"
        body = "\n".join(f"  {line}" for line in self.lines)
        return f"{header}\n{sig}\n{{\n{body}\n}}\n"

    def to_model(
        self,
        opset: int,
        ir_version: int = 10,
        extra_opsets: Mapping[str, int] | None = None,
    ) -> onnx.ModelProto:
        """Parse the text and attach the initializers; returns a new ModelProto."""
        model = onnx.parser.parse_model(self.text(opset, ir_version, extra_opsets or {}))
        for name, array in self.initializers.items():
            model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
        return model

    # -- internals -------------------------------------------------------------------------
    def _out_names(self, op_type: str, out: str | Sequence[str] | None) -> list[str]:
        if out is None:
            return [self.fresh(op_type.lower())]
        if isinstance(out, str):
            return [self.fresh(out)]
        return [self.fresh(o) for o in out]

    def _emit(
        self,
        op_type: str,
        inputs: Sequence[str],
        outs: Sequence[str],
        domain: str,
        attrs: Mapping[str, AttrValue],
    ) -> None:
        op = f"{domain}.{op_type}" if domain else op_type
        attr_text = ", ".join(_format_attr(k, v) for k, v in attrs.items())
        if attr_text:
            op += f"<{attr_text}>"
        self.lines.append(f"{', '.join(outs)} = {op}({', '.join(inputs)})")
