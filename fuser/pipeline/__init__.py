"""onnx-ir passes of the MoE fusion pipeline, composed with ``onnx_ir.passes.PassManager``.

:func:`fusion_pipeline` builds the pipeline :func:`onnx_moe_fuse.fuse` runs::

    FuseMoELayersPass      layer rules (onnx_moe_fuse.rewrites.moe.layer_rules) -> MoE / QMoE;
                           fills a FusionReport with the fusions and the near misses
    FuseQkvPass            RMSNorm + three 4-bit projections (onnx_moe_fuse.rewrites.
                           matmul_nbits_qkv) -> MatMulNBitsQkv; fusions and near misses too
    RemoveDeadCodePass     drop what the fused layers left dead (DequantizeLinear, the router
                           Softmax, Constants, unused initializers); only after a fusion
    LowerOpsetPass         "" : 29 -> 28 once no GroupedMatMul is left (opset 29 adds only
                           GroupedMatMul, and ONNX Runtime 1.32 refuses opset-29 models), and on
                           down to the target's opset past versions whose changes are unused
    FusedNodesCheckPass    postconditions: no private-domain (internal) op survives, and every
                           fused node is an op the target has and carries its attribute set

Every pass knows the ``target`` runtime (:mod:`onnx_moe_fuse.contract.targets`): the rules
stay target-free and emit what a layer means; at emission (before a MoE/QMoE node is spliced,
after a MatMulNBitsQkv rewrite) the node gets the target's attribute set, and a node whose op,
activation or dtype the target has no kernel for is not emitted but reported as a near miss of
part ``target`` naming the alternative.

A model in which nothing fused comes out of the pipeline unchanged: the clean-up passes act only
when the report holds a fusion.

Near misses come from a dry run of the same rules with a tracer
(:class:`NearMissTracer`): every match whose ``check`` failed is recorded with its typed refusal
(:mod:`onnx_moe_fuse.rewrites.graph.refusals`: one ``Refusal`` type, one ``NearMiss`` record),
and so is a whole-pattern match that the rewriter refused because an intermediate value escapes
the layer (with the escaping value named). A TopK whose indices feed expert selections but that
no rule matched at all is reported too, as "not recognised", saying which known unfused form it
is when it can tell: a sort of the ids (grouped_mm exports) or a one-hot mask (a loop over
experts), with the refusal the canonicalisation pass recorded for it while it ran.
A router MoE/QMoE cannot express (sigmoid scores, a selection bias, a group-limited top-k, a
scaling factor, PhiMoE's sparse mixer: :mod:`onnx_moe_fuse.rewrites.moe.routers`) is reported as
"router not fused", naming its form, once per router, with the scores node as ``router``.
Near misses of layers that did fuse in the end are dropped.

One pass a module: :mod:`.fuse_moe_layers`, :mod:`.fuse_qkv`, :mod:`.remove_dead_code`,
:mod:`.lower_opset`, :mod:`.fused_nodes_check`; the report in :mod:`.report`, the near-miss
tracer and reasons in :mod:`.near_misses`.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "compose": [
            "INTERNAL_DOMAIN",
            "OPSET_CHANGES",
            "REQUIRED_ATTRIBUTES",
            "FusionReport",
            "NearMissTracer",
            "FuseMoELayersPass",
            "LayerObserver",
            "FuseQkvPass",
            "ALL_FUSED_OPS",
            "RemoveDeadCodePass",
            "LowerOpsetPass",
            "FusedNodesCheckPass",
            "fusion_pipeline",
        ]
    },
)
