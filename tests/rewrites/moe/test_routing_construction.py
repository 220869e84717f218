"""The routing constructions reproduce ``sum_j w[t, j] * expert_{idx[t, j]}(x_t)`` in ORT 1.32 CPU.

Each model is one fused node fed by :func:`build_routing` from graph inputs ``idx`` and ``w``
(the experts random graph inputs, the tokens fresh random per run): float ``MoE`` with the
logits construction, ``QMoE`` (8-bit column-wise: exact dequantisation in ORT) with both. The
reference is the explicit per-slot sum in float64 numpy. Errors are scale-aware
(``max|a - b| / max|b|``); the measured maxima are printed at the end of the module (``-s``)
and recorded in ``docs/routing.md``.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import pytest
from helpers import nonzero_rel_err, seeded_rng, session
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnxscript.rewriter import pattern
from onnxscript.rewriter._context import TapeRewriterContext

from onnx_moe_fuse.contract.ops import CONTRIB_OPS, MOE, QMOE
from onnx_moe_fuse.contract.targets import TARGETS
from onnx_moe_fuse.rewrites.moe.routing_construction import (
    LOG_FLOOR,
    LOGITS,
    ROUTER_WEIGHTS,
    UNSELECTED,
    RoutingArrays,
    build_routing,
    construction_for,
    construction_source,
    reference_output_weights,
    reference_routing,
    selection_refusal,
    takes_router_weights,
    value_refusal,
)
from onnx_moe_fuse.verify.oracles.moe_routing import route_moe, route_qmoe

#: Bound on the fused output against the float64 per-slot reference (float32 ORT).
TOL = 2e-6
#: Bound on the weights the construction makes ORT apply, relative to the row's largest weight.
WEIGHT_TOL = 4e-7
HID, INTER = 16, 8
#: (op, construction) paths run in ORT.
PATHS = [(MOE.name, LOGITS), (QMOE.name, LOGITS), (QMOE.name, ROUTER_WEIGHTS)]

_MEASURED: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if _MEASURED:
        print("\nrouting construction: max scale-aware error per (path, case)")
        for (path, case), err in sorted(_MEASURED.items()):
            print(f"  {path:28s} {case:18s} {err:.3e}")


def _record(path: str, case: str, err: float) -> None:
    _MEASURED[(path, case)] = max(err, _MEASURED.get((path, case), 0.0))


# -- models ------------------------------------------------------------------------------------


def _value(name: str, dtype: ir.DataType, shape: list) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))


@functools.cache
def _session(
    op_name: str, construction: str, e: int, k: int, sum_to_one: bool, rank: int = 2, dt=np.float32
):
    """An ORT session of one fused node routed by ``construction`` from inputs idx, w."""
    op = TapeRewriterContext()
    lead = ["T"] if rank == 2 else ["B", "S"]
    f32 = ir.DataType.from_numpy(np.dtype(dt))
    x = _value("x", f32, [*lead, HID])
    idx = _value("idx", ir.DataType.INT64, [*lead, k])
    w = _value("w", f32, [*lead, k])
    routing = build_routing(op, idx, w, e, construction, weights_sum_to_one=sum_to_one)
    if op_name == MOE.name:
        fc1, fc2 = _value("fc1", f32, [e, INTER, HID]), _value("fc2", f32, [e, HID, INTER])
        experts = {"fc1_experts_weights": fc1, "fc2_experts_weights": fc2}
        extra: dict = {}
    else:
        u8 = ir.DataType.UINT8
        fc1, fc2 = _value("fc1", u8, [e, INTER, HID]), _value("fc2", u8, [e, HID, INTER])
        s1, s2 = _value("s1", f32, [e, INTER]), _value("s2", f32, [e, HID])
        experts = {
            "fc1_experts_weights": fc1,
            "fc1_scales": s1,
            "fc2_experts_weights": fc2,
            "fc2_scales": s2,
        }
        extra = {"expert_weight_bits": 8, "quant_type": "int", "weights_prepacked": 0}
        extra["accuracy_level"] = 0
    contract = CONTRIB_OPS[op_name]
    inputs = contract.input_list({"input": x, **routing.inputs(), **experts})
    out = op.op(
        contract.name,
        *inputs,
        _domain=contract.domain,
        k=k,
        activation_type="silu",
        use_sparse_mixer=0,
        swiglu_fusion=0,
        activation_alpha=1.0,
        activation_beta=0.0,
        **routing.attributes(),
        **extra,
    )
    y = routing.rescaled(op, out)
    y.name = "y"
    graph = ir.Graph(
        [x, idx, w, *experts.values()],
        [y],
        nodes=op.nodes,
        opset_imports={"": 18, "com.microsoft": 1},
    )
    return session(ir.serde.serialize_model(ir.Model(graph, ir_version=10)))


def _experts(rng: np.random.Generator, op_name: str, e: int, dt=np.float32):
    """Random experts: the session feeds and their float64 values ``[E, N, K]``."""
    if op_name == MOE.name:
        w1 = (rng.standard_normal((e, INTER, HID)) / np.sqrt(HID)).astype(dt)
        w2 = (rng.standard_normal((e, HID, INTER)) / np.sqrt(INTER)).astype(dt)
        return {"fc1": w1, "fc2": w2}, w1.astype(np.float64), w2.astype(np.float64)
    q1 = rng.integers(0, 256, (e, INTER, HID), dtype=np.uint8)
    q2 = rng.integers(0, 256, (e, HID, INTER), dtype=np.uint8)
    s1 = (rng.uniform(0.5, 1.5, (e, INTER)) / (64 * np.sqrt(HID))).astype(dt)
    s2 = (rng.uniform(0.5, 1.5, (e, HID)) / (64 * np.sqrt(INTER))).astype(dt)
    d1 = (q1.astype(np.float64) - 128) * s1[..., None]
    d2 = (q2.astype(np.float64) - 128) * s2[..., None]
    return {"fc1": q1, "fc2": q2, "s1": s1, "s2": s2}, d1, d2


def _per_slot(x, idx, w, d1, d2) -> np.ndarray:
    """``sum_j w[t, j] * fc2[e] @ silu(fc1[e] @ x_t)`` with ``e = idx[t, j]``, float64."""
    x = x.astype(np.float64).reshape(-1, HID)
    i = idx.reshape(-1, idx.shape[-1])
    ww = w.astype(np.float64).reshape(i.shape)
    out = np.zeros_like(x)
    for j in range(i.shape[1]):
        h = np.einsum("tih,th->ti", d1[i[:, j]], x)
        a = h / (1 + np.exp(-h))
        out += ww[:, j : j + 1] * np.einsum("thi,ti->th", d2[i[:, j]], a)
    return out.reshape(*idx.shape[:-1], HID)


def _run_path(
    rng, op_name, construction, idx, w, e, *, sum_to_one=False, case="", rank=2, dt=np.float32
) -> float:
    k = idx.shape[-1]
    sess = _session(op_name, construction, e, k, sum_to_one, rank, dt)
    feeds, d1, d2 = _experts(rng, op_name, e, dt)
    x = rng.standard_normal((*idx.shape[:-1], HID)).astype(dt)
    feeds.update(x=x, idx=idx.astype(np.int64), w=w.astype(dt))
    (got,) = sess.run(None, feeds)
    want = _per_slot(x, idx, w.astype(dt), d1, d2)
    err = nonzero_rel_err(got, want)
    _record(f"{op_name}/{construction}", case, err)
    return err


# -- selections --------------------------------------------------------------------------------


def _distinct(rng: np.random.Generator, t: int, e: int, k: int) -> np.ndarray:
    return np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int64)


def _case(name: str, rng: np.random.Generator):
    """``(idx, w, E, weights sum to one)`` for one named case."""
    t = 7
    e, k = {"k=1": (4, 1), "k=E": (4, 4), "E=128,k=8": (128, 8)}.get(name, (8, 2))
    if name in ("ties", "zero weight", "all-zero row", "tiny", "large spread"):
        e, k = 8, 4
    idx = _distinct(rng, t, e, k)
    w = rng.uniform(0.05, 1.0, (t, k))
    if name == "ties":
        w[:] = 0.25
        w[1:3] = rng.uniform(0.05, 1.0, (2, 1))  # equal within a row, another value
    elif name == "zero weight":
        w[np.arange(t), rng.integers(0, k, t)] = 0.0
    elif name == "all-zero row":
        w[2] = 0.0
    elif name == "tiny":
        w = 1e-30 * rng.uniform(1.0, 2.0, (t, k))
    elif name == "large spread":
        w = 10.0 ** rng.uniform(0.0, 6.0, (t, k))
        w[:, 0], w[:, 1] = 1.0, 1e6
    elif name == "sum > 1":
        w = rng.uniform(0.5, 5.0, (t, k))
    if name == "sums to one":
        w = w / w.sum(axis=1, keepdims=True)
    return idx, w.astype(np.float32), e, name == "sums to one"


CASES = [
    "random",
    "k=1",
    "k=E",
    "ties",
    "zero weight",
    "all-zero row",
    "tiny",
    "large spread",
    "sum > 1",
    "sums to one",
    "E=128,k=8",
]


@pytest.mark.parametrize(("op_name", "construction"), PATHS)
@pytest.mark.parametrize("case", CASES)
def test_fused_node_reproduces_the_per_slot_sum(op_name, construction, case):
    rng, seed = seeded_rng()
    idx, w, e, sum_to_one = _case(case, rng)
    err = _run_path(rng, op_name, construction, idx, w, e, sum_to_one=sum_to_one, case=case)
    assert err < TOL, f"{op_name}/{construction} {case}: {err:.3e} (TEST_SEED={seed})"


#: Bound for float16 activations (and so float16 routing arithmetic): measured <= 7.4e-4.
TOL_FP16 = 5e-3


@pytest.mark.parametrize(("op_name", "construction"), PATHS)
@pytest.mark.parametrize("case", ["random", "zero weight", "large spread", "E=128,k=8"])
def test_float16_layers(op_name, construction, case):
    rng, seed = seeded_rng()
    idx, w, e, _ = _case(case, rng)
    if case == "large spread":
        w = w / np.float32(1e3)  # float16 holds 1e3, not 1e6
    err = _run_path(rng, op_name, construction, idx, w, e, case=f"fp16 {case}", dt=np.float16)
    assert err < TOL_FP16, f"{op_name}/{construction} float16 {case}: {err:.3e} (TEST_SEED={seed})"


def test_three_dimensional_selection_is_flattened():
    rng, seed = seeded_rng()
    idx = np.stack([_distinct(rng, 5, 6, 3) for _ in range(2)])  # [B=2, S=5, k=3]
    w = rng.uniform(0.0, 2.0, idx.shape).astype(np.float32)
    for op_name, construction in PATHS:
        err = _run_path(rng, op_name, construction, idx, w, 6, case="[B, S, k]", rank=3)
        assert err < TOL, f"{op_name}/{construction}: {err:.3e} (TEST_SEED={seed})"


@st.composite
def _selections(draw):
    e = draw(st.integers(1, 16))
    k = draw(st.integers(1, e))
    t = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["uniform", "log", "zeros", "tiny"]))
    if kind == "uniform":
        w = rng.uniform(0.0, 3.0, (t, k))
    elif kind == "log":
        w = 10.0 ** rng.uniform(-6.0, 6.0, (t, k))
    elif kind == "zeros":
        w = rng.uniform(0.0, 1.0, (t, k)) * (rng.random((t, k)) < 0.5)
    else:
        w = 1e-30 * rng.uniform(1.0, 1e3, (t, k))
    return _distinct(rng, t, e, k), w.astype(np.float32), e, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_selections())
def test_random_selections_in_ort(sel):
    idx, w, e, seed = sel
    rng = np.random.default_rng(seed + 1)
    if not np.any(w):
        w[0, 0] = 1.0  # an all-zero output proves nothing (rows of zeros are a case above)
    for op_name, construction in PATHS:
        err = _run_path(rng, op_name, construction, idx, w, e, case="hypothesis")
        assert err < TOL, f"{op_name}/{construction}: {err:.3e}"


# -- the construction's own arithmetic -----------------------------------------------------------


@functools.cache
def _routing_session(construction: str, e: int, k: int):
    """The construction alone: outputs router_probs, router_weights or scale."""
    op = TapeRewriterContext()
    idx = _value("idx", ir.DataType.INT64, ["T", k])
    w = _value("w", ir.DataType.FLOAT, ["T", k])
    r = build_routing(op, idx, w, e, construction)
    outs = [v for v in (r.router_probs, r.router_weights, r.scale) if v is not None]
    for name, v in zip(("probs", "weights", "scale"), outs, strict=False):
        v.name = name
    graph = ir.Graph([idx, w], outs, nodes=op.nodes, opset_imports={"": 18})
    return session(ir.serde.serialize_model(ir.Model(graph, ir_version=10)))


@pytest.mark.parametrize("construction", [LOGITS, ROUTER_WEIGHTS])
@pytest.mark.parametrize("case", CASES)
def test_graph_matches_numpy_reference_and_ort_routing(construction, case):
    rng, seed = seeded_rng()
    idx, w, e, _ = _case(case, rng)
    ref = reference_routing(idx, w, e, construction)
    got_arrays = _routing_session(construction, e, idx.shape[1]).run(None, {"idx": idx, "w": w})
    want = [v for v in (ref.router_probs, ref.router_weights, ref.scale) if v is not None]
    assert len(got_arrays) == len(want)
    for a, b in zip(got_arrays, want, strict=True):
        # ORT's Log and numpy's differ by an ulp or two: an absolute 1e-6 in the log domain
        np.testing.assert_allclose(a, b, rtol=2e-7, atol=1e-6 if a is got_arrays[0] else 0)
    probs = got_arrays[0]
    # ORT's selection of the constructed router_probs is exactly idx (as a set per row)
    if construction == ROUTER_WEIGHTS:
        picked = route_qmoe(probs, idx.shape[1])[0]
    else:
        picked = route_moe(probs, idx.shape[1], 1)[0]
    assert (np.sort(picked, axis=1) == np.sort(idx, axis=1)).all(), f"TEST_SEED={seed}"
    # the weights ORT then applies equal w, relative to the row's largest weight
    names = ["router_probs", "router_weights", "scale"]
    present = [n for n in names if getattr(ref, n) is not None]
    built = {**dict.fromkeys(names), **dict(zip(present, got_arrays, strict=True))}
    from_ort = RoutingArrays(
        construction,
        built["router_probs"],
        built["router_weights"],
        ref.normalize_routing_weights,
        built["scale"],
    )
    got = reference_output_weights(from_ort, idx)  # ORT's routing of ORT's constructed arrays
    w64 = w.astype(np.float64)
    scale = np.maximum(w64.max(axis=1, keepdims=True), 1e-300)
    err = float(np.max(np.abs(got - w64) / scale))
    _record(f"weights/{construction}", case, err)
    assert err < WEIGHT_TOL, f"{case}: {err:.3e} (TEST_SEED={seed})"
    if construction == LOGITS:
        zero = w == 0
        assert (np.take_along_axis(probs, idx, axis=1)[zero] == np.float32(LOG_FLOOR)).all()
        assert (got[zero] == 0).all()
        unselected = np.ones(probs.shape, bool)
        np.put_along_axis(unselected, idx, False, axis=1)
        assert (probs[unselected] == np.float32(UNSELECTED)).all()


# -- refusals and the construction table ------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda i, w: w.__setitem__((1, 0), -0.5), "negative"),
        (lambda i, w: w.__setitem__((0, 1), np.nan), "not finite"),
        (lambda i, w: w.__setitem__((2, 1), np.inf), "not finite"),
        (lambda i, w: i.__setitem__((1, 1), i[1, 0]), "twice"),
        (lambda i, w: i.__setitem__((0, 0), 8), "outside"),
        (lambda i, w: i.__setitem__((0, 0), -1), "outside"),
    ],
)
def test_inexpressible_selections_are_refused(change, words):
    rng, _ = seeded_rng()
    idx, w, e, _ = _case("random", rng)
    assert selection_refusal(idx, w, e) is None
    change(idx, w)
    reason = selection_refusal(idx, w, e)
    assert reason is not None and words in reason, reason
    with pytest.raises(ValueError, match=words):
        reference_routing(idx, w, e, LOGITS)


def test_shape_and_dtype_refusals():
    idx = np.zeros((3, 2), np.int64)
    assert "share one shape" in selection_refusal(idx, np.zeros((3, 3), np.float32), 4)
    assert "integer" in selection_refusal(idx.astype(np.float32), np.zeros((3, 2)), 4)
    assert "k = 2 selected of 1" in selection_refusal(idx, np.zeros((3, 2), np.float32), 1)
    f32, i64 = ir.DataType.FLOAT, ir.DataType.INT64
    good_i, good_w = _value("i", i64, ["T", 2]), _value("w", f32, ["T", 2])
    assert value_refusal(good_i, good_w, 4) is None
    assert "int64" in value_refusal(_value("i", ir.DataType.INT32, ["T", 2]), good_w, 4)
    assert "not float32" in value_refusal(good_i, _value("w", ir.DataType.DOUBLE, ["T", 2]), 4)
    assert "differ" in value_refusal(good_i, _value("w", f32, ["T", 3]), 4)
    assert "k = 2" in value_refusal(good_i, good_w, 1)
    with pytest.raises(ValueError, match="int64"):
        build_routing(
            TapeRewriterContext(), _value("i", ir.DataType.INT32, [3, 2]), good_w, 4, LOGITS
        )
    with pytest.raises(ValueError, match="construction"):
        build_routing(TapeRewriterContext(), good_i, good_w, 4, "softmax")


def test_construction_table():
    assert construction_for(QMOE.name, "ort-cpu") == ROUTER_WEIGHTS
    assert takes_router_weights(QMOE.name, "ort-cpu")
    assert "ORT 1.32 CPU" in construction_source(QMOE.name, "ort-cpu")
    assert "router_weights" in QMOE.input_names and "router_weights" not in MOE.input_names
    for target in TARGETS:
        assert construction_for(MOE.name, target) == LOGITS
        assert "no router_weights input" in construction_source(MOE.name, target)
    for target in ("ort-cuda", "ort-webgpu"):
        assert construction_for(QMOE.name, target) == LOGITS
        assert "not established, logits construction" in construction_source(QMOE.name, target)
    with pytest.raises(KeyError):
        construction_for("MatMulNBits", "ort-cpu")
    with pytest.raises(ValueError):
        construction_for(QMOE.name, "ort-tpu")


def test_ort_qmoe_skips_final_weights_up_to_1e_8():
    """Pins the measured ORT 1.32 CPU fact the router_weights construction divides for."""
    rng = np.random.default_rng(0)
    sess = _session(QMOE.name, ROUTER_WEIGHTS, 4, 2, True)  # w as it is, no rescale
    feeds, _, _ = _experts(rng, QMOE.name, 4)
    feeds.update(x=rng.standard_normal((1, HID)).astype(np.float32), idx=np.array([[0, 1]]))

    def out(v):
        return sess.run(None, {**feeds, "w": np.array([[v, 0.0]], np.float32)})[0]

    t = np.float32(1e-8)
    assert not np.any(out(t)) and not np.any(out(np.float32(1e-10)))
    assert np.all(np.abs(out(np.nextafter(t, np.float32(1)))) > 0)
    # scaled by the row maximum, a row of small weights is reproduced (the "tiny" case above)
    idx, w = np.array([[0, 1]]), np.array([[1e-10, 3e-10]], np.float32)
    assert _run_path(rng, QMOE.name, ROUTER_WEIGHTS, idx, w, 4, case="1e-10 row") < TOL


# -- from a rule's rewrite -------------------------------------------------------------------------


class _PlaceholderExperts(pattern.RewriteRuleClassBase):
    """Rewrites a stand-in ``test.Experts(x, idx, w, fc1, fc2)`` into MoE routed by the module.

    The stand-in is the layer a rule has recognised (the experts applied per selected slot);
    the router before it stays as the model wrote it.
    """

    def pattern(self, op, x, idx, w, fc1, fc2):
        return op.Experts(x, idx, w, fc1, fc2, _domain="test.moe")

    def rewrite(self, op, x, idx, w, fc1, fc2):
        e = fc1.shape[0]
        construction = construction_for(MOE.name, "ort-cpu")
        routing = build_routing(op, idx, w, e, construction)
        inputs = MOE.input_list(
            {"input": x, **routing.inputs(), "fc1_experts_weights": fc1, "fc2_experts_weights": fc2}
        )
        out = op.op(
            MOE.name,
            *inputs,
            _domain=MOE.domain,
            k=idx.shape[-1],
            activation_type="silu",
            use_sparse_mixer=0,
            swiglu_fusion=0,
            activation_alpha=1.0,
            activation_beta=0.0,
            **routing.attributes(),
        )
        return routing.rescaled(op, out)


def test_a_rule_rewrite_builds_the_routing_after_a_sigmoid_router():
    """A sigmoid top-k router (weights not summing to one) fused through onnxscript's rewriter."""
    rng, seed = seeded_rng()
    e, k = 8, 3
    f32 = ir.DataType.FLOAT
    x = _value("x", f32, ["T", HID])
    wr = _value("wr", f32, [HID, e])
    fc1, fc2 = _value("fc1", f32, [e, INTER, HID]), _value("fc2", f32, [e, HID, INTER])
    kk = ir.Value(name="k", const_value=ir.tensor(np.array([k], np.int64)))
    nodes = [
        ir.node("MatMul", [x, wr], outputs=[logits := ir.Value(name="logits")]),
        ir.node(
            "TopK",
            [logits, kk],
            outputs=[vals := ir.Value(name="vals"), _value("idx", ir.DataType.INT64, ["T", k])],
        ),
    ]
    idx = nodes[1].outputs[1]
    nodes.append(ir.node("Sigmoid", [vals], outputs=[w := _value("w", f32, ["T", k])]))
    nodes.append(
        ir.node(
            "Experts",
            [x, idx, w, fc1, fc2],
            domain="test.moe",
            outputs=[_value("y", f32, ["T", HID])],
        )
    )
    graph = ir.Graph(
        [x, wr, fc1, fc2],
        [nodes[-1].outputs[0], idx, w],
        nodes=nodes,
        initializers=[kk],
        opset_imports={"": 18, "test.moe": 1},
    )
    model = ir.Model(graph, ir_version=10)
    count = pattern.RewriteRuleSet([_PlaceholderExperts.rule()]).apply_to_model(model)
    assert count == 1
    assert [n.op_type for n in model.graph if n.domain == "test.moe"] == []
    model.opset_imports["com.microsoft"] = 1
    sess = session(ir.serde.serialize_model(model))
    feeds, d1, d2 = _experts(rng, MOE.name, e)
    xs = rng.standard_normal((6, HID)).astype(np.float32)
    feeds.update(x=xs, wr=rng.standard_normal((HID, e)).astype(np.float32))
    y, got_idx, got_w = sess.run(None, feeds)
    err = nonzero_rel_err(y, _per_slot(xs, got_idx, got_w, d1, d2))
    _record("MoE/logits", "rule, sigmoid", err)
    assert err < TOL, f"{err:.3e} (TEST_SEED={seed})"


