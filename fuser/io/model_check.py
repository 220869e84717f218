"""Validating an input model before we fuse it: opset imports, standard attribute sets, checker.

A model that is not valid ONNX must be refused, not fused: a truncated file whose
``opset_import`` went missing would otherwise be fused and written with an opset we invented,
and a node with an attribute its op does not have would be fused as if the attribute were not
there. :func:`validate_model` raises :class:`ModelValidationError` with one line naming the
model, the node and the attribute; it runs on the model *header* (external data not loaded), so
it costs no more for a 20 GB model than for a small one:

1. the model imports an opset for the standard domain when a node uses it;
2. every node of the standard domain (``""`` / ``ai.onnx``, in every graph, subgraph and
   function) whose op the installed onnx knows carries only attributes of that op's schema
   (``onnx.defs.get_schema(op, opset, domain)``), of the right type, with the required ones;
3. the ONNX checker (``onnx.checker.check_model``) passes; its reason becomes the message.
   Not its ``full_check``: strict type inference stops at the first value whose type it cannot
   infer, which every output of a com.microsoft node (MatMulNBits) is, so it would refuse most
   quantized models that ORT runs. The checker gets the model with its external tensors' data
   references removed (their files are checked where they are read, by
   :mod:`onnx_moe_fuse.io.external_data`), and with the standard-domain nodes the installed onnx
   has no schema for set aside: ORT's own ops in the ONNX domain (SimplifiedLayerNormalization)
   and ops of a newer opset (GroupedMatMul, opset 29) are valid where they run, and the checker
   would refuse them.

The tensor walkers live here, the one home the loader and the validator share.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from onnx_moe_fuse.errors import ModelValidationError

__all__ = ["all_tensors", "is_external", "location_of", "validate_model"]

_STANDARD_DOMAINS = ("", "ai.onnx")
#: Where the checker's copy puts standard-domain nodes this onnx has no schema for.
_UNCHECKED_DOMAIN = "onnx_moe_fuse.unchecked"
#: Above this size the checker gets a copy without the heavy initializers' data.
_CHECKER_LIMIT = 2**31 - 1 - (64 << 20)


# -- tensors --------------------------------------------------------------------------------------


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for g in attr.graphs:
            yield from _graph_tensors(g)


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model: initializers, attributes, subgraphs, functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def is_external(tensor: onnx.TensorProto) -> bool:
    """Whether the tensor keeps its data in an external file."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def location_of(tensor: onnx.TensorProto) -> str:
    """The ``location`` entry of an external tensor ("" when absent)."""
    for entry in tensor.external_data:
        if entry.key == "location":
            return entry.value
    return ""


# -- nodes ----------------------------------------------------------------------------------------


def _graph_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graph_nodes(attr.g)
            for g in attr.graphs:
                yield from _graph_nodes(g)


def _node_label(node: onnx.NodeProto) -> str:
    return f"{node.op_type}({node.name or (node.output[0] if node.output else '?')})"


