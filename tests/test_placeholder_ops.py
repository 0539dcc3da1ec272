"""Every torch operation on a cloud placeholder reaches the cloud or raises: none silently succeeds.

Torch's own lists of operations drive this, so an operation torch adds later is covered the day
it appears: every function that tensor subclasses can override
(``torch.overrides.get_testing_overrides``, called with arguments of the types its schema names)
and every operator of the OpInfo database (called on its own sample inputs), each applied to a
cloud parameter's placeholder, a cloud gradient's handle, the optimizer state made like a cloud
parameter (``torch.full_like(p, v)``) and an inner trunk output. Each call must raise a splitft
error, unless the function is in a written list: what reads no values (shape, dtype,
``requires_grad``...) or what is mirrored to the cloud.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from splitft.edge.cloud_half import CloudHalf
from splitft.edge.cloud_values import CloudValue
from splitft.edge.placeholders import MIRRORED, CloudGrad, CloudState, CloudTensor, RemoteTensor
from splitft.errors import CutError, PlaceholderError
from splitft.edge.intermediate import TrunkIntermediate

pytest.importorskip("expecttest")  # torch.testing._internal needs it (the test extra installs it)
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.generated.annotated_fn_args import annotated_args  # noqa: E402

#: What may answer without the cloud: it reads the shape, dtype, device or flags, never a value.
METADATA = {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "names", "is_cuda",
            "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested", "is_xpu",
            "is_mps", "is_mtia", "is_xla", "is_ipu", "is_vulkan", "is_maia", "itemsize", "nbytes", "output_nr",
            "_version", "_is_view", "is_complex", "is_floating_point", "is_signed", "dim", "ndimension", "size",
            "numel", "nelement", "element_size", "get_device", "is_contiguous", "stride", "storage_offset",
            "__len__", "__hash__", "__format__", "__dir__", "requires_grad_", "is_inference", "has_names",
            "_is_zerotensor", "is_conj", "is_neg", "__repr__", "_grad_fn"}


#: What draws a tensor of the placeholder's shape on the edge (from the edge's generator, as the
#: unsplit model would): it reads no values either.
DRAWN_LIKE = {"randn_like", "rand_like", "randint_like"}

#: What makes a tensor of a cloud parameter's dtype, here on the edge half's device (as unsplit,
#: where the parameter was): it reads no values either.
MADE_HERE = {"new_zeros", "new_ones", "new_empty", "new_full"}


class ReachedTheCloud(BaseException):
    """An operation of the walk reached the cloud half: none may (mirrored ones are left out)."""


class _NoCloud(CloudHalf):
    """A cloud half whose every operation fails the test: nothing in the walk may reach it."""

    def __init__(self) -> None:
        super().__init__(self._reached, self._reached)

    def _reached(self, *args: Any) -> Any:
        raise ReachedTheCloud(args)


REMOTE = _NoCloud()


class _Accumulating(torch.optim.Optimizer):
    """An optimizer whose constructor makes its state, as Adagrad's does."""

    def __init__(self, params):
        super().__init__(params, {})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = torch.full_like(p, 0.1, memory_format=torch.preserve_format)
                self.state[p]["sum64"] = torch.zeros_like(self.state[p]["sum"], dtype=torch.float64)


