"""The settings a model's modules read from their config object while they run.

A transformers layer keeps a reference to the model's config and reads some of it on every call
(``self.config._attn_implementation`` picks the attention kernel). The cloud builds its half from
the factory, with a config of its own, so such a setting must agree on both sides when the model
is cut, and must not change on the edge afterwards: the edge's layers would follow the change, the
cloud's would not, and training would silently differ from the unsplit model.

What a module reads is found in its class's code: every ``<...>.config.<key>`` or ``config.<key>``
in a method other than ``__init__`` (what ``__init__`` reads is copied into the module when it is
built, where the parameter fingerprint and the module's ``repr`` see it), in the model's own
classes (a library's shared base classes read settings for saving, loading and generating, not
for computing); the same for a config-like object a module holds under another name (a dataclass,
a namespace or a ``...Config`` in ``self.cfg``, read as ``self.cfg.<key>`` or ``cfg.<key>``), and
for a plain value at the top of the class's module that its methods read (``USE_GATE``, which a
script may set as ``mymodels.USE_GATE = False``). transformers' shared code picks a layer's
attention and experts kernels by two settings of the layer's config, outside the layer's code:
those are read wherever a config is held. Settings that only the model's top reads
(``use_cache``, ``pad_token_id``) are not in its layers' code, so a script may still change them.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import sys
import textwrap
import types
from typing import Any

import torch
from torch import nn

from . import code_reads
from .errors import ConfigError, ProtocolError

#: Classes whose code is not the model's: torch's own modules, this package's stand-ins, and
#: transformers' shared bases (its models live under ``transformers.models``).
_NOT_MODEL_CODE = ("torch.", "splitft.", "transformers.")
_MODEL_CODE = ("transformers.models.",)
#: What transformers' shared code reads from a layer's config to choose its kernels.
_DISPATCH_KEYS = frozenset({"_attn_implementation", "_experts_implementation"})
_MISSING = object()


def keys_read(cls: type, attribute: str = "config") -> frozenset[str]:
    """The keys of its ``attribute`` (its config) that the methods of ``cls`` and its bases
    (``__init__`` aside) read."""
    found = _KEYS_READ.get((cls, attribute))
    if found is None:
        found = _KEYS_READ[cls, attribute] = _scan(cls, attribute)
    return found


_KEYS_READ: dict[tuple[type, str], frozenset[str]] = {}


def _scan(cls: type, attribute: str) -> frozenset[str]:
    return frozenset(key for _, method in _methods(cls) for key in _config_attributes(method, attribute))


@functools.cache
def _methods(cls: type, torch_layers: bool = False) -> tuple[tuple[type, ast.FunctionDef | ast.AsyncFunctionDef], ...]:
    """The methods (``__init__`` aside) of ``cls`` and its bases that are the model's code, as
    syntax trees, with the class each is defined in; with ``torch_layers``, torch's layers' too
    (dropout reads its ``p`` as it runs)."""
    found: list[tuple[type, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for base in cls.__mro__:
        home = base.__module__
        if base in (object, nn.Module) or (home.startswith(_NOT_MODEL_CODE) and not home.startswith(_MODEL_CODE)
                                           and not (torch_layers and home.startswith("torch.nn."))):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue  # no source at hand (a class built at run time, a compiled one)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found += [(base, method) for method in node.body
                          if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.name != "__init__"]
                break
    return tuple(found)


def globals_read(cls: type) -> tuple[tuple[types.ModuleType, frozenset[str]], ...]:
    """The module-level names holding plain values (a flag, a number, a string) that the methods of
    ``cls`` and its bases (``__init__`` aside) read, by module: a script may set them
    (``mymodels.USE_GATE = False``), and the cloud's process keeps the value its import gave."""
    found = _GLOBALS_READ.get(cls)
    if found is None:
        found = _GLOBALS_READ[cls] = _scan_globals(cls)
    return found


_GLOBALS_READ: dict[type, tuple[tuple[types.ModuleType, frozenset[str]], ...]] = {}


