"""The layer rules on per-part recognition: new part combinations fuse, rules work alone.

The rules anchor at a small combine pattern and recognise the rest part by part, so part
spellings compose: flattened rows with a MatMul or Einsum combine, and flattened rows with one
slot per token, fuse (they matched no whole-layer pattern before). Checked through the pipeline
against ORT CPU and the generator's numpy reference (``spellings.outcomes``). Used alone with
onnxscript's ``rewriter.rewrite`` (no splice), a rule set still replaces the whole layer (the
rest is swept as dead code) and refuses a layer whose intermediate escapes, naming the region.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx_ir as ir
import pytest
from onnxscript import rewriter
from onnxscript.rewriter import pattern
from spellings.build import build_case
from spellings.outcomes import check_equivalent, check_mutant, relative_error, session
from spellings.strategies import SMALL_BASE

from onnx_moe_fuse.rewrites.moe.layer_rules import moe_layer_rule_set

BASE = replace(SMALL_BASE, seed=5)


@pytest.mark.parametrize(
    "changes",
    [
        {"experts": "rows_gathernd", "combine": "matmul_row"},
        {"experts": "rows_gathernd", "combine": "einsum", "activation": "relu"},
        {"experts": "rows_gathernd", "top_k": 1, "activation": "swiglu_split"},
        {"experts": "rows_gathernd", "top_k": 1, "combine": "matmul_row", "weight_dtype": "int4"},
    ],
)
def test_rows_combinations_fuse_and_match_ort(changes: dict) -> None:
    outcome = check_equivalent(replace(BASE, **changes))
    assert outcome.kind == "fused", outcome


@pytest.mark.parametrize(
    "changes",
    [
        {"mutation": "swap_gate_up"},
        {"mutation": "swap_gate_up", "activation": "swiglu_oss", "experts": "rows_gathernd"},
        {"mutation": "fc2_other_indices", "experts": "rows_gathernd"},
    ],
)
def test_mutants_are_refused_naming_the_part(changes: dict) -> None:
    outcome = check_mutant(replace(BASE, **changes))
    assert outcome.kind == "refused", outcome


class _Reasons(pattern.MatchingTracer):
    """Collects the reasons of failed checks."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def log(self, rule, container, node, match_result, status) -> None:  # noqa: D102
        if status == pattern.MatchStatus.CONDITION_FAILED:
            self.reasons.append(match_result.reason)


@pytest.mark.parametrize("experts", ["gather_expand", "rows_gathernd"])
def test_rule_set_alone_replaces_the_whole_layer(experts: str) -> None:
    built = build_case(replace(BASE, experts=experts, seed=11))
    fused = rewriter.rewrite(built.model, pattern_rewrite_rules=moe_layer_rule_set())
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MoE") == 1
    assert not {"TopK", "Gather", "GatherND", "Sigmoid"} & set(ops), ops
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, BASE.hidden)).astype(np.float32)
    want = session(built.model).run(None, {"x": x})[0]
    got = session(fused).run(None, {"x": x})[0]
    assert relative_error(got, want) < 1e-5


def test_rule_alone_refuses_an_escaping_intermediate() -> None:
    model = ir.from_proto(build_case(BASE).model)
    escaping = next(v for n in model.graph for v in n.outputs if v.name == "gate_silu")
    model.graph.outputs.append(escaping)
    tracer = _Reasons()
    moe_layer_rule_set().apply_to_model(model, tracer=tracer)
    assert not any(n.op_type == "MoE" for n in model.graph)
    assert any(r.startswith("region: an intermediate value escapes") for r in tracer.reasons), (
        tracer.reasons
    )