def _placeholder(like: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "parameter":
        made = CloudTensor(torch.nn.Parameter(like.detach().float(), requires_grad=True), "block.weight", REMOTE)
        REMOTE.params["block.weight"] = made  # a parameter of the cloud half (not a buffer)
        return made
    if kind == "gradient":
        return CloudGrad(like.detach().float(), "block.weight", REMOTE)
    if kind == "optimizer state":  # what Adagrad's constructor makes for a cloud parameter
        return _Accumulating([_placeholder(like, "parameter")]).state[REMOTE.params["block.weight"]]["sum"]
    return TrunkIntermediate(like.detach().float(), "block.1", ["block.0", "block.1", "block.2"])


KINDS = ["parameter", "gradient", "optimizer state", "inner trunk output"]
REFUSALS = (PlaceholderError, CutError)


def _name(func: Any) -> str:
    """``add_``, ``linalg.vector_norm``, ``grad.__get__`` (a property's getter)."""
    owner = getattr(func, "__self__", None)
    if owner is not None and not isinstance(owner, type) and hasattr(owner, "__objclass__"):
        return f"{owner.__name__}.{func.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return name.removeprefix("TensorBase.").removeprefix("Tensor.")


def _allowed(func: Any, kind: str) -> bool:
    """In the written lists: reads no values, or (parameter, gradient) is mirrored to the cloud."""
    name = _name(func)
    if name.removesuffix(".__get__").removesuffix(".__set__").split(".")[-1] in METADATA:
        return True
    return func in _mirrored(kind)


def _mirrored(kind: str) -> frozenset[Any]:
    """What reaches the cloud (or, for optimizer state, makes another such tensor) on a ``kind``."""
    return {"parameter": MIRRORED["values"] | MIRRORED["computed"], "gradient": MIRRORED["gradients"] | MIRRORED["computed"],
            "optimizer state": MIRRORED["made like"]}.get(kind, frozenset())


_VALUES: dict[str, Callable[[torch.Tensor], Any]] = {
    "Tensor": lambda t: torch.ones_like(t), "Tensor?": lambda t: None, "TensorList": lambda t: [torch.ones_like(t)],
    "int64_t": lambda t: 0, "SymInt": lambda t: 1, "int64_t?": lambda t: None, "bool": lambda t: False,
    "bool?": lambda t: None, "double": lambda t: 1.0, "double?": lambda t: None, "Scalar": lambda t: 1,
    "Scalar?": lambda t: None, "IntArrayRef": lambda t: [1], "SymIntArrayRef": lambda t: list(t.shape),
    "IntArrayRef?": lambda t: None, "ScalarType": lambda t: torch.float32, "ScalarType?": lambda t: None,
    "c10::string_view": lambda t: "none", "c10::string_view?": lambda t: None, "ScalarList": lambda t: [1.0],
    "Generator?": lambda t: None, "Layout": lambda t: torch.strided, "Device": lambda t: torch.device("cpu"),
    "DeviceIndex": lambda t: 0, "ArrayRef<double>?": lambda t: None,
    "c10::List<::std::optional<Tensor>>": lambda t: [None],
}


def _arguments(func: Any, target: torch.Tensor, like: torch.Tensor) -> tuple[list, dict] | None:
    """Arguments of the types ``func``'s schema names, ``target`` first (in a list for a TensorList)."""
    schema = annotated_args.get(func)
    if schema is not None:
        args: list = []
        kwargs: dict = {}
        for i, arg in enumerate(schema):
            kind = arg["simple_type"]
            maker = _VALUES.get(kind)
            if maker is None:
                return None
            value = (target if kind.startswith("Tensor") and kind != "TensorList" else [target]) if i == 0 else maker(like)
            if arg.get("is_kwarg_only") == "True":
                kwargs[arg["name"]] = value
            else:
                args.append(value)
        return args, kwargs
    override = torch.overrides.get_testing_overrides().get(func)
    if override is None:
        return None
    params = [p for p in inspect.signature(override).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return [target] + [torch.ones_like(like) for _ in params[1:]], {}


def _outcome(call: Callable[[], Any], target: Any = None) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = call()
    except REFUSALS:
        return "refused"
    except Exception:  # noqa: BLE001 — torch refused the arguments before the placeholder saw the call
        return "not called"
    # A new expression of the cloud's (w.float() is w unsplit), which refuses what it cannot mirror:
    # tested with a real cloud in test_cloud_compute. The placeholder itself handed back is what the
    # unsplit call hands back, its input (p.to(p.device), a reduction over no dimension). Anything
    # else is no such thing.
    if isinstance(result, CloudValue):
        return "expression"
    return "itself" if target is not None and result is target else "returned"


@pytest.mark.parametrize("kind", KINDS)
def test_no_overridable_torch_function_silently_succeeds_on_a_cloud_tensor(kind):
    like = torch.ones(2, 3)
    returned, refused, total = [], 0, 0
    for func in torch.overrides.get_testing_overrides():
        if func in _mirrored(kind):
            continue  # mirrored: reaches the cloud (tested with a real cloud in test_script_corpus)
        built = _arguments(func, _placeholder(like, kind), like)
        if built is None:
            continue
        total += 1
        outcome = _outcome(lambda: func(*built[0], **built[1]))
        refused += outcome == "refused"
        if outcome == "returned" and not _allowed(func, kind):
            returned.append(_name(func))
    assert not returned, f"these succeeded silently on a cloud {kind}: {sorted(returned)}"
    assert total > 1000 and refused > 0.6 * total, (refused, total)  # most calls really reached the placeholder


def _op_calls(op: Any) -> list[tuple[str, Callable[..., Any]]]:
    variants = [("function", op.op), ("method", op.method_variant), ("inplace", op.inplace_variant)]
    return [(name, f) for name, f in variants if f is not None]


@pytest.fixture(scope="module")
def op_samples() -> list[tuple[Any, Any]]:
    """(operator, its first float32 sample input on the CPU) for each OpInfo with a dense tensor input."""
    found = []
    for op in op_db:
        try:
            sample = next(iter(op.sample_inputs("cpu", torch.float32)), None)
        except Exception:  # noqa: BLE001 — an operator without float32 samples on this build
            continue
        if (sample is not None and isinstance(sample.input, torch.Tensor) and sample.input.is_floating_point()
                and sample.input.layout == torch.strided):
            found.append((op, sample))
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_every_opinfo_operator_on_a_cloud_tensor_raises_a_splitft_error(kind, op_samples):
    returned, refused = [], 0
    for op, sample in op_samples:
        for variant, call in _op_calls(op):
            if _allowed(call, kind) or op.name in DRAWN_LIKE or (op.name in MADE_HERE and kind == "parameter"):
                continue  # mirrored, or reads no values
            target = _placeholder(sample.input, kind)
            outcome = _outcome(lambda: call(target, *sample.args, **sample.kwargs), target)
            refused += outcome == "refused"
            if outcome == "itself" and call(sample.input, *sample.args, **sample.kwargs) is not sample.input:
                outcome = "returned"  # the placeholder back where the unsplit call makes a new tensor
            if outcome == "returned":
                returned.append(f"{op.name} ({variant})")
    assert not returned, f"these succeeded silently on a cloud {kind}: {sorted(returned)}"
    assert refused > 500, refused


def test_a_refusal_names_the_tensor_and_the_fix():
    weight = _placeholder(torch.ones(2, 3), "parameter")
    with pytest.raises(PlaceholderError, match=r"cloud parameter 'block.weight'.*before split\(\)"):
        weight.erfinv_()
    grad = _placeholder(torch.ones(2, 3), "gradient")
    with pytest.raises(PlaceholderError, match=r"gradient of cloud parameter 'block.weight'.*clip_grad_norm_"):
        grad.cumsum_(0)
    inner = _placeholder(torch.ones(2, 3), "inner trunk output")
    with pytest.raises(CutError, match=r"output of 'block.1', an inner module of the trunk 'block.0'..'block.2'"):
        torch.relu(inner)


def test_a_tensor_made_like_a_placeholder_keeps_its_recipe_and_asks_nothing_of_the_cloud():
    """``torch.full_like(p, v)`` and its kin read no values. Made by an optimizer's constructor they
    answer here, remembering the fill (how the mirror tells an optimizer's initial state from
    state written later); made by the script, they are its own tensors, as unsplit."""
    weight = _placeholder(torch.ones(2, 3), "parameter")
    assert not torch.is_complex(weight) and torch.is_floating_point(weight) and torch.numel(weight) == 6
    state = _Accumulating([weight]).state[weight]
    assert isinstance(state["sum"], CloudState) and not isinstance(state["sum"], torch.nn.Parameter)
    assert not state["sum"].requires_grad
    assert state["sum"].recipe() == ("block.weight", (2, 3), torch.float32, 0.1)
    assert state["sum64"].recipe() == ("block.weight", (2, 3), torch.float64, 0)
    with pytest.raises(PlaceholderError, match=r"made like cloud parameter 'block.weight'"):
        state["sum"].add_(1.0)
    buffer = torch.full_like(weight, 0.1)  # an average's or a momentum's, kept by the script
    assert type(buffer) is torch.Tensor and torch.equal(buffer, torch.full((2, 3), 0.1))
    assert torch.equal(torch.ones_like(weight, device="cpu"), torch.ones(2, 3))
    assert torch.zeros_like(weight, requires_grad=True).requires_grad


def test_a_placeholder_is_a_parameter_of_the_right_shape_that_answers_the_edges_device():
    weight = _placeholder(torch.ones(2, 3), "parameter")
    assert isinstance(weight, torch.nn.Parameter) and isinstance(weight, RemoteTensor)
    assert weight.shape == (2, 3) and weight.dtype == torch.float32 and weight.requires_grad
    # Kept on the meta device, yet not "meta": its values exist, in the cloud (code skipping meta tensors
    # must not skip it), and were on the edge half's device unsplit, which it answers (a buffer made
    # device=p.device is a real one there)
    assert not weight.is_meta and weight.device == REMOTE.device == torch.device("cpu") and not weight.is_cuda
    assert torch.empty(weight.shape, device=weight.device).device.type == "cpu"
    # torch's C++ asks it too: grouped with the edge's tensors by device (AveragedModel, foreach kernels)
    grouped = torch.utils._foreach_utils._group_tensors_by_device_and_dtype([[torch.zeros(2, 3)], [weight.detach()]])
    assert list(grouped) == [(torch.device("cpu"), torch.float32)]
    assert weight.new_zeros(4).device.type == "cpu" and weight.new_zeros(4).dtype == weight.dtype
    assert math.prod(weight.shape) == weight.numel() == 6
    assert "values in the cloud" in repr(weight)


@pytest.mark.parametrize("kind", ["parameter", "gradient"])
def test_the_legacy_new_of_a_cloud_tensor_makes_a_tensor_here_of_the_size_it_is_given(kind):
    """``p.grad.new(p.grad.size()).normal_(0, s)`` (gradient noise), ``w.data.new(w.size())`` (a
    DropConnect mask): torch's legacy constructor skips ``__torch_function__``, and a cloud tensor
    read the ``torch.Size`` as the values of a one-element tensor, so one noise value was added to
    a whole gradient. It makes what it makes unsplit: a tensor of that size, here."""
    made = _placeholder(torch.ones(4, 6), kind)
    for tensor, call in [(made.new(made.size()), "size"), (made.new(4, 6), "sizes"),
                         (made.new(size=(4, 6)), "size=")]:
        assert tensor.shape == (4, 6) and tensor.dtype == made.dtype and type(tensor) is torch.Tensor, call
    assert made.new([1.5, 2.5]).tolist() == made.new((1.5, 2.5)).tolist() == [1.5, 2.5]  # data, as torch reads it
    assert made.new().shape == (0,) and made.new(3, device="cpu").device.type == "cpu"
    if kind == "parameter":
        with torch.enable_grad():  # reads no value of the parameter: no gradient to refuse
            assert made.new(made.size()).shape == (4, 6)


#: Arguments after the tensor that torch.nn.init's initialisers need (the others take the tensor alone).
_INIT_ARGUMENTS: dict[str, tuple] = {"constant_": (0.5,), "sparse_": (0.5,)}


def _initialisers() -> list[str]:
    return sorted(name for name in dir(torch.nn.init)
                  if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name)))


@pytest.mark.parametrize("name", _initialisers())
def test_no_initialiser_silently_skips_a_cloud_parameter(name):
    """Torch's initialisers return early on a meta tensor ("sampling is a no-op"): on a cloud
    parameter that would leave the cloud's values as they were while the script believes them
    initialised. Each one must push values to the cloud or raise."""
    shape = (4, 4, 3) if name == "dirac_" else (4, 6)
    weight = _placeholder(torch.ones(shape), "parameter")
    outcome = "returned"
    try:
        with torch.no_grad():
            getattr(torch.nn.init, name)(weight, *_INIT_ARGUMENTS.get(name, ()))
    except PlaceholderError:
        outcome = "refused"
    except ReachedTheCloud:
        outcome = "mirrored"
    assert outcome != "returned", f"torch.nn.init.{name} returned on a cloud parameter without reaching the cloud"