def _scan_globals(cls: type) -> tuple[tuple[types.ModuleType, frozenset[str]], ...]:
    by_module: dict[str, set[str]] = {}
    for base, method in _methods(cls):
        module = sys.modules.get(base.__module__)
        if module is not None:
            by_module.setdefault(base.__module__, set()).update(
                name for name in _free_names(method) if _plain(vars(module).get(name, object())))
    return tuple((sys.modules[name], frozenset(names)) for name, names in by_module.items() if names)


def own_attributes_read(cls: type) -> frozenset[str]:
    """The attributes of its own (``self.<name>``) that the methods of ``cls`` and its bases
    (``__init__`` aside, torch's layers included) read: flags its code runs by, such as dropout's
    ``p`` or PEFT's ``_disable_adapters``."""
    found = _OWN_READ.get(cls)
    if found is None:
        found = _OWN_READ[cls] = frozenset(
            node.attr for _, method in _methods(cls, torch_layers=True) for node in ast.walk(method)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name) and node.value.id == "self")
    return found


_OWN_READ: dict[type, frozenset[str]] = {}


def attributes_named(cls: type) -> frozenset[str]:
    """Every attribute name the methods of ``cls`` and its bases (``__init__`` aside, torch's layers
    included) read of any object (``self.p``, ``self.block.scale``, ``module.flag``), and every
    string they hold that could name one (``getattr(m, "flag")``)."""
    found = _NAMED.get(cls)
    if found is None:
        names: set[str] = set()
        for _, method in _methods(cls, torch_layers=True):
            for node in ast.walk(method):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    names.add(node.value)
        found = _NAMED[cls] = frozenset(names)
    return found


_NAMED: dict[type, frozenset[str]] = {}


def own_attributes_kept_by_forward(cls: type) -> frozenset[str]:
    """The public attributes of its own that the ``forward`` of ``cls`` and its bases assign
    (``self.calls += 1``, ``self.last = x.detach()``): what a layer's code keeps as it runs, which
    for a cloud layer changes in the cloud alone. The mode and the runtime flags aside."""
    found = _KEPT.get(cls)
    if found is None:
        found = _KEPT[cls] = frozenset(
            node.attr for _, method in _methods(cls, torch_layers=True) if method.name == "forward"
            for node in ast.walk(method)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and not node.attr.startswith("_")) - _RUNTIME_FLAGS
    return found


_KEPT: dict[type, frozenset[str]] = {}

#: What a script may set on a cloud module that is not sent as one of its settings: its mode
#: (mirrored with each forward) and the switch with which ``gradient_checkpointing_enable()``
#: marks every layer (the cloud's computes the same values without it).
MODE_ATTRIBUTES = frozenset({"training", "gradient_checkpointing"})
#: Attributes a module's code reads that may change on the edge alone.
_RUNTIME_FLAGS = code_reads.RUNTIME_ATTRIBUTES | MODE_ATTRIBUTES


def is_flag(value: Any) -> bool:
    """A plain value a script may set to steer a module (a switch, a number, a name or none, a list
    of them, a map of names to numbers such as a LoRA layer's ``scaling``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in value.items())
    return isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, (bool, int, float, str)) for v in value)


def _container(value: Any) -> bool:
    """A value a script changes in place, without setting the attribute (``layer.scaling[name] *= 2``)."""
    return isinstance(value, (dict, list, set))


def _free_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names ``function`` reads that it does not bind itself (so: globals, builtins, closures)."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not function:
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).partition(".")[0])
    return loaded - bound


def _plain(value: Any, depth: int = 0) -> bool:
    """A plain value, or a small tuple, list or dict of them (a module's ``CONFIG = {"scale": 1.0}``,
    which a script may change in place): what a module-level name a layer reads may hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth > 1 or not isinstance(value, (tuple, list, dict)) or len(value) > _MOST_ITEMS:
        return False
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return all((isinstance(k, (str, int)) or not isinstance(value, dict)) and _plain(v, depth + 1) for k, v in items)


#: The most items a module-level container a layer reads may hold to be watched for changes.
_MOST_ITEMS = 256


def _config_attributes(function: ast.AST, attribute: str) -> set[str]:
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == attribute) or \
                    (isinstance(owner, ast.Name) and owner.id == attribute):
                found.add(node.attr)
    return found


