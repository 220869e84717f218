"""What the fusion passes share: the ops they emit, the private domain, node labels and rule names."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.contract.ops import MS_DOMAIN
from onnx_moe_fuse.rewrites.graph.facts import label as graph_label
from onnx_moe_fuse.rewrites.moe.layer_rules import (
    FUSED_OPS,
    REPLACED_KEY,
    RULE_CLASSES,
)
from onnx_moe_fuse.rewrites.qkv import rule as qkv

#: Every op the pipeline can emit.
ALL_FUSED_OPS = FUSED_OPS | {qkv.FUSED_OP}


#: Private domain for internal ops. The rules work on the standard-ONNX graph directly and never
#: create one; the postcondition keeps it that way.
INTERNAL_DOMAIN = "ai.onnx_moe_fuse.internal"


_RULE_PREFIXES = (*(cls.__name__ for cls in RULE_CLASSES), f"{qkv.FUSED_OP}[")


_RULE_NAME_TAG = "pkg.onnxscript.rewriter.rule_name"


def label(node: ir.Node | None) -> str | None:
    """A report's name for ``node`` (:func:`~onnx_moe_fuse.rewrites.graph.facts.label`), None for none."""
    return None if node is None else graph_label(node)


def rule_name(node: ir.Node) -> str | None:
    """The layer rule that emitted ``node``.

    onnxscript tags a replacement node with the rule's name, then appends (", ") the tags the
    replaced nodes carried: an exporter that ran onnxscript rules itself (torch.onnx runs
    ``MaterializeReshapeShape``) leaves e.g. ``"FusedSwiGLUMoELayer[...], MaterializeReshapeShape"``.
    """
    tag = node.metadata_props.get(_RULE_NAME_TAG, "")
    return next((r for r in tag.split(", ") if r.startswith(_RULE_PREFIXES)), None)


def fused_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.domain == MS_DOMAIN and REPLACED_KEY in n.metadata_props]


def attr_value(attr: ir.Attr) -> Any:
    """A plain Python value; a FLOAT attribute as the shortest decimal of its float32."""
    v = attr.value
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if attr.type == ir.AttributeType.FLOAT:
        return v if math.isinf(v) else float(str(np.float32(v)))
    return v
