"""A small, safe evaluator for the expressions in kernel manifests.

Manifest expressions are JavaScript-flavoured Python: ``ceilDiv(numTokens, 64)``,
``device.features.has("subgroups")``, ``shapes.aT[:-1] + [attrs.Nq]``,
``2 if weightBits == 4 else 1``. They are parsed with :mod:`ast` and walked by a
whitelisting interpreter: only the node kinds below, the functions in
:data:`FUNCTIONS` and the names of the namespace are allowed. Nothing is ever
passed to ``eval``.

Division follows the manifests' JavaScript heritage: ``a / b`` is exact, and an
integral result is returned as ``int`` (so ``hiddenSize / blockSize`` stays an
integer where it divides), otherwise as ``float``.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class ExpressionError(ValueError):
    """An expression is malformed, uses something not allowed, or failed to evaluate."""


class Record:
    """A read-only namespace whose keys are reached as attributes (``attrs.k``).

    ``has`` (as ``device.features.has("x")`` or ``has(attrs, "k")``) asks whether a key
    exists. A missing key is an error naming the namespace and the key.
    """

    def __init__(self, name: str, values: Mapping[str, Any]):
        self._name = name
        self._values = dict(values)

    @property
    def name(self) -> str:
        """The namespace's name, used in error messages."""
        return self._name

    def has(self, key: str) -> bool:
        """Whether ``key`` is present."""
        return key in self._values

    def get(self, key: str) -> Any:
        """The value of ``key``; an :class:`ExpressionError` names what is missing."""
        try:
            return self._values[key]
        except KeyError:
            known = ", ".join(sorted(self._values)) or "none"
            raise ExpressionError(f"{self._name} has no '{key}' (known: {known})") from None

    def to_dict(self) -> dict[str, Any]:
        """A copy of the values."""
        return dict(self._values)

    def keys(self) -> list[str]:
        """The keys, sorted."""
        return sorted(self._values)

    def __repr__(self) -> str:
        return f"Record({self._name!r}, {self._values!r})"


class FeatureSet(Record):
    """A set of feature names, asked with ``device.features.has("name")``."""

    def __init__(self, name: str, features: Sequence[str]):
        super().__init__(name, {f: True for f in features})