def reads(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, str, Any, frozenset[str]]]:
    """``(where, attribute, config, keys)`` for each config a module (any depth of ``modules``)
    holds in ``attribute`` and whose ``keys`` its code reads."""
    found = []
    for name, module in modules:
        for key, sub in module.named_modules():
            for attribute, config in sub.__dict__.items():
                if not (attribute == "config" and _settings_object(config) or _config_like(config)):
                    continue
                keys = frozenset(key for key in keys_read(type(sub), attribute) | _dispatch_keys(config)
                                 if not callable(getattr(config, key, None)))  # its methods are code, not settings
                if keys:
                    found.append((f"{name}.{key}" if key else name, attribute, config, keys))
            for owner, names in globals_read(type(sub)):
                found.append((f"{name}.{key}" if key else name, owner.__name__, owner, names))
    return found


def _settings_object(value: Any) -> bool:
    return value is not None and not isinstance(value, (nn.Module, torch.Tensor, str, int, float, bool, dict, list,
                                                        tuple, type)) and not callable(value)


def _config_like(value: Any) -> bool:
    """An object of settings under another name than ``config``: a dataclass, a namespace, a ``...Config``."""
    return _settings_object(value) and (
        dataclasses.is_dataclass(value) or isinstance(value, (types.SimpleNamespace, argparse.Namespace))
        or "config" in type(value).__name__.lower())


def _dispatch_keys(config: Any) -> frozenset[str]:
    if not type(config).__module__.startswith("transformers."):
        return frozenset()
    return frozenset(key for key in _DISPATCH_KEYS if hasattr(config, key))  # not a GenerationConfig's


def values(modules: list[tuple[str, nn.Module]]) -> dict[str, dict[str, str]]:
    """Each module's read settings, as text (what :func:`splitft.cut.structure` hashes), with the
    private flags its code reads (a LoRA layer's active adapter: both sides must start alike, as
    only a change made after the cut is sent)."""
    found: dict[str, dict[str, str]] = {}
    for where, attribute, config, keys in reads(modules):
        found.setdefault(where, {}).update({_named(attribute, key): _canonical(getattr(config, key, None))
                                            for key in sorted(keys)})
    for name, module in modules:
        for key, sub in module.named_modules():
            flags = {flag: _canonical(effective_value(sub, flag)) for flag in sorted(flags_read(sub))}
            if flags:
                found.setdefault(f"{name}.{key}" if key else name, {}).update(flags)
    for where, attribute, tensor, _, _ in _tensor_attributes(modules):
        found.setdefault(where, {})[attribute] = _tensor_text(tensor)
    for where, digest in code_reads.identities(modules).items():
        found.setdefault(where, {})["code"] = digest
    return found


def _tensor_text(tensor: torch.Tensor) -> str:
    """A plain tensor attribute as the handshake compares it: its dtype, shape and values' hash."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"tensor {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} {hashlib.sha256(data).hexdigest()[:16]}"


def _named(attribute: str, key: str) -> str:
    return key if attribute == "config" else f"{attribute}.{key}"


def _canonical(value: Any) -> str:
    """The same text for equal settings however they were built (a dict's keys in any order)."""
    try:
        return json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr(value)



def _tensor_attributes(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, str, torch.Tensor, int, torch.Tensor]]:
    """The plain tensor attributes (``self.mask = torch.ones(n)``: no parameter, no buffer) each
    module's own code reads, with their version counters now (torch bumps it at each change in
    place) and a copy of their values."""
    found = []
    for name, module in modules:
        for key, sub in module.named_modules():
            for attribute in sorted(own_attributes_read(type(sub))):
                value = sub.__dict__.get(attribute)
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    found.append((f"{name}.{key}" if key else name, attribute, value, _version(value),
                                  value.detach().clone()))
    return found


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference-mode tensor keeps no count: it cannot be changed in place either
        return 0

