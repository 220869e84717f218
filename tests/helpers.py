"""Helpers shared by the test modules: seeds, sample experts, error measures, kernel variants.

Imported as ``helpers``: pytest puts ``tests/`` on ``sys.path`` for the rootdir conftest
(``tests/conftest.py``), so the test modules in every sub-folder can import it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper, parser

from onnx_moe_fuse.contract.packing import pack_qmoe_zero_points
from onnx_moe_fuse.verify.oracles.quant import pack_qmoe

#: Error bound of the float32 QMoE / MoE kernels against their references.
TOL = 1e-4
#: Lets the gemv variants run at test sizes (their default wants >= 4 words per lane at 32 lanes).
SMALL_TUNABLES = {"decodeLanes": 8, "decodeMinLaneTrips": 1}


# -- seeds ----------------------------------------------------------------------------------------


def seeded_rng() -> tuple[np.random.Generator, int]:
    """A fresh generator and its seed (``TEST_SEED`` replays one)."""
    seed = int(os.environ.get("TEST_SEED", secrets.randbits(32)))
    return np.random.default_rng(seed), seed


def env_seed() -> int:
    """A fresh seed for the sample tests (``ONNX_MOE_FUSE_SEED`` replays one)."""
    env = os.environ.get("ONNX_MOE_FUSE_SEED")
    if env:
        return int(env)
    return int(np.random.SeedSequence().entropy % (2**31))


# -- oracle contract-error cases ----------------------------------------------------------------


def altered(call: tuple[list, dict], i: int | None = None, value: Any = None, **kw: Any):
    """A valid oracle call ``(args, kwargs)`` with argument ``i`` set to ``value`` and ``kw``."""
    args, kwargs = call
    if i is not None:
        args[i] = value
    kwargs.update(kw)
    return args, kwargs


# -- a sample's experts as a fused node's operands ------------------------------------------------


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of the model's initializer ``name``."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)


def interleave_rows(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows of gate and up ``[E, I, ...]`` interleaved into ``[E, 2I, ...]`` (gate even)."""
    return np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])