def _ceil_div(a: Any, b: Any) -> int:
    a, b = _int_arg("ceilDiv", a), _int_arg("ceilDiv", b)
    if b == 0:
        raise ExpressionError("ceilDiv: division by zero")
    return -(-a // b)


def _int_arg(fn: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExpressionError(f"{fn}: expected a number, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ExpressionError(f"{fn}: expected an integer, got {value!r}")
        return int(value)
    return value


def _shape_arg(fn: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ExpressionError(f"{fn}: expected a shape (list of dims), got {value!r}")
    return tuple(value)


def _dim(shape: Any, axis: Any) -> int:
    dims = _shape_arg("dim", shape)
    axis = _int_arg("dim", axis)
    if not 0 <= axis < len(dims):
        raise ExpressionError(
            f"dim: axis {axis} is outside a shape of rank {len(dims)} {list(dims)}"
        )
    return dims[axis]


def _numel(shape: Any) -> int:
    return math.prod(_shape_arg("numel", shape))


def _pow2ceil(value: Any) -> int:
    v = _int_arg("pow2ceil", value)
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def _has(container: Any, key: Any) -> bool:
    if not isinstance(key, str):
        raise ExpressionError(f"has: the key must be a string, got {key!r}")
    if isinstance(container, Record):
        return container.has(key)
    if isinstance(container, Mapping):
        return key in container
    raise ExpressionError(f"has: expected a namespace, got {container!r}")


def _same_shape(a: Any, b: Any) -> bool:
    return tuple(_shape_arg("sameShape", a)) == tuple(_shape_arg("sameShape", b))


def _prefix(shape: Any, count: Any) -> list[int]:
    dims = _shape_arg("prefix", shape)
    n = _int_arg("prefix", count)
    if not 0 <= n <= len(dims):
        raise ExpressionError(f"prefix: {n} dims asked of a shape of rank {len(dims)}")
    return list(dims[:n])


def _floor(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExpressionError(f"floor: expected a number, got {value!r}")
    return math.floor(value)


def _min(*values: Any) -> Any:
    if not values:
        raise ExpressionError("min: needs at least one argument")
    return min(values)


def _max(*values: Any) -> Any:
    if not values:
        raise ExpressionError("max: needs at least one argument")
    return max(values)


#: Functions every expression may call. ``f16Ok`` depends on the device and is added
#: by the caller's namespace (see :func:`make_f16_ok`).
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "dim": _dim,
    "numel": _numel,
    "ceilDiv": _ceil_div,
    "min": _min,
    "max": _max,
    "floor": _floor,
    "pow2ceil": _pow2ceil,
    "has": _has,
    "sameShape": _same_shape,
    "prefix": _prefix,
    "abs": abs,
}


#: Functions whose meaning depends on the device; the planner supplies them.
DEVICE_FUNCTIONS = ("f16Ok",)


def make_f16_ok(has_shader_f16: bool) -> Callable[[Any], bool]:
    """``f16Ok(dtype)``: true unless ``dtype`` is float16 and the device lacks shader-f16."""

    def f16_ok(dtype: Any) -> bool:
        return dtype != "float16" or has_shader_f16

    return f16_ok


def _true_div(a: Any, b: Any) -> Any:
    if b == 0:
        raise ExpressionError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a % b == 0:
        return a // b
    result = a / b
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        return int(result)
    return result


def _mod(a: Any, b: Any) -> Any:
    if b == 0:
        raise ExpressionError("modulo by zero")
    return a % b


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) + list(b)
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    _numbers("+", a, b)
    return a + b


def _numbers(op: str, *values: Any) -> None:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ExpressionError(f"'{op}' needs numbers, got {v!r}")


def _arith(op: str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def apply(a: Any, b: Any) -> Any:
        _numbers(op, a, b)
        return fn(a, b)

    return apply


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: _add,
    ast.Sub: _arith("-", operator.sub),
    ast.Mult: _arith("*", operator.mul),
    ast.Div: _arith("/", _true_div),
    ast.FloorDiv: _arith("//", lambda a, b: _true_div(a - _mod(a, b), b)),
    ast.Mod: _arith("%", _mod),
    ast.Pow: _arith("**", operator.pow),
}

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


@functools.lru_cache(maxsize=4096)
def parse(source: str) -> ast.expr:
    """Parse ``source`` into an expression tree, rejecting anything not whitelisted."""
    if not isinstance(source, str):
        raise ExpressionError(f"expected an expression string, got {source!r}")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"cannot parse: {exc.msg}") from None
    _check_nodes(tree.body, source)
    return tree.body


_ALLOWED_NODES = (
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.Attribute,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.List,
    ast.Tuple,
    ast.Subscript,
    ast.Slice,
    *_BINARY,
    *_COMPARE,
)


def _check_nodes(node: ast.AST, source: str) -> None:
    for child in ast.walk(node):
        if not isinstance(child, _ALLOWED_NODES):
            raise ExpressionError(f"'{type(child).__name__}' is not allowed")
        if isinstance(child, ast.Attribute) and child.attr.startswith("_"):
            raise ExpressionError(f"attribute '{child.attr}' is not allowed")
        if isinstance(child, ast.Call):
            if child.keywords:
                raise ExpressionError("keyword arguments are not allowed")
            func = child.func
            if isinstance(func, ast.Attribute):
                if func.attr != "has":
                    raise ExpressionError(f"method '{func.attr}' is not allowed")
            elif not isinstance(func, ast.Name):
                raise ExpressionError("only named functions may be called")
            elif func.id not in FUNCTIONS and func.id not in DEVICE_FUNCTIONS:
                raise ExpressionError(f"unknown function '{func.id}'")
        if isinstance(child, ast.Constant) and not isinstance(
            child.value, (int, float, str, bool, type(None))
        ):
            raise ExpressionError(f"constant {child.value!r} is not allowed")


class Scope:
    """Names visible to an expression: namespaces, functions and lazily derived values.

    ``values`` holds plain names (namespaces such as ``attrs`` and already known
    values); ``derived`` maps further names to expressions that are evaluated on
    first use, in whatever order they refer to one another, with cycle detection.
    A child scope (``child``) sees its parent's names and may add or shadow some.
    """

    def __init__(
        self,
        values: Mapping[str, Any] | None = None,
        derived: Mapping[str, str] | None = None,
        parent: Scope | None = None,
        functions: Mapping[str, Callable[..., Any]] | None = None,
    ):
        self._values: dict[str, Any] = dict(values or {})
        self._derived: dict[str, str] = dict(derived or {})
        self._parent = parent
        self._functions = dict(functions or {})
        self._evaluating: list[str] = []

    def child(
        self, values: Mapping[str, Any] | None = None, derived: Mapping[str, str] | None = None
    ) -> Scope:
        """A scope that adds ``values`` and ``derived`` names on top of this one."""
        return Scope(values, derived, parent=self)

    def function(self, name: str) -> Callable[..., Any] | None:
        """The function called ``name``, or None."""
        if name in self._functions:
            return self._functions[name]
        if self._parent is not None:
            return self._parent.function(name)
        return FUNCTIONS.get(name)

    def derived_expressions(self) -> dict[str, Any]:
        """Every derive expression visible here (inner scopes shadow outer ones)."""
        merged = self._parent.derived_expressions() if self._parent is not None else {}
        merged.update(self._derived)
        return merged

    def has_name(self, name: str) -> bool:
        """Whether ``name`` is defined here or in a parent."""
        if name in self._values or name in self._derived:
            return True
        return self._parent is not None and self._parent.has_name(name)

    def lookup(self, name: str) -> Any:
        """The value of ``name``, evaluating its derive expression on first use."""
        if name in self._values:
            return self._values[name]
        if name in self._derived:
            if name in self._evaluating:
                cycle = " -> ".join([*self._evaluating, name])
                raise ExpressionError(f"derive cycle: {cycle}")
            self._evaluating.append(name)
            try:
                value = self.evaluate(self._derived[name], what=f"derive '{name}'")
            finally:
                self._evaluating.pop()
            self._values[name] = value
            return value
        if self._parent is not None:
            return self._parent.lookup(name)
        raise ExpressionError(f"unknown name '{name}'")

    def evaluate(self, source: Any, what: str | None = None) -> Any:
        """Evaluate ``source`` (an expression string, or a plain number/bool/list).

        Errors are :class:`ExpressionError` naming ``what`` (or the expression) and
        what failed.
        """
        if isinstance(source, bool) or isinstance(source, (int, float)):
            return source
        if isinstance(source, list):
            return [self.evaluate(item, what) for item in source]
        try:
            return _Interpreter(self).visit(parse(source))
        except ExpressionError as exc:
            label = what or "expression"
            message = str(exc)
            if message.startswith(f"{label} "):
                raise
            raise ExpressionError(f"{label} {source!r}: {message}") from None
        except (TypeError, ArithmeticError, IndexError) as exc:
            label = what or "expression"
            raise ExpressionError(f"{label} {source!r}: {exc}") from None


class _Interpreter:
    """Evaluates a whitelisted expression tree against a :class:`Scope`."""

    def __init__(self, scope: Scope):
        self.scope = scope

    def visit(self, node: ast.expr) -> Any:
        method = getattr(self, f"visit_{type(node).__name__}", None)
        if method is None:  # pragma: no cover - parse() already rejects these
            raise ExpressionError(f"'{type(node).__name__}' is not allowed")
        return method(node)

    def visit_Constant(self, node: ast.Constant) -> Any:
        return node.value

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id in ("true", "True"):
            return True
        if node.id in ("false", "False"):
            return False
        if self.scope.has_name(node.id):
            return self.scope.lookup(node.id)
        if self.scope.function(node.id) is not None:
            raise ExpressionError(f"function '{node.id}' used as a value")
        raise ExpressionError(f"unknown name '{node.id}'")

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        base = self.visit(node.value)
        if isinstance(base, Record):
            return base.get(node.attr)
        raise ExpressionError(f"'.{node.attr}' asked of {base!r}, which is not a namespace")

    def visit_Subscript(self, node: ast.Subscript) -> Any:
        base = self.visit(node.value)
        if isinstance(node.slice, ast.Slice):
            parts = [
                None if part is None else self.visit(part)
                for part in (node.slice.lower, node.slice.upper, node.slice.step)
            ]
            if not isinstance(base, (list, tuple)):
                raise ExpressionError(f"cannot slice {base!r}")
            return list(base[slice(*parts)])
        key = self.visit(node.slice)
        if isinstance(base, Record):
            return base.get(key)
        if isinstance(base, (list, tuple)):
            index = _int_arg("index", key)
            if not -len(base) <= index < len(base):
                raise ExpressionError(f"index {index} is outside {list(base)}")
            return base[index]
        raise ExpressionError(f"cannot index {base!r}")

    def visit_List(self, node: ast.List) -> Any:
        return [self.visit(e) for e in node.elts]

    visit_Tuple = visit_List

    def visit_BoolOp(self, node: ast.BoolOp) -> Any:
        is_and = isinstance(node.op, ast.And)
        value: Any = is_and
        for operand in node.values:
            value = self.visit(operand)
            if bool(value) != is_and:
                return value
        return value

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        value = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return not value
        _numbers("unary minus", value)
        return -value if isinstance(node.op, ast.USub) else value

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        return _BINARY[type(node.op)](self.visit(node.left), self.visit(node.right))

    def visit_Compare(self, node: ast.Compare) -> Any:
        left = self.visit(node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.visit(right_node)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def visit_IfExp(self, node: ast.IfExp) -> Any:
        return self.visit(node.body) if self.visit(node.test) else self.visit(node.orelse)

    def visit_Call(self, node: ast.Call) -> Any:
        args = [self.visit(a) for a in node.args]
        func = node.func
        if isinstance(func, ast.Attribute):  # only `<namespace>.has("key")` passes parse()
            base = self.visit(func.value)
            if not isinstance(base, Record):
                raise ExpressionError(f"'.has' asked of {base!r}, which is not a namespace")
            if len(args) != 1:
                raise ExpressionError(".has takes one argument")
            return _has(base, args[0])
        assert isinstance(func, ast.Name)
        fn = self.scope.function(func.id)
        if fn is None:
            raise ExpressionError(f"unknown function '{func.id}'")
        try:
            return fn(*args)
        except ExpressionError as exc:
            raise ExpressionError(f"{func.id}(): {exc}") from None
        except TypeError as exc:
            raise ExpressionError(f"{func.id}(): {exc}") from None


def referenced_names(source: str) -> set[str]:
    """The bare names an expression refers to (namespaces, derived names)."""
    return {n.id for n in ast.walk(parse(source)) if isinstance(n, ast.Name)}