class ConfigGuard:
    """Refuses a forward once a config setting the cloud's modules read has changed since the cut.

    The settings are taken once; :meth:`check` reads them again (a few attribute reads a call).
    """

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self._watched: list[tuple[str, str, Any, str, Any]] = []
        seen: set[tuple[int, str]] = set()
        for where, attribute, config, keys in reads(modules):
            for key in sorted(keys):
                if (id(config), key) not in seen:
                    seen.add((id(config), key))
                    self._watched.append((where, attribute, config, key, _snapshot(getattr(config, key, _MISSING))))
        self._tensors = _tensor_attributes(modules)

    def check(self) -> None:
        for i, (where, key, tensor, version, was) in enumerate(self._tensors):
            if _version(tensor) == version:
                continue
            if torch.equal(tensor, was):  # changed and set back
                self._tensors[i] = (where, key, tensor, _version(tensor), was)
            else:
                raise ConfigError(
                    f"{key} of {where!r}, a tensor its code reads that is neither a parameter nor a buffer, was "
                    "changed in place after split(): the cloud's module keeps the one its factory built, so "
                    "training would silently differ from the unsplit model. Register it as a buffer "
                    f"(module.register_buffer({key!r}, tensor)) in the model and its factory, whose values "
                    "model.load_state_dict(...) then sets in the cloud too, or set it back")
        for where, attribute, config, key, was in self._watched:
            now = getattr(config, key, _MISSING)
            if now is not was and not same_setting(now, was):
                if isinstance(config, types.ModuleType):
                    raise ConfigError(
                        f"{attribute}.{key} changed after split() ({_shown(was)} -> {_shown(now)}): {where!r} reads "
                        "it on every call and runs in the cloud's process, where it keeps the value its module "
                        "sets, so training would silently differ from the unsplit model. Change it in the module "
                        "itself (the cloud imports it too), or set it back")
                raise ConfigError(
                    f"{attribute}.{key} changed after split() ({_shown(was)} -> {_shown(now)}): {where!r} reads it on "
                    "every call and runs in the cloud, whose model the factory built with its own config, so the "
                    "cloud would go on with the old value and training would silently differ from the unsplit "
                    f"model. Set {key} before split(), in the cloud's factory too (the handshake checks that the "
                    "two agree), or set it back")