def qmoe_operand(
    model: onnx.ModelProto, name: str, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """QMoE unsigned codes ``[E, N, K]``, scales ``[E, N(, K/block)]`` and zero points.

    The zero points have the scales' shape, in the unsigned code space (the symmetric point
    where the sample has none).
    """
    codes = initializer(model, f"{name}_quant")
    scale = initializer(model, f"{name}_scale").transpose(0, 2, 1)  # [E, N, K/block]
    names = {t.name for t in model.graph.initializer}
    if bits == 4:
        unsigned = (codes.astype(np.int8).astype(np.int16) + 8).astype(np.uint8)
        zp = np.full(scale.shape, 8, np.uint8)
    else:
        unsigned = codes
        scale = scale[:, :, 0]  # one block over K: column-wise [E, N]
        zp = np.full(scale.shape, 128, np.uint8)
        if f"{name}_zero_point" in names:
            zp = initializer(model, f"{name}_zero_point").transpose(0, 2, 1)[:, :, 0]
    return unsigned.transpose(0, 2, 1), scale, zp


def expert_operands(
    model: onnx.ModelProto, op: str, bits: int | None = None
) -> dict[str, np.ndarray | None]:
    """A sample's experts as inputs 2.. of a fused ``MoE`` / ``QMoE`` node, in ORT's layout.

    Keys in ORT's input order: ``w1, b1, w2, b2`` (MoE) or ``w1, s1, b1, w2, s2, b2`` (QMoE,
    ``bits``-bit codes packed), and for asymmetric QMoE weights ``w3, s3, b3`` (absent) and
    the packed zero points ``z1, z2``; an absent input is ``None``. SwiGLU gate and up
    projections become interleaved FC1 rows.
    """
    names = {t.name for t in model.graph.initializer}
    separate = "fc1_gate_weight" in names or "fc1_gate_weight_quant" in names
    b1 = initializer(model, "fc1_bias") if "fc1_bias" in names else None
    b2 = initializer(model, "fc2_bias") if "fc2_bias" in names else None
    if op == "MoE":
        if separate:
            gate = initializer(model, "fc1_gate_weight").transpose(0, 2, 1)
            w1 = interleave_rows(gate, initializer(model, "fc1_up_weight").transpose(0, 2, 1))
        else:
            w1 = initializer(model, "fc1_weight").transpose(0, 2, 1)
        w2 = initializer(model, "fc2_weight").transpose(0, 2, 1)
        return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    assert bits is not None, "QMoE needs the weight bits"
    if separate:
        gc, gs, gz = qmoe_operand(model, "fc1_gate_weight", bits)
        uc, us, uz = qmoe_operand(model, "fc1_up_weight", bits)
        c1, s1, z1 = interleave_rows(gc, uc), interleave_rows(gs, us), interleave_rows(gz, uz)
    else:
        c1, s1, z1 = qmoe_operand(model, "fc1_weight", bits)
    c2, s2, z2 = qmoe_operand(model, "fc2_weight", bits)
    w1, w2 = pack_qmoe(c1, bits), pack_qmoe(c2, bits)
    out = {"w1": w1, "s1": s1, "b1": b1, "w2": w2, "s2": s2, "b2": b2}
    if np.all(z1 == 1 << (bits - 1)) and np.all(z2 == 1 << (bits - 1)):
        return out
    blockwise = s1.ndim == 3
    z1, z2 = (z if blockwise else z[:, :, None] for z in (z1, z2))
    out.update(w3=None, s3=None, b3=None)
    out["z1"] = pack_qmoe_zero_points(z1, bits, blockwise)
    out["z2"] = pack_qmoe_zero_points(z2, bits, blockwise)
    return out


# -- error measures -------------------------------------------------------------------------------


def rel_err(got: np.ndarray, want: np.ndarray, *, zero_scale: float = 1e-30) -> float:
    """``max|got - want| / max|want|`` (0 for empty arrays); the shapes must match.

    Where ``want`` is all zeros the divisor is ``zero_scale``: by default any difference then
    fails a bound, ``zero_scale=1.0`` measures the absolute error.
    """
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return 0.0
    w = want.astype(np.float64)
    peak = float(np.abs(w).max())
    scale = max(peak, 1e-30) if peak > 0 else zero_scale
    return float(np.abs(got.astype(np.float64) - w).max() / scale)


def nonzero_rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max|actual - expected| / max|expected|``, refusing an all-zero ``expected``."""
    scale = float(np.abs(expected).max())
    assert scale > 0, "reference output is all zeros: the test would prove nothing"
    return float(np.abs(actual.astype(np.float64) - expected).max() / scale)


# -- every eligible variant of a QMoE / MoE kernel --------------------------------------------------


def draw_configs(
    rng: np.random.Generator, configs: Sequence[tuple], count: int, tokens: Sequence[int]
) -> Iterator[tuple[int, tuple, int, int]]:
    """``(i, config, tokens, rank)`` for ``count`` random kernel cases.

    Every config in turn first, then configs drawn at random; the token count is drawn from
    ``tokens``, the rank is 2 or 3.
    """
    for i in range(count):
        pick = i if i < len(configs) else int(rng.integers(len(configs)))
        yield i, configs[pick], int(rng.choice(tokens)), int(rng.integers(2, 4))


def chunk_limits(rng: np.random.Generator, call: dict, k: int, inter: int) -> dict[str, int]:
    """A storage binding limit that splits the call's hidden activations into token chunks.

    One token's hidden activations take ``k * inter`` float32 values; the limit holds 2 to 4
    tokens' worth, but never less than the largest tensor (every tensor must still fit).
    """
    need = k * inter * 4
    largest = max(a.nbytes for a in call.values())
    return {"maxStorageBufferBindingSize": max(largest, need * int(rng.integers(2, 5)))}


def checked(out: np.ndarray, want: np.ndarray, what: str, tol: float = TOL) -> float:
    """Assert a float32 kernel output is written and within ``tol`` of ``want``; the error."""
    assert out.dtype == np.float32, f"{what}: dtype {out.dtype}"
    assert not np.isnan(out).any(), f"{what}: unwritten (poisoned) or NaN output elements"
    err = rel_err(out, want, zero_scale=1.0)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"
    return err


def eligible(kernel: Any, call: dict, attrs: dict, limits: dict, tunables: dict) -> dict:
    """Variant -> the tunables under which its ``when`` holds (the call's, else smaller)."""
    found: dict[str, dict] = {}
    for tun in (tunables, {**SMALL_TUNABLES, **tunables}):
        plan = kernel.plan(attrs=attrs, tunables=tun, device_limits=limits, **call)
        for vid in kernel.variants:
            if vid not in plan.rejected and vid not in found:
                found[vid] = tun
    return found


def run_all_variants(
    kernel: Any,
    call: dict,
    attrs: dict,
    want: np.ndarray,
    what: str,
    limits: Mapping[str, int] | None = None,
    tunables: Mapping[str, Any] | None = None,
    ort_out: np.ndarray | None = None,
) -> dict[str, float]:
    """Run every eligible variant (forced); check each against ``want`` (and ORT)."""
    limits, tunables = dict(limits or {}), dict(tunables or {})
    errors = {}
    for vid, tun in eligible(kernel, call, attrs, limits, tunables).items():
        out = kernel(
            attrs=attrs,
            variant=vid,
            tunables=tun,
            device_limits=limits,
            poison_outputs=True,
            **call,
        )["outputT"]
        assert out.shape == want.shape, f"{what} {vid}: shape {out.shape} != {want.shape}"
        errors[vid] = checked(out, want, f"{what} [{vid}] vs oracle")
        if ort_out is not None:
            checked(out, ort_out, f"{what} [{vid}] vs ORT")
    assert errors, f"{what}: no variant accepts the call"
    return errors


def decompose_grouped_matmul(model: Any, opset: int = 18) -> onnx.ModelProto:
    """A copy of an ``onnx_ir.Model`` with each GroupedMatMul as Gather/Unsqueeze/MatMul/Squeeze.

    The canonical passes write GroupedMatMul (opset 29), which ONNX Runtime 1.32 cannot run:
    this spells each node out as its ONNX function body does (``+ Gather(bias, idx)`` for a
    bias input) at ``opset``, so a canonicalised working copy can be run and compared.
    """
    import onnx_ir as ir

    work = model.clone()
    graph = work.graph
    for node in [n for n in graph if n.op_type == "GroupedMatMul"]:
        x, w, idx = node.inputs[:3]
        axes12 = ir.Value(name=f"{node.name}_a12", const_value=ir.tensor(np.array([1, 2])))
        axes2 = ir.Value(name=f"{node.name}_a2", const_value=ir.tensor(np.array([2])))
        graph.register_initializer(axes12)
        graph.register_initializer(axes2)
        sel = ir.node("Gather", [w, idx], {"axis": 0})  # [M, S, K, N]
        lhs = ir.node("Unsqueeze", [x, axes12])  # [M, 1, 1, K]
        mm = ir.node("MatMul", [lhs.outputs[0], sel.outputs[0]])  # [M, S, 1, N]
        out = ir.node("Squeeze", [mm.outputs[0], axes2])
        new = [sel, lhs, mm, out]
        if len(node.inputs) > 3 and node.inputs[3] is not None:  # + bias[idx]
            bias = ir.node("Gather", [node.inputs[3], idx], {"axis": 0})
            out = ir.node("Add", [out.outputs[0], bias.outputs[0]])
            new += [bias, out]
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, node.outputs, out.outputs)
    work.opset_imports[""] = opset
    work.graph.opset_imports[""] = opset
    return ir.serde.serialize_model(work)


# -- ONNX text models run in ORT ----------------------------------------------------------------

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


def parse(text: str) -> onnx.ModelProto:
    """A checked model from ONNX text."""
    model = parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """An ORT CPU session with every graph optimisation off."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def random_feeds(sess: ort.InferenceSession, rng: np.random.Generator, dims: dict | None = None):
    """Random inputs for a session (symbolic dims from ``dims``, else 3); never all zeros."""
    feeds = {}
    for arg in sess.get_inputs():
        shape = [d if isinstance(d, int) else (dims or {}).get(d, 3) for d in arg.shape]
        np_type = _ORT_TYPES[arg.type]
        if np.issubdtype(np_type, np.integer):
            feeds[arg.name] = rng.integers(-50, 50, size=shape).astype(np_type)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np_type)
    return feeds
