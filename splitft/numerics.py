"""Process-wide numeric settings: what a script sets on torch that changes what every layer computes.

``torch.set_float32_matmul_precision("high")``, ``torch.use_deterministic_algorithms(True)``,
``torch.backends.cuda.matmul.allow_tf32 = True``, ``torch.set_default_dtype(...)``: a script sets
them on its own process, and in a split model they reach only the edge's layers. The cloud's
layers compute in another process, with that process's settings. So the handshake carries the
edge's settings and the cloud refuses a session whose settings differ from its own (those of an
accelerator only when both can compute on one), and after ``split()`` the first cloud module
refuses a forward once one of them changed. Either way the refusal names the setting: a split
that computed with other kernels than the unsplit model would differ from it silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from .errors import ConfigError, HandshakeError

#: Settings that change what a layer computes on any device, by the expression that reads them.
HOST = (
    "torch.get_float32_matmul_precision()",
    "torch.get_default_dtype()",
    "torch.are_deterministic_algorithms_enabled()",
    "torch.backends.mkldnn.enabled",
    "torch.backends.mkldnn.deterministic",
    "torch.backends.mkldnn.matmul.fp32_precision",
    "torch.backends.mkldnn.conv.fp32_precision",
    "torch.backends.mkldnn.rnn.fp32_precision",
    "torch.backends.opt_einsum.enabled",
    "torch.backends.opt_einsum.strategy",
    # scaled_dot_product_attention's kernels on the CPU too (flash or math): what
    # torch.nn.attention.sdpa_kernel(...) switches, despite the module's name
    "torch.backends.cuda.flash_sdp_enabled()",
    "torch.backends.cuda.math_sdp_enabled()",
)
#: Settings that change what a layer computes on a CUDA device only.
CUDA = (
    "torch.backends.cuda.matmul.allow_tf32",
    "torch.backends.cuda.matmul.fp32_precision",
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_fp16_accumulation",
    "torch.backends.cuda.preferred_blas_library()",
    "torch.backends.cuda.mem_efficient_sdp_enabled()",
    "torch.backends.cuda.cudnn_sdp_enabled()",
    "torch.backends.cudnn.enabled",
    "torch.backends.cudnn.deterministic",
    "torch.backends.cudnn.allow_tf32",
    "torch.backends.cudnn.conv.fp32_precision",
    "torch.backends.cudnn.rnn.fp32_precision",
)
#: Whether the calling thread flushes denormal numbers to zero (``torch.set_flush_denormal``),
#: which has no reader: seen by multiplying one. The flag is the CPU's (per thread), so numpy's
#: scalar arithmetic sees it as torch's kernels do, for a fraction of a torch call.
FLUSH_DENORMAL = "torch.set_flush_denormal"
_DENORMAL = np.float32(1e-39)
_ONE = np.float32(1.0)
#: Where an operator's float32 precision of "none" defers to (see :func:`_precision`).
_PARENTS = ("torch.backends.fp32_precision", "torch.backends.mkldnn.fp32_precision",
            "torch.backends.cudnn.fp32_precision")


@functools.cache
def _owner(expression: str) -> tuple[object, str] | None:
    """The object ``expression`` reads its last name from, and that name (None where this torch
    has no such setting)."""
    path = expression.removesuffix("()").split(".")[1:]
    owner: object = torch
    try:
        for part in path[:-1]:
            owner = getattr(owner, part)
        getattr(owner, path[-1])
    except (AttributeError, RuntimeError):
        return None
    return owner, path[-1]


def _reader(expression: str) -> Callable[[], object] | None:
    """How to read ``expression`` in this torch (None where this version has no such setting)."""
    found = _owner(expression)
    if found is None:
        return None
    owner, last = found
    if expression.endswith("()"):
        return lambda: getattr(owner, last)()
    return lambda: getattr(owner, last)


def _direct(expression: str) -> Callable[[], object] | None:
    """The function reading ``expression`` ends up in, found once (None: none simpler than the
    expression). torch's backend flags are properties of module stand-ins and precision objects,
    each read a chain of Python lookups, which a guard run before every forward takes cold."""
    found = _owner(expression)
    if found is None:
        return None
    owner, last = found
    if expression.endswith("()"):
        return getattr(owner, last)  # a function of torch's: itself
    prop = type(owner).__dict__.get(last)
    if callable(getter := getattr(prop, "getter", None)):  # a flag of a backend module (torch.backends.ContextProp)
        return getter
    read_precision = getattr(torch._C, "_get_fp32_precision_getter", None)
    if last == "fp32_precision" and read_precision is not None and isinstance(
            backend := getattr(owner, "backend", None), str) and isinstance(op := getattr(owner, "op", None), str):
        return functools.partial(read_precision, backend, op)  # a backend operator's precision
    return None


def _read(expression: str) -> str | None:
    read = _reader(expression)
    if read is None:
        return None
    try:
        return str(read())
    except RuntimeError:  # a setting this build cannot report (no such backend)
        return None


def _precision(expression: str) -> str | None:
    """An operator's float32 precision as it takes effect: its own unless "none", which defers to
    its backend's, then to torch's ("ieee" where all are "none"), so that equal effects read equal."""
    parts = expression.split(".")
    own = _read(expression)
    if own is None:
        return None
    for candidate in (own, _read(".".join(parts[:-2] + ["fp32_precision"])), _read("torch.backends.fp32_precision")):
        if candidate not in (None, "none"):
            return candidate
    return "ieee"


def _same_or_none(direct: Callable[[], object] | None, read: Callable[[], object]) -> Callable[[], object] | None:
    """``direct`` where it reads what ``read`` does (a torch whose flags are built otherwise: None)."""
    try:
        return direct if direct is not None and direct() == read() else None
    except Exception:  # noqa: BLE001 — any failure: the expression itself is read
        return None


def _flushes_denormals() -> bool:
    return bool(_DENORMAL * _ONE == 0)


def settings(cuda: bool | None = None) -> dict[str, str]:
    """This process's settings, as text, by the expression that reads them (those its torch has).

    The CUDA ones only with ``cuda`` (by default: when this process can compute on a CUDA device;
    an edge without one computes nothing they steer, so the cloud's choice stands).
    """
    seen = {FLUSH_DENORMAL: str(_flushes_denormals())}
    with_cuda = torch.cuda.is_available() if cuda is None else cuda
    for expression in HOST + (CUDA if with_cuda else ()):
        value = _precision(expression) if expression.endswith(".fp32_precision") else _read(expression)
        if value is not None:
            seen[expression] = value
    return seen


def relevant(expression: str, device: torch.device) -> bool:
    """Whether ``expression`` changes what a half computing on ``device`` computes."""
    return expression not in CUDA or device.type == "cuda"


def _same_effect(expression: str, edge: str, mine: str, device: torch.device) -> bool:
    """Whether two values of a setting compute alike on ``device``: off CUDA, a float32 matmul
    precision of "high" is "highest" (TensorFloat-32 is CUDA's; on the CPU, oneDNN's own precision,
    compared apart, is what ``set_float32_matmul_precision("high")`` changes), so a script's
    ``torch.backends.cuda.matmul.allow_tf32 = True`` meets a cloud half on the CPU."""
    return (edge == mine or (expression == "torch.get_float32_matmul_precision()" and device.type != "cuda"
                             and {edge, mine} <= {"high", "highest"}))


def check_hello(theirs: object, device: torch.device) -> None:
    """Refuse an edge whose settings (``theirs``: its :func:`settings`) differ from this process's
    in one that matters to a half on ``device``. A setting the edge's torch lacks is not compared."""
    if not theirs:
        return
    if not isinstance(theirs, dict):
        raise HandshakeError("the hello's numeric settings must be a map of setting to value")
    for expression, mine in settings(cuda=device.type == "cuda").items():
        edge = theirs.get(expression)
        if edge is not None and not _same_effect(expression, str(edge), mine, device) and relevant(expression, device):
            raise HandshakeError(
                f"the edge computes with {expression} = {str(edge)[:40]} and this cloud with {mine}: the cloud's "
                "layers would compute differently from the unsplit model. Set it the same in the cloud's process "
                "(in the module that defines the factory, which the cloud imports) or leave it as it was")


class NumericsGuard:
    """Refuses a forward once a process-wide numeric setting changed since ``split()``: the
    cloud's layers would go on with the settings the handshake agreed.

    A call reads the settings as they are (a few microseconds); only when one reads otherwise are
    they compared as they take effect (a precision set and set back may read "ieee" where it read
    "none").
    """

    def __init__(self) -> None:
        # what settings() reads here: a CUDA switch steers nothing an edge without CUDA computes
        watched = [expression for expression in HOST + (CUDA if torch.cuda.is_available() else ()) + _PARENTS
                   if _reader(expression) is not None]
        self._readers = [read for expression in watched if (read := _reader(expression)) is not None]
        # every setting read in one expression, each by the function it ends up in where that reads
        # the same now: the check runs before each forward of the cloud half
        direct = {f"_{i}": _same_or_none(_direct(expression), read) for i, (expression, read)
                  in enumerate(zip(watched, self._readers))}
        reads = [f"_{i}()" if direct[f"_{i}"] is not None else expression for i, expression in enumerate(watched)]
        self._read_all = eval(f"lambda: ({', '.join(reads)},)", {"torch": torch, **direct})
        self._was = settings()
        self._raw = self._read_raw()

    def _read_raw(self) -> tuple:
        try:
            return _flushes_denormals(), *self._read_all()
        except RuntimeError:  # one this build cannot report: each read apart, that one as None
            values: list[object] = [_flushes_denormals()]
            for read in self._readers:
                try:
                    values.append(read())
                except RuntimeError:
                    values.append(None)
            return tuple(values)

    def check(self) -> None:
        raw = self._read_raw()
        if raw == self._raw:
            return
        now = settings()
        if now == self._was:
            self._raw = raw
            return
        changed = next(key for key in {**self._was, **now} if now.get(key) != self._was.get(key))
        how = (" (torch.nn.attention.sdpa_kernel(...) sets it around what it wraps: it picks the attention kernel on "
               "the CPU too)" if changed.endswith("sdp_enabled()") else "")
        raise ConfigError(
            f"{changed} changed after split() ({self._was.get(changed)} -> {now.get(changed)}){how}: it reaches the "
            "edge's layers only, and the cloud's would go on computing as before, so training would silently differ "
            "from the unsplit model. Set it before split(), and the same in the cloud's process (the handshake "
            "checks that the two agree), or set it back")


__all__ = ["CUDA", "FLUSH_DENORMAL", "HOST", "NumericsGuard", "check_hello", "relevant", "settings"]