@pytest.mark.parametrize("opset", [15, 17])
@pytest.mark.parametrize("construction", [LOGITS, ROUTER_WEIGHTS])
def test_older_opsets_take_reduce_max_axes_as_an_attribute(opset, construction):
    rng, _ = seeded_rng()
    idx, w, e, _ = _case("zero weight", rng)
    op = TapeRewriterContext()
    vi = _value("idx", ir.DataType.INT64, ["T", idx.shape[1]])
    vw = _value("w", ir.DataType.FLOAT, ["T", idx.shape[1]])
    r = build_routing(op, vi, vw, e, construction, opset=opset)
    outs = [v for v in (r.router_probs, r.router_weights, r.scale) if v is not None]
    for i, v in enumerate(outs):
        v.name = f"out{i}"
    graph = ir.Graph([vi, vw], outs, nodes=op.nodes, opset_imports={"": opset})
    got = session(ir.serde.serialize_model(ir.Model(graph, ir_version=8))).run(
        None, {"idx": idx, "w": w}
    )
    ref = reference_routing(idx, w, e, construction)
    want = [v for v in (ref.router_probs, ref.router_weights, ref.scale) if v is not None]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-7, atol=1e-6)
    with pytest.raises(ValueError, match="opset >= 15"):
        build_routing(TapeRewriterContext(), vi, vw, e, construction, opset=14)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_construction_constants_are_safe_in_half_precision(dtype: str) -> None:
    """A half-precision layer is always fed through the construction: its constants in T.

    ``LOG_FLOOR`` and ``UNSELECTED`` are finite and stay ordered (bfloat16 rounds them to -9984
    and -29952), and a floored logit's softmax weight is 0 in T, so a zero weight stays 0.
    """
    import ml_dtypes

    t = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    floor, unselected = np.array(LOG_FLOOR, t), np.array(UNSELECTED, t)
    assert np.isfinite(floor) and np.isfinite(unselected) and unselected < floor
    assert float(np.exp(floor)) == 0.0
    # the numpy twin in T: the selection survives, weights within T's rounding
    idx = np.array([[3, 0], [1, 2]], dtype=np.int64)
    w = np.array([[0.75, 0.25], [0.0, 2.5]], dtype=t)
    arrays = reference_routing(idx, w, 4, LOGITS)
    assert arrays.router_probs.dtype == np.dtype(t)
    top = np.argsort(-arrays.router_probs.astype(np.float64), axis=1, kind="stable")[:, :2]
    assert {tuple(sorted(r)) for r in top} == {(0, 3), (1, 2)}
    got = reference_output_weights(arrays, idx)
    np.testing.assert_allclose(got, w.astype(np.float64), rtol=1e-2, atol=1e-2)
