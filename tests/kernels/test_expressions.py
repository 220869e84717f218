"""The manifest expression evaluator: what it computes and what it refuses."""

from __future__ import annotations

import re

import pytest

from onnx_moe_fuse.kernels.expressions import (
    ExpressionError,
    FeatureSet,
    Record,
    Scope,
    parse,
)


def scope(**extra) -> Scope:
    values = {
        "attrs": Record("attrs", {"k": 2, "activation_type": "swiglu", "block_size": 32}),
        "shapes": Record("shapes", {"input": [3, 5, 64], "aT": [7, 64]}),
        "ranks": Record("ranks", {"input": 3}),
        "device": Record(
            "device",
            {
                "limits": Record("device.limits", {"maxBufferSize": 1 << 30}),
                "features": FeatureSet("device.features", ["subgroups", "shader-f16"]),
                "adapterInfo": Record("device.adapterInfo", {"subgroupMinSize": 8}),
            },
        ),
    }
    values.update(extra)
    return Scope(
        values=values,
        derived={
            "hidden": "dim(shapes.input, ranks.input - 1)",
            "tokens": "numel(shapes.input) / max(1, hidden)",
            "loopA": "loopB + 1",
            "loopB": "loopA",
        },
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("ceilDiv(10, 4)", 3),
        ("tokens", 15),
        ("hidden / 3", 64 / 3),
        ("hidden / 32", 2),
        ("7 // 2", 3),
        ("floor(7 / 2)", 3),
        ("pow2ceil(17)", 32),
        ("pow2ceil(16) == 16", True),
        ("min(3, 1, 2) + max(4, 9)", 10),
        ('2 if attrs.activation_type == "swiglu" else 1', 2),
        ('has(attrs, "block_size") and not has(attrs, "swiglu_limit")', True),
        ('device.features.has("subgroups")', True),
        ('device.features.has("subgroup-size-control")', False),
        ("shapes.aT[:-1] + [attrs.k]", [7, 2]),
        ("sameShape(prefix(shapes.input, 2), [3, 5])", True),
        ("1 < hidden <= 64", True),
        ("true and not false", True),
        ("hidden % 32 == 0 or missingName", True),
        ('"f16" if false else "f32"', "f32"),
        ("-attrs.k", -2),
    ],
)
def test_evaluates(source, expected):
    assert scope().evaluate(source) == expected


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("__import__('os')", "'__import__'"),
        ("attrs.__class__", "attribute '__class__' is not allowed"),
        ("(lambda: 1)()", "only named functions may be called"),
        ("lambda: 1", "'Lambda' is not allowed"),
        ("[x for x in shapes.aT]", "'ListComp' is not allowed"),
        ("open('/etc/passwd')", "unknown function 'open'"),
        ("attrs.nope", "attrs has no 'nope'"),
        ("undefinedName + 1", "unknown name 'undefinedName'"),
        ("dim(shapes.aT, 5)", "axis 5 is outside a shape of rank 2"),
        ("ceilDiv(1, 0)", "division by zero"),
        ("loopA", "derive cycle: loopA -> loopB -> loopA"),
        ("shapes.aT.split()", "method 'split' is not allowed"),
        ("min(k=1)", "keyword arguments are not allowed"),
        ("1 +", "cannot parse"),
        ('attrs.k + "a"', "'+' needs numbers"),
    ],
)
def test_refuses_with_a_clear_message(source, message):
    with pytest.raises(ExpressionError, match=re.escape(message)):
        scope().evaluate(source, what="test")


def test_errors_name_the_expression():
    with pytest.raises(ExpressionError, match=r"derive 'x' 'attrs\.missing': attrs has no"):
        scope().child(derived={"x": "attrs.missing"}).lookup("x")


def test_parse_is_cached_and_never_uses_eval(monkeypatch):
    import builtins

    monkeypatch.setattr(builtins, "eval", lambda *a, **k: pytest.fail("eval was called"))
    assert parse("1 + 2") is parse("1 + 2")
    assert scope().evaluate("ceilDiv(7, 2) * 2") == 8