def _schema(op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def _check_node_attributes(node: onnx.NodeProto, opset: int, model_name: str) -> None:
    label = _node_label(node)
    schema = _schema(node.op_type, opset)
    if schema is None:
        return  # an op this onnx does not know (a newer opset, ORT's own): ORT decides
    seen: set[str] = set()
    for attr in node.attribute:
        where = f"{model_name}: node {label}: attribute {attr.name!r}"
        if attr.name in seen:
            raise ModelValidationError(None, f"{where} is given twice")
        seen.add(attr.name)
        spec = schema.attributes.get(attr.name)
        if spec is None:
            known = ", ".join(sorted(schema.attributes)) or "none"
            raise ModelValidationError(
                None,
                f"{where} is not an attribute of {node.op_type}-{schema.since_version} "
                f"(its attributes: {known})",
            )
        if attr.ref_attr_name:
            continue  # a function body's reference: typed by the caller
        if attr.type != int(spec.type):
            given = onnx.AttributeProto.AttributeType.Name(attr.type)
            wanted = onnx.AttributeProto.AttributeType.Name(int(spec.type))
            raise ModelValidationError(
                None, f"{where} is of type {given}, {node.op_type} wants {wanted}"
            )
    missing = [n for n, spec in schema.attributes.items() if spec.required and n not in seen]
    if missing:
        raise ModelValidationError(
            None, f"{model_name}: node {label}: required attributes {missing} are missing"
        )


def _onnx_opset(model: onnx.ModelProto) -> int | None:
    """The imported ONNX opset (None when the model imports none)."""
    imports = {entry.domain or "": entry.version for entry in model.opset_import}
    return imports.get("", imports.get("ai.onnx"))


def _all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = list(_graph_nodes(model.graph))
    for function in model.functions:
        nodes += list(function.node)
    return nodes


def _check_opsets_and_attributes(model: onnx.ModelProto, model_name: str) -> None:
    opset = _onnx_opset(model)
    nodes = _all_nodes(model)
    if not model.opset_import:
        raise ModelValidationError(
            None,
            f"{model_name}: the model imports no opset (opset_import is empty: a truncated or "
            "damaged file?); refusing to guess which ONNX version its nodes follow",
        )
    for node in nodes:
        domain = node.domain or ""
        if domain not in _STANDARD_DOMAINS:
            continue
        if opset is None:
            raise ModelValidationError(
                None,
                f"{model_name}: node {_node_label(node)} uses the ONNX domain, "
                "but the model imports no ONNX opset",
            )
        _check_node_attributes(node, opset, model_name)


def _stripped(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor`` without its data (and shape [0]): what the structural check needs of it."""
    light = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=[0])
    light.doc_string = tensor.doc_string
    return light


def _copy_fields(source, target, skip: str) -> None:
    """Copy every set field of a protobuf message but ``skip`` (which may be huge)."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # repeated
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):  # message
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy the checker can take.

    The checker would open external data files itself (relative to the working folder), and
    cannot take a message over protobuf's 2 GB limit; the data is checked where it is read. A
    heavy or external initializer becomes a graph input of its type and shape; an external
    tensor inside a node (rare) keeps its type and loses its data.
    """
    external = any(is_external(t) for t in all_tensors(model))
    try:
        heavy = model.ByteSize() > _CHECKER_LIMIT
    except (ValueError, OverflowError):
        heavy = True
    opset = _onnx_opset(model)
    unknown = opset is not None and any(_is_unknown(n, opset) for n in _all_nodes(model))
    unranked = any(_unranked(v) for v in [*model.graph.input, *model.graph.output])
    if not external and not heavy and not unknown and not unranked:
        return model
    if not external and not heavy:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return _give_ranks(_set_aside_unknown(copy, opset))
    graph = onnx.GraphProto()
    _copy_fields(model.graph, graph, skip="initializer")
    inputs = {i.name for i in graph.input}
    for init in model.graph.initializer:
        if not (is_external(init) or init.ByteSize() > 1 << 20):
            graph.initializer.append(init)
        elif init.name not in inputs:
            graph.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    copy = onnx.ModelProto()
    _copy_fields(model, copy, skip="graph")
    copy.graph.CopyFrom(graph)
    for tensor in all_tensors(copy):  # external tensors in attributes and subgraphs
        if is_external(tensor):
            tensor.CopyFrom(_stripped(tensor))
    return _give_ranks(_set_aside_unknown(copy, opset))


def _unranked(value: onnx.ValueInfoProto) -> bool:
    return value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape")


def _give_ranks(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give graph inputs and outputs of unknown rank a shape field, for the checker only.

    The checker demands the field, but a tensor of unknown rank is valid ONNX (ORT runs it, and
    onnx-ir writes outputs it has no shape for that way); the structural check does not use it.
    """
    for value in [*model.graph.input, *model.graph.output]:
        if _unranked(value):
            value.type.tensor_type.shape.SetInParent()
    return model


def _is_unknown(node: onnx.NodeProto, opset: int) -> bool:
    return (node.domain or "") in _STANDARD_DOMAINS and _schema(node.op_type, opset) is None


def _set_aside_unknown(model: onnx.ModelProto, opset: int | None) -> onnx.ModelProto:
    """Move standard-domain nodes this onnx has no schema for into a domain the checker skips.

    ORT registers some ops of its own in the ONNX domain (SimplifiedLayerNormalization), and a
    model may use a newer opset than the installed onnx knows (GroupedMatMul, opset 29): the
    checker would refuse both, though ORT (or onnx-weekly) runs them. The rest is checked.
    """
    if opset is None:
        return model
    for node in _all_nodes(model):
        if _is_unknown(node, opset):
            node.domain = _UNCHECKED_DOMAIN
    model.opset_import.append(onnx.helper.make_opsetid(_UNCHECKED_DOMAIN, 1))
    return model


def _check_text(message, model_name: str, where: str = "model") -> None:
    """Refuse string fields that are not UTF-8 (protobuf hands them over as bytes, not text)."""
    for field, value in message.ListFields():
        if field.type == field.TYPE_STRING:
            items = (
                value if isinstance(value, (list, tuple)) or hasattr(value, "extend") else [value]
            )
            if any(isinstance(item, bytes) for item in items):
                raise ModelValidationError(
                    None,
                    f"{model_name}: the text of {where}.{field.name} is not UTF-8 "
                    "(a damaged file?)",
                )
        elif field.message_type is not None:
            if hasattr(value, "extend"):  # repeated messages
                for item in value:
                    _check_text(item, model_name, f"{where}.{field.name}")
            else:
                _check_text(value, model_name, f"{where}.{field.name}")


def validate_model(model: onnx.ModelProto, model_name: str = "model") -> None:
    """Refuse a model that is not valid ONNX, with one line naming the node and the reason.

    ``model`` may hold external data references (not loaded): their files are not opened; a
    model over 2 GB in memory is checked without its heavy initializers' data.

    Raises:
        ModelValidationError: text that is not UTF-8, no opset imports, an attribute its op's
            schema lacks (or of the wrong type, or a required one missing), or the ONNX
            checker's reason.
    """
    _check_text(model, model_name)
    _check_opsets_and_attributes(model, model_name)
    checkable = _checkable(model)
    try:
        onnx.checker.check_model(checkable)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())
        raise ModelValidationError(
            None, f"{model_name}: the ONNX checker refuses the model: {reason}"
        ) from exc
