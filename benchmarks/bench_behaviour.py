"""What the behaviour checks cost: the activation probe check per layer, and a 48-layer fuse.

Two measurements (medians; single-threaded numpy, the machine's other load included):

1. ``prove_activation`` alone (:mod:`onnx_moe_fuse.rewrites.moe.behaviour.activation`: column
   routing, the region evaluated on the probe grid, every candidate fitted) on hand-written
   regions at model sizes: SiLU written ``x / (1 + exp(-x))`` at I = 768 (Qwen3-30B-A3B) and
   gpt-oss's clamped SwiGLU written with Min/Max, strided Slices and ``1 / (1 + exp(-1.702 g))``
   at I = 2880; also the region walk (:func:`~onnx_moe_fuse.rewrites.moe.behaviour.region.
   elementwise_region`) with a trivial source test;
2. ``fuse`` of the stacked int4 model (``samples.stacked``, SwiGLU layers the spelling patterns
   match) as it runs (patterns first), and with the activation patterns switched off so the
   behaviour check decides every layer: the difference per layer is what a layer whose
   activation no pattern matches pays.

    .venv/bin/python benchmarks/bench_behaviour.py [--layers 48] [--runs 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import onnx_moe_fuse.rewrites.moe.activation_proof as analysis
import onnx_moe_fuse.rewrites.moe.parts.activation as activation_part
from onnx_moe_fuse import fuse
from onnx_moe_fuse.contract.ops import ACTIVATION_TYPES
from onnx_moe_fuse.rewrites.moe.behaviour.activation import prove_activation
from onnx_moe_fuse.rewrites.moe.behaviour.region import elementwise_region
from onnx_moe_fuse.samples.stacked import stacked_moe_model


def _region_model(width: int, gpt_oss: bool) -> ir.Model:
    nodes, inits = [], []

    def c(name, value, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def n(op, *inputs, out, **attrs):
        nodes.append(helper.make_node(op, list(inputs), [out], **attrs))
        return out

    one = c("one", 1.0)
    if gpt_oss:
        s = [c("s0", [0], np.int64), c("s1", [1], np.int64), c("e", [2**62], np.int64),
             c("ax", [-1], np.int64), c("st", [2], np.int64)]  # fmt: skip
        g = n("Slice", "h", s[0], s[2], s[3], s[4], out="g")
        u = n("Slice", "h", s[1], s[2], s[3], s[4], out="u")
        g = n("Min", g, c("lim", 7.0), out="gc")
        u = n("Max", n("Min", u, "lim", out="u1"), c("nlim", -7.0), out="uc")
        e = n("Exp", n("Mul", g, c("na", -1.702), out="z"), out="ez")
        glu = n("Div", g, n("Add", one, e, out="den"), out="glu")
        out = n("Mul", glu, n("Add", u, one, out="u2"), out="act")
    else:
        e = n("Exp", n("Neg", "h", out="nh"), out="ex")
        out = n("Div", "h", n("Add", one, e, out="den"), out="act")
    graph = helper.make_graph(
        nodes, "region", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["T", width])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


def _median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def probe_check(runs: int) -> None:
    print("prove_activation, one layer (median of", runs, "runs):")
    for name, inter, oss in (
        ("silu written, I=768", 768, False),
        ("gpt-oss written, I=2880", 2880, True),
    ):
        model = _region_model(2 * inter if oss else inter, oss)
        src, act = model.graph.inputs[0], model.graph.outputs[0]
        walk = functools.partial(elementwise_region, act, lambda v, s=src: v is s, "the activation")
        region = walk()
        widths = [2 * inter if oss else inter]
        proof = functools.partial(
            prove_activation, region, widths, 2, np.dtype(np.float32), inter, ACTIVATION_TYPES
        )
        got = proof()
        ms = _median_ms(proof, runs)
        print(
            f"  {name:28s} {ms:7.2f} ms   region walk {_median_ms(walk, runs):6.3f} ms   -> {got[0]} {got[2]}"
        )


def _timed(module, name: str, spent: list[float]):
    """Wrap ``module.name`` so each call's wall time is appended to ``spent``."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t)

    setattr(module, name, wrapper)
    return inner


def stacked(layers: int, runs: int) -> None:
    model = stacked_moe_model(layers, hidden=64, inter=32, experts=8, seed_key="bench_behaviour")
    fast = _median_ms(lambda: fuse(model), runs)
    saved = activation_part.first_match
    walk: list[float] = []
    proof: list[float] = []
    activation_part.first_match = lambda patterns, node: None
    walk_fn = _timed(activation_part, "behaviour_activation", walk)
    proof_fn = _timed(analysis, "prove_activation", proof)
    try:
        result = fuse(model)
        behaviour = _median_ms(lambda: fuse(model), runs)
    finally:
        activation_part.first_match = saved
        activation_part.behaviour_activation = walk_fn
        analysis.prove_activation = proof_fn
    calls = runs + 1
    print(f"fuse, {layers} stacked int4 SwiGLU layers (H=64, I=32, E=8), median of {runs}:")
    print(f"  patterns first (as shipped)      {fast:8.1f} ms")
    print(
        f"  behaviour check on every layer   {behaviour:8.1f} ms  ({len(result.report.fusions)} fused)"
    )
    print(f"  in the behaviour steps, per fuse: region walk {1e3 * sum(walk) / calls:.1f} ms "
          f"({len(walk) / calls:.0f} calls), probe proof {1e3 * sum(proof) / calls:.1f} ms "
          f"({len(proof) / calls:.0f} calls): {1e3 * (sum(walk) + sum(proof)) / calls / layers:.2f} ms "
          "per layer")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    probe_check(max(args.runs, 10))
    stacked(args.layers, args.runs)


if __name__ == "__main__":
    main()
