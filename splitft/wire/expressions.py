"""Torch functions of the cloud half's tensors, as both sides name them: what a script computes
from a cloud gradient or weight (a NaN guard, the largest gradient for a log, sign SGD, weight
decay added to the gradient by hand) is sent as an expression and computed in the cloud.

An expression is a tree of plain values. A node is ``{"fn": NAME, "args": [...], "kwargs": {...}}``;
a leaf is ``{"grad": name}`` (a cloud parameter's gradient), ``{"value": name}`` (a cloud
parameter or buffer), ``{"array": ndarray, "dtype": name}`` (a tensor of the edge's, in its own
dtype), a number, a flag, None, a short string (``"fro"``), a dtype as ``{"dtype": name}``, or a list of ints (dimensions).
``NAME`` is one of :data:`FUNCTIONS`: each is the very callable the unsplit script would have
called (``Tensor.abs``, ``Tensor.__rtruediv__``, ``torch.isfinite``), so the cloud computes the
same values, bitwise. None of them draws from a generator, and none makes a tensor larger than
its operands broadcast together (the cloud checks the sizes on meta tensors before it computes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import ProtocolError

_METHODS = (
    # elementwise, one tensor
    "abs", "neg", "sign", "sgn", "signbit", "sqrt", "rsqrt", "exp", "log", "log2", "log10", "log1p", "expm1",
    "square", "reciprocal", "isfinite", "isnan", "isinf", "isposinf", "isneginf", "logical_not", "nan_to_num",
    "sigmoid", "tanh", "floor", "ceil", "round", "trunc", "frac", "float", "double", "half", "bfloat16", "clone",
    "detach", "__neg__", "__abs__", "__invert__",
    # elementwise, with another tensor or a number
    "add", "sub", "mul", "div", "true_divide", "pow", "maximum", "minimum", "fmax", "fmin", "eq", "ne", "gt", "ge",
    "lt", "le", "logical_and", "logical_or", "logical_xor", "clamp", "clip", "clamp_min", "clamp_max", "where",
    "lerp", "remainder", "fmod", "hypot", "atan2", "masked_fill",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__pow__",
    "__rpow__", "__eq__", "__ne__", "__gt__", "__ge__", "__lt__", "__le__", "__and__", "__rand__", "__or__",
    "__ror__", "__xor__", "__rxor__", "__mod__",
    # reductions
    "sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "all", "any", "prod", "norm", "std", "var",
    "count_nonzero",
    # rows scaled by their norms (a max-norm constraint after each step)
    "renorm",
)

#: In-place methods: their first tensor (a cloud gradient or weight) takes the result.
IN_PLACE = frozenset((
    "add_", "sub_", "mul_", "div_", "pow_", "sign_", "sgn_", "abs_", "neg_", "sqrt_", "square_", "reciprocal_",
    "clamp_", "clip_", "clamp_min_", "clamp_max_", "nan_to_num_", "copy_", "masked_fill_", "lerp_", "addcmul_",
    "addcdiv_", "__iadd__", "__isub__", "__imul__", "__itruediv__", "renorm_",
))

_TORCH = (
    "abs", "neg", "sign", "sqrt", "square", "exp", "log", "isfinite", "isnan", "isinf", "logical_not", "nan_to_num",
    "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "gt", "ge", "lt", "le", "logical_and",
    "logical_or", "clamp", "clip", "where", "lerp", "sum", "mean", "amax", "amin", "max", "min", "all", "any", "prod",
    "norm", "std", "var", "count_nonzero", "nansum", "nanmean",
)


def _table() -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for name in (*_METHODS, *IN_PLACE):
        method = getattr(torch.Tensor, name, None)
        if method is not None:
            found[name] = method
    for name in _TORCH:
        function = getattr(torch, name, None)
        if function is not None:
            found[f"torch.{name}"] = function
    found["torch.linalg.vector_norm"] = torch.linalg.vector_norm
    return found


#: Every function an expression may call, by the name that travels.
FUNCTIONS: dict[str, Callable[..., Any]] = _table()
#: The same, by callable: how the edge names what a script called.
NAMES: dict[Any, str] = {function: name for name, function in FUNCTIONS.items()}

#: The most nodes (calls and leaves) one expression may hold, and the deepest it may nest.
MOST_NODES = 64
MOST_DEPTH = 16

_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as it travels (refused when it cannot)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ProtocolError(f"dtype {name} cannot travel in an expression")
    return name


def dtype_of(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ProtocolError(f"an expression names dtype {str(name)[:40]!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[name]


def array_leaf(tensor: torch.Tensor) -> dict:
    """An edge tensor as an expression leaf, its dtype kept (bfloat16 travels as float32: exact)."""
    host = tensor.detach().cpu()
    wire = host.float() if host.dtype == torch.bfloat16 else host
    return {"array": wire.contiguous().numpy(), "dtype": dtype_name(host.dtype)}  # a 0-d tensor stays 0-d


def check(node: Any, what: str, in_place: bool = False) -> int:
    """Refuse an expression of the wrong shape, too large or too deep, before any of it runs;
    returns its node count. An in-place call may only be the root of a ``compute`` operation
    (``in_place``): anywhere else it would change a cloud tensor out of the operations' order, or
    in an evaluation that is to change nothing (on a half every edge shares, too)."""
    count = 0

    def walk(value: Any, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MOST_NODES or depth > MOST_DEPTH:
            raise ProtocolError(f"{what}: an expression holds at most {MOST_NODES} nodes, {MOST_DEPTH} deep")
        if value is None or isinstance(value, (bool, int, float)):
            return
        if isinstance(value, str):  # norm's "fro", div's rounding_mode
            if len(value) > 16:
                raise ProtocolError(f"{what}: a string in an expression holds at most 16 characters")
            return
        if isinstance(value, list):
            if len(value) > 8 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ProtocolError(f"{what}: a list in an expression holds at most 8 dimensions (ints)")
            return
        if not isinstance(value, dict):
            raise ProtocolError(f"{what}: an expression holds maps, numbers, flags and dimensions, not "
                                f"{type(value).__name__}")
        keys = set(value)
        if keys == {"fn", "args", "kwargs"}:
            if not isinstance(value["fn"], str) or value["fn"] not in FUNCTIONS:
                raise ProtocolError(f"{what}: {str(value['fn'])[:40]!r} is not a function an expression may call")
            if value["fn"] in IN_PLACE and not (in_place and depth == 0):
                raise ProtocolError(f"{what}: {value['fn']!r} changes its operand in place, which only a compute "
                                    "operation's own call may")
            if not isinstance(value["args"], list) or not isinstance(value["kwargs"], dict) or \
                    not all(isinstance(k, str) for k in value["kwargs"]):
                raise ProtocolError(f"{what}: a call's args must be a list and its kwargs a map by name")
            for item in (*value["args"], *value["kwargs"].values()):
                walk(item, depth + 1)
        elif keys in ({"grad"}, {"value"}):
            if not isinstance(next(iter(value.values())), str):
                raise ProtocolError(f"{what}: a cloud tensor is named by a string")
        elif keys == {"array", "dtype"}:
            if not isinstance(value["array"], np.ndarray):
                raise ProtocolError(f"{what}: an array leaf holds an array")
            dtype_of(value["dtype"])
        elif keys == {"dtype"}:
            dtype_of(value["dtype"])
        else:
            raise ProtocolError(f"{what}: an expression node has keys {sorted(map(str, keys))[:6]}")

    walk(node, 0)
    return count


def nodes(expressions: Any) -> int:
    """How many nodes a list of expressions holds (what their price counts; 0 when malformed,
    which their own check refuses later)."""
    try:
        return sum(check(node, "pricing") for node in expressions) if isinstance(expressions, list) else 0
    except ProtocolError:
        return 0


__all__ = ["FUNCTIONS", "IN_PLACE", "MOST_DEPTH", "MOST_NODES", "NAMES", "array_leaf", "check", "dtype_name",
           "dtype_of", "nodes"]
