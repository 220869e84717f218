"""Test and benchmark cases of kernel packages (``test.json`` / ``bench.json``).

A case names its inputs by bind key. Each input is either literal data
(``{"dtype", "shape", "data"}``) or drawn afresh at every run
(``{"random": "normal" | "uniform" | "integers", "dtype", "shape", ...}``). A case may
give ``expected`` outputs (literal), an ``error`` (a substring of the ``ValueError``
the call must raise), ``attrs``, ``tunables``, ``deviceLimits`` and a ``tolerance``.
Cases without ``expected`` are checked against the package's oracle by the tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnx_moe_fuse.kernels.manifest import ManifestError
from onnx_moe_fuse.kernels.planner import MANIFEST_DTYPES

_CASE_KEYS = {"name", "description", "source", "inputs", "expected", "error", "attrs",
              "tunables", "deviceLimits", "tolerance", "variants"}  # fmt: skip
_INPUT_KEYS = {"dtype", "shape", "data", "random", "low", "high", "scale"}


@dataclass(frozen=True)
class KernelCase:
    """One case of a ``test.json`` or ``bench.json`` file."""

    name: str
    inputs: dict[str, dict[str, Any]]
    expected: dict[str, dict[str, Any]] | None = None
    error: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    tunables: dict[str, Any] = field(default_factory=dict)
    device_limits: dict[str, int] = field(default_factory=dict)
    rtol: float = 1e-5
    atol: float = 1e-5
    variants: tuple[str, ...] | None = None
    description: str = ""

    def materialize(self, rng: np.random.Generator) -> dict[str, np.ndarray | None]:
        """The case's input arrays; random ones drawn from ``rng``."""
        return {key: _array(spec, rng) for key, spec in self.inputs.items()}

    def expected_arrays(self) -> dict[str, np.ndarray] | None:
        """Literal expected outputs, if the case gives them."""
        if self.expected is None:
            return None
        return {key: _array(spec, None) for key, spec in self.expected.items()}


def _array(spec: dict[str, Any] | None, rng: np.random.Generator | None) -> np.ndarray | None:
    if spec is None:
        return None
    dtype = MANIFEST_DTYPES[spec["dtype"]]
    shape = tuple(spec["shape"])
    if "data" in spec:
        return np.asarray(spec["data"], dtype=dtype).reshape(shape)
    assert rng is not None
    kind = spec["random"]
    if kind == "integers":
        return rng.integers(spec["low"], spec["high"], size=shape).astype(dtype)
    if kind == "uniform":
        return rng.uniform(spec.get("low", -1.0), spec.get("high", 1.0), size=shape).astype(dtype)
    return (rng.standard_normal(shape) * spec.get("scale", 1.0)).astype(dtype)


def load_cases(path: str | Path) -> list[KernelCase]:
    """Read a ``test.json``/``bench.json`` file strictly (unknown keys are errors)."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or set(data) - {"kernel", "version", "cases"}:
        raise ManifestError(f"{path}: expected an object with 'kernel', 'version' and 'cases'")
    cases = []
    names: set[str] = set()
    for i, item in enumerate(data.get("cases", [])):
        where = f"{path}: cases[{i}]"
        unknown = set(item) - _CASE_KEYS
        if unknown:
            raise ManifestError(f"{where}.{sorted(unknown)[0]}: unknown key")
        name = item.get("name")
        if not isinstance(name, str) or name in names:
            raise ManifestError(f"{where}.name: missing or duplicate case name {name!r}")
        names.add(name)
        for group in ("inputs", "expected"):
            for key, spec in (item.get(group) or {}).items():
                if spec is None:
                    continue
                unknown = set(spec) - _INPUT_KEYS
                if unknown:
                    raise ManifestError(f"{where}.{group}.{key}.{sorted(unknown)[0]}: unknown key")
                if spec.get("dtype") not in MANIFEST_DTYPES:
                    raise ManifestError(f"{where}.{group}.{key}.dtype: unknown dtype")
                if ("data" in spec) == ("random" in spec):
                    raise ManifestError(f"{where}.{group}.{key}: give exactly one of data, random")
        tolerance = item.get("tolerance", {})
        cases.append(
            KernelCase(
                name=name,
                inputs=item.get("inputs", {}),
                expected=item.get("expected"),
                error=item.get("error"),
                attrs=item.get("attrs", {}),
                tunables=item.get("tunables", {}),
                device_limits=item.get("deviceLimits", {}),
                rtol=float(tolerance.get("rtol", 1e-5)),
                atol=float(tolerance.get("atol", 1e-5)),
                variants=tuple(item["variants"]) if "variants" in item else None,
                description=item.get("description", ""),
            )
        )
    return cases