class ModuleFlags:
    """The flags each cloud module's own code reads as it runs (dropout's ``p``;
    ``self._disable_adapters``, which PEFT's ``disable_adapter()`` sets on every adapter layer; a
    LoRA layer's ``scaling``, which ``scale_layer`` changes in place; see :func:`flags_read`):
    :meth:`changed` says which the script changed since they were last sent, for the cloud to set
    on its modules (:func:`apply_flags`) before the next forward. A flag deleted, or set to another
    kind of value than a plain one, is refused."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self._flags = [(f"{name}.{key}" if key else name, sub, sub.__dict__, flag)
                       for name, module in modules for key, sub in module.named_modules()
                       for flag in sorted(flags_read(sub))]
        self._sent = [_snapshot(effective_value(sub, flag)) for _, sub, _, flag in self._flags]

    def changed(self) -> dict[str, dict[str, Any]]:
        """``{module: {flag: value}}`` changed since the last call (or the cut); {} for none."""
        changed: dict[str, dict[str, Any]] = {}
        for i, (where, sub, state, flag) in enumerate(self._flags):
            now, was = state.get(flag, _MISSING), self._sent[i]  # the module's own first: read before each forward
            if now is _MISSING:
                now = effective_value(sub, flag)
            if now is was or same_setting(now, was):
                continue
            if not is_flag(now):
                raise ConfigError(f"{flag} of {where!r} changed after split() ({_shown(was)} -> {_shown(now)}): that "
                                  "module's code reads it as it runs, in the cloud, which takes a flag, a number, a "
                                  "name, or a list or a map of them; set it back, or change the trained model "
                                  "(peft's merge of a DoRA adapter, which caches the weight's norm) after "
                                  "model.unsplit()")
            changed.setdefault(where, {})[flag] = (list(now) if isinstance(now, (tuple, list, set, frozenset))
                                                   else dict(now) if isinstance(now, dict) else now)
            self._sent[i] = _snapshot(now)
        return changed


def flags_read(module: nn.Module) -> list[str]:
    """``module``'s attributes its own code reads that hold a plain value now: its settings
    (dropout's ``p``, batch norm's ``momentum`` and ``eps``, which ``swa_utils.update_bn`` sets),
    its private flags (PEFT's ``_disable_adapters``) and what it holds in a dict, list or set
    (changed in place, as PEFT's ``scale_layer`` changes ``scaling``). The mode and the
    checkpointing switch are not among them: they are mirrored otherwise, or not at all; nor are the
    settings of torch's layers that scale what they return (pooling sizes, padding, upsampling)."""
    if type(module).__module__.startswith("torch.nn.") and not isinstance(module, _SHAPE_KEEPING):
        return []  # a pooling's size, a convolution's padding: what they hold and return scales with them
    found = []
    for flag in own_attributes_read(type(module)):
        value = effective_value(module, flag)
        if value is not _MISSING and flag not in _RUNTIME_FLAGS and is_flag(value):
            found.append(flag)
    return found


def effective_value(module: nn.Module, name: str) -> Any:
    """What ``module.<name>`` reads as a plain attribute: its own, else its class's (a switch a
    script flips on the class, ``Block.noise_on = False``, which reaches every layer of it); torch's
    own class attributes aside. ``_MISSING`` where neither holds it."""
    value = module.__dict__.get(name, _MISSING)
    if value is not _MISSING:
        return value
    for cls in type(module).__mro__:
        if cls is nn.Module or cls is object:
            break
        value = vars(cls).get(name, _MISSING)
        if value is not _MISSING:
            return value
    return _MISSING


#: torch's layers whose settings a script may change on a cloud layer: what they return has their
#: input's shape whatever the settings, so no setting an edge sends makes a forward hold more.
_SHAPE_KEEPING = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
                  nn.RMSNorm, nn.ReLU, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.GELU, nn.SiLU, nn.Mish,
                  nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Threshold,
                  nn.Softmax, nn.LogSoftmax, nn.PReLU, nn.RReLU, nn.Sigmoid, nn.Tanh, nn.Hardshrink, nn.Softshrink)


def apply_flags(modules: dict[str, nn.Module], flags: Any) -> None:
    """Set what :meth:`ModuleFlags.changed` sent on the cloud's ``modules`` (by qualified name),
    each checked first (a flag the module's code reads, holding a plain value, to a plain value),
    so a refused message sets none."""
    if not isinstance(flags, dict) or sum(len(f) if isinstance(f, dict) else 1 for f in flags.values()) > _MAX_FLAGS:
        raise ProtocolError(f"flags must be a map of module to a map of at most {_MAX_FLAGS} flags in all")
    checked = []
    for where, values in flags.items():
        module = modules.get(where) if isinstance(where, str) else None
        if module is None or not isinstance(values, dict):
            raise ProtocolError(f"the cloud half has no module {_shown(where)[:80]} to set flags on")
        allowed = flags_read(module)
        for flag, value in values.items():
            if flag not in allowed or not is_flag(value):
                raise ProtocolError(f"{_shown(flag)[:80]} of {where!r} is no flag its code reads, or "
                                    f"{_shown(value)[:80]} no plain value")
            kind = type(effective_value(module, flag))  # msgpack sends a tuple or a set as a list
            as_kind = isinstance(value, list) and kind in (tuple, set, frozenset)
            checked.append((module, flag, kind(value) if as_kind else value))
    for module, flag, value in checked:
        setattr(module, flag, value)


#: The most flags one message may set.
_MAX_FLAGS = 100_000


def same_setting(a: Any, b: Any) -> bool:
    """Equal settings; a tensor (whose ``!=`` is elementwise) by its values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _snapshot(value: Any) -> Any:
    """A copy of ``value`` that changes made in place to it (a dict of rope settings) do not reach."""
    if value is _MISSING:
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - a value that cannot be copied is compared as it is
        return value


def _shown(value: Any) -> str:
    shown = "unset" if value is _MISSING else repr(value)
    return shown if len(shown) <= 80 else f"{shown[:72]} ...{shown[-4:]}"  # a tensor a cache holds prints whole


__all__ = ["MODE_ATTRIBUTES", "ConfigGuard", "ModuleFlags", "apply_flags", "attributes_named", "flags_read",
           "globals_read", "is_flag",
           "keys_read", "own_attributes_read", "reads", "same_setting", "values"]
