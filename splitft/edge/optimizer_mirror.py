"""The cloud's copy of one optimizer, as the edge keeps it in step (:class:`OptimizerMirror`).

Built when the optimizer is attached (:class:`~splitft.edge.mirror.ModelMirror`), it sends the
cloud what each step changed, refuses what it cannot repeat before the step runs, keeps the cloud
parameters' entries of ``optimizer.state`` as placeholders (:mod:`.initial_state`), and carries
``state_dict`` / ``load_state_dict`` over both halves.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ..errors import ConfigError
from ..optimizer_layout import NUMBERS, same_kind
from ..optimizer_classes import library_version, wire_name
from ..wire.operations import AddParamGroup, AttachOptimizer, LoadOptimizerState, Step
from . import initial_state, optimizers
from .cloud_half import CloudHalf
from .fetched_state import OPTIMIZER_STATE, FetchedCloudState
from .optimizer_loads import (NOT_ITS_STATE, by_place, fits, load_hooks_aside, local_value, placed, pre_hooked,
                              wire_value)
from .optimizer_settings import (IMMUTABLE, NOT_PLAIN, PLAIN_KINDS, PLAIN_OR_TUPLE, not_mirrored, optimizer_settings,
                                 plain_setting, refuse_other_kinds, unknown_layout)
from .placeholders import RemoteTensor


class Owner(Protocol):
    """What an optimizer's copy needs of its split model's mirror (:class:`~splitft.edge.mirror.ModelMirror`):
    the session (``link``: ``shared``, ``sync``, ``optimizer_state``), where operations wait
    (``outbox``), the step count (``steps``), the cloud half's tensors, what runs before and after each step."""

    link: Any
    outbox: Any
    steps: Any
    cloud_half: CloudHalf
    on_step: Callable[[], None]
    before_step: Callable[[], None]


class OptimizerMirror:
    """The cloud's copy of one optimizer: built when it is attached, stepped and zeroed with it.

    The cloud builds the same class with the same settings over the same parameter groups (by
    the cloud parameters' names); each step carries the groups' learning rates and any other
    setting a scheduler changed since the previous one. While the edge's optimizer steps, the
    cloud's gradients are hidden from it (``cloud_half.hidden``): the cloud steps its parameters.
    The cloud parameters' entries in ``optimizer.state`` are placeholders (:mod:`.initial_state`);
    ``state_dict()`` fetches their values and ``load_state_dict`` sends them to the cloud's copy.

    Args:
        model: the split model's mirror this optimizer is attached to.
        optimizer: the user's optimizer.
    """

    def __init__(self, model: Owner, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.settings = optimizer_settings(optimizer)
        self.members = _members(optimizer)
        self._raw: list[tuple] | None = None  # each group's settings as last sent, when all were immutable values
        self.sent, self._raw = self._group_settings()
        self._stepping = self.sent, self._raw  # the groups' settings of the step under way, read before it runs
        # The optimizer's state as the last step left it: a script that resets it is caught
        # before the next step (the cloud's copy keeps the cloud half's state).
        self._state: Any = optimizer.state
        self._entries = len(optimizer.state)
        #: The cloud parameters' entries as the constructor made them: (parameter, entry, its items).
        self._initial: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        #: Every cloud parameter's entry the mirror put or accepted in ``optimizer.state``, in two
        #: lists (parameters, entries) that one look compares with the state, by identity.
        self._kept: tuple[list[torch.Tensor], list[dict[str, Any]]] = ([], [])
        self._stated: set[str] = set()  # the cloud parameters with an entry, by name (or none to make)
        self._edge_only = False
        self._replaced_by: str | None = None  # the class of the optimizer attached after this one
        self._beside = False  # whether that one holds none of this one's cloud parameters
        #: Moves with every step and load: what ``state_dict()`` fetched before stands for the
        #: cloud's state only while it holds (:mod:`.fetched_state`).
        self._version = 0
        self._fetched: weakref.WeakKeyDictionary[FetchedCloudState, tuple[torch.Tensor, str]] = (
            weakref.WeakKeyDictionary())  # each fetched entry's parameter and key, for unsplit() to follow

    def replaced(self, newer: torch.optim.Optimizer) -> None:
        """A newer optimizer was attached to the split model: the cloud's copy is its now (as a new
        optimizer starts afresh unsplit), and this one may no longer step or save the cloud half."""
        self._replaced_by = type(newer).__name__
        owns = self.model.cloud_half.owns
        mine = {id(p) for group in self.optimizer.param_groups for p in group["params"] if owns(p)}
        self._beside = mine.isdisjoint(id(p) for group in newer.param_groups for p in group["params"] if owns(p))

    def _still_attached(self) -> None:
        if self._replaced_by is None:
            return
        name, newer = type(self.optimizer).__name__, self._replaced_by
        raise ConfigError(
            f"this {name} and the {newer} attached after it each hold parameters of the cloud half (different ones): "
            "the cloud half steps with one optimizer, so two beside each other (Muon with AdamW for the other "
            "parameters, a GAN's generator and discriminator) are not supported yet. Cut so that one of them holds "
            "edge parameters only (it stays local), or put the cloud half's parameters in one of them" if self._beside
            else f"this {name} was replaced by the {newer} attached after it (at its first step): the cloud half steps "
            "with one optimizer at a time, the newest, so this one no longer reaches it. Step the newer one, or put "
            "every group in one optimizer (one over edge parameters only stays local)")

    def check_initial_state(self) -> dict[str, Any] | None:
        """The state the optimizer holds for cloud parameters, as the cloud's copy starts from it.
        What its own constructor makes (Adagrad's accumulators) is built in the cloud with it; any
        other (an optimizer that stepped before ``split()``, or state written for a cloud
        parameter) is returned as its state dict, which :meth:`carry` loads into the cloud's copy
        once attached, so training goes on from it as unsplit."""
        optimizer, owns = self.optimizer, self.model.cloud_half.owns
        entries = {p: entry for p, entry in optimizer.state.items() if entry and owns(p)}
        if not entries:
            return None
        made = initial_state.constructor_state(optimizer, owns, self.settings, self.sent)
        if entries.keys() == made.keys() and all(initial_state.same_entry(entries[p], made[p]) for p in made):
            for param, entry in entries.items():
                initial_state.to_placeholders(entry, made[param])
            return None
        if any(isinstance(value, RemoteTensor) for entry in entries.values() for value in entry.values()):
            raise ConfigError(f"this {type(optimizer).__name__} already holds state for cloud parameters that its "
                              "constructor did not make, made from their placeholders (written after split(), before "
                              "it was attached); the cloud's copy cannot start from it: attach the optimizer first, "
                              "then load its state with opt.load_state_dict(...)")
        saved = optimizer.state_dict()
        saved["state"] = {i: dict(entry) for i, entry in saved["state"].items()}  # as they are now
        self._cloud_entries(saved, self.sent, loading=False)  # refused before anything is attached
        return saved

    def carry(self, saved: dict[str, Any]) -> None:
        """Load ``saved`` (what :meth:`check_initial_state` returned) into the attached copy."""
        self.load_state(saved, optimizers.load_optimizer_state, hooks=False)

    def attached(self, op_id: int) -> None:
        """Build the cloud's copy, as attachment ``op_id`` (the cloud builds each id once)."""
        optimizer, cloud_names = self.optimizer, self.model.cloud_half.names_by_id
        self._state, self._entries = optimizer.state, len(optimizer.state)  # as loaded from a checkpoint
        owns = self.model.cloud_half.owns
        for param, entry in list(optimizer.state.items()):
            if entry and owns(param):  # the constructor's (Adagrad's step count is a real tensor): placeholders
                optimizer.state[param] = initial_state.read_only(entry, cloud_names[id(param)], self.model.cloud_half)
        self._initial = [(p, entry, dict(entry)) for p, entry in optimizer.state.items() if entry and owns(p)]
        self._kept = ([p for p, _, _ in self._initial], [entry for _, entry, _ in self._initial])
        self._stated = {cloud_names[id(p)] for p, _, _ in self._initial}
        optimizer.register_state_dict_post_hook(self._with_cloud_entries)
        groups = [{"names": [cloud_names[id(p)] for p in group["params"] if id(p) in cloud_names],
                   "settings": settings} for group, settings in zip(optimizer.param_groups, self.sent)]
        # The common case, one group of every cloud parameter, goes as small as it did before groups.
        whole = len(groups) == 1 and len(groups[0]["names"]) == len(cloud_names) and self.sent[0] == self.settings
        name = wire_name(type(optimizer))
        assert name is not None  # optimizer_settings refused the others
        self.model.outbox.queue(AttachOptimizer(name=name, settings=self.settings, id=op_id,
                                                groups=None if whole else groups, version=library_version(name)))

    def _group_settings(self) -> tuple[list[dict[str, Any]], list[tuple] | None]:
        """Each group's settings as sent, and their raw values when all are immutable (then, read
        every step, unchanged ones need no conversion again)."""
        raw = [tuple(map(group.get, self.settings)) for group in self.optimizer.param_groups]
        # read every step: plain values and tuples of them (Adam's betas) are told apart by type, in one go
        values = list(itertools.chain.from_iterable(raw))
        kinds = set(map(type, values))
        immutable = kinds <= PLAIN_KINDS or (kinds <= PLAIN_OR_TUPLE and set(map(type, itertools.chain.from_iterable(
            v for v in values if type(v) is tuple))) <= IMMUTABLE)
        if immutable and raw == self._raw:
            return self.sent, self._raw
        out = []
        for group in self.optimizer.param_groups:
            settings = {}
            for key in self.settings:
                value = plain_setting(group.get(key))
                if value is NOT_PLAIN:
                    raise ConfigError(not_mirrored(type(self.optimizer).__name__, key, group.get(key)))
                settings[key] = value
            out.append(settings)
        return out, raw if immutable else None

    def groups_added(self) -> None:
        """Groups the script added (``opt.add_param_group``) since the last look go to the cloud's
        copy, in order; any other change to the groups' parameters is refused before it counts."""
        members = _members(self.optimizer)
        if members == self.members:
            return
        name, known = type(self.optimizer).__name__, len(self.members)
        if members[:known] != self.members:
            raise ConfigError(f"{name}'s parameter groups changed since it was attached (a group's params list edited, "
                              "or a group removed); a split model mirrors the groups it was attached with and the ones "
                              "add_param_group adds: build a new optimizer and attach it")
        if self.model.link.shared:
            raise ConfigError(f"{name}.add_param_group over a shared cloud half: its optimizer is the cloud's")
        settings, _ = self._group_settings()  # refused here if a new group's cannot be sent
        names = self.model.cloud_half.names_by_id
        for index in range(known, len(members)):
            group = self.optimizer.param_groups[index]
            self.model.outbox.queue(AddParamGroup(index=index, settings=settings[index],
                                                  names=[names[id(p)] for p in group["params"] if id(p) in names]))
        self.sent, self.members = [*self.sent, *settings[known:]], members

    def before_step(self) -> None:
        """Refuse, before the step runs, what the mirror would not carry; send the groups added."""
        self._still_attached()
        self.model.before_step()
        self.groups_added()
        self.follow_state()
        self._stepping = self._group_settings()  # refused now, if it cannot be sent, not after the step
        refuse_other_kinds(type(self.optimizer).__name__, self._stepping[0], self.sent)
        self.model.cloud_half.hidden = True

    def follow_state(self) -> None:
        """Before a step, and before anything reads the cloud's copy of the state (``state_dict``, a
        checkpoint, ``unsplit``): what the script did to ``optimizer.state`` since the last look
        reaches the cloud's copy, or is refused."""
        state = self.optimizer.state
        if (state is not self._state or len(state) != self._entries or not self._entries_kept(state)
                or (self._initial and not initial_state.unchanged(state, self._initial))):
            self._check_state()

    def _check_state(self) -> None:
        """The script changed the optimizer's state: fine for the edge's own parameters' entries;
        every cloud parameter's entry gone (``opt.state.clear()``, a fresh ``opt.state``: a reset)
        resets the cloud's copy too, as it would the unsplit optimizer's moments; but some of them
        gone, or state written for a cloud parameter, cannot be repeated in the cloud."""
        state, owns = self.optimizer.state, self.model.cloud_half.owns
        name = type(self.optimizer).__name__
        kept = {id(param): entry for param, entry in zip(*self._kept)}
        written = any(entry and kept.get(id(param)) is not entry for param, entry in state.items() if owns(param))
        if not written and not self._entries_kept(state):
            if any(entry for param, entry in state.items() if owns(param)):
                raise ConfigError(f"{name}'s state was reset for some of the cloud half's parameters only (an entry "
                                  "popped or emptied, or the state replaced without them); the cloud's copy resets the "
                                  "cloud half's moments all together: clear the whole state (opt.state.clear()), or "
                                  "train on")
            self._reset_cloud_state(name)
        elif written or not initial_state.unchanged(state, self._initial):
            raise ConfigError(f"{name}'s state was written for a cloud parameter; the cloud's copy of the optimizer "
                              "keeps the cloud half's state, which the edge cannot set. Keep values of the script's "
                              "own (as SAM's weights before its perturbation) in a dict of its own")
        self._state, self._entries = state, len(state)

    def _reset_cloud_state(self, name: str) -> None:
        """Every cloud parameter's entry was cleared: the cloud's copy drops its state too (as
        torch's load of an empty state does), so the next step starts the cloud half's moments
        afresh, as unsplit."""
        if self.model.link.shared:
            raise ConfigError(f"{name}'s state was reset over a shared cloud half: its optimizer is every edge's, "
                              "whose moments one edge cannot reset")
        if self._initial:
            raise ConfigError(f"{name}'s state was reset since its last step, but {name}'s constructor made the "
                              "state its step reads (Adagrad's sums), so the unsplit optimizer's next step would fail "
                              "on it; train on, or restart from a checkpoint (model.save_checkpoint / resume_from=)")
        if self._stated:
            self.model.outbox.queue(LoadOptimizerState(entries={}))
        self._kept, self._stated = ([], []), set()

    def _entries_kept(self, state: dict) -> bool:
        """Whether each cloud parameter's entry is still the one the mirror put there (one look, by identity)."""
        params, entries = self._kept
        return not any(map(operator.is_not, map(state.get, params), entries))

    def _state_made(self) -> None:
        """After a step: the cloud parameters that had a gradient got state in the cloud's copy, as
        they would in the unsplit optimizer; their entries here are made for the first one."""
        cloud_half = self.model.cloud_half
        new = cloud_half.has_grad - self._stated
        self._stated |= new
        ids = {id(cloud_half.params[name]): name for name in new}
        made = initial_state.step_entries(self.optimizer, ids, cloud_half, self.settings, self.sent)
        state = self.optimizer.state
        for param, entry in made.items():
            if not state.get(param):  # an entry the constructor made (Adagrad's) is kept as it is
                state[param] = entry
                self._kept[0].append(param)
                self._kept[1].append(entry)

    @contextlib.contextmanager
    def edge_only(self) -> Iterator[None]:
        """``state_dict()`` within holds the edge half's entries only (an edge checkpoint: the cloud
        checkpoints its own)."""
        self._edge_only = True
        try:
            yield
        finally:
            self._edge_only = False

    def _cloud_params(self) -> dict[int, torch.Tensor]:
        """The optimizer's cloud parameters by their index in its ``state_dict``."""
        owns = self.model.cloud_half.owns
        params = (p for group in self.optimizer.param_groups for p in group["params"])
        return {i: p for i, p in enumerate(params) if owns(p)}

    def _with_cloud_entries(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """``opt.state_dict()``: the cloud half's entries are its copy's, fetched (one round trip,
        after the steps still on their way), as the tensors the unsplit optimizer would hold, so
        the state dict saves, and loads into a split or an unsplit model alike. A shared half's
        optimizer is every edge's: its entries are left out."""
        cloud = self._cloud_params()
        if not cloud:
            return saved
        self._still_attached()
        self.follow_state()
        state = {i: entry for i, entry in saved["state"].items() if i not in cloud}
        if not (self._edge_only or self.model.link.shared):
            fetched, names = self.model.link.optimizer_state(), self.model.cloud_half.names_by_id
            for i, param in cloud.items():
                arrays = fetched.get(names[id(param)])
                if arrays:
                    here = self.optimizer.state.get(param)  # placeholders, whose dtypes the values take
                    state[i] = {key: array if isinstance(array, NUMBERS) else self._fetched_entry(
                        param, names[id(param)], key,
                        local_value(array, dict.get(here, key) if isinstance(here, dict) else None))
                        for key, array in arrays.items()}  # a Python number (a step count) as unsplit: a copy
            state = dict(sorted(state.items()))
        saved["state"] = state
        return saved

    def _fetched_entry(self, param: torch.Tensor, name: str, key: str, value: torch.Tensor) -> FetchedCloudState:
        """A fetched state value that stands for the cloud's only until its next step or load: unsplit,
        ``opt.state_dict()`` holds the optimizer's own tensors, which the step changes in place."""
        entry = FetchedCloudState(value, f"{key} of {name}", self._state_moment, source=OPTIMIZER_STATE)
        self._fetched[entry] = (param, key)
        return entry

    def _state_moment(self) -> int:
        return self._version

    def load_state(self, saved: dict[str, Any], load: Callable[[torch.optim.Optimizer, dict], None], *,
                   hooks: bool = True) -> None:
        """``opt.load_state_dict(saved)``: the edge half's entries load here (``load``: torch's
        own), the cloud half's go to the cloud's copy, which from then on holds exactly them, as
        torch's load leaves the optimizer holding exactly what it loaded. Checked here first
        against the layout the optimizer keeps, so a refused load changes nothing.

        The optimizer's load pre-hooks (``opt.register_load_state_dict_pre_hook``, a checkpoint
        migrated as it loads) run first, once, on the whole state dict, so what they change
        reaches both halves. ``hooks=False`` runs none of its load hooks (a state carried at
        attachment: unsplit, nothing was loaded)."""
        self._still_attached()
        name = type(self.optimizer).__name__
        if self.model.link.shared:
            raise ConfigError(f"{name}.load_state_dict over a shared cloud half: its optimizer is every edge's")
        if hooks:
            saved = pre_hooked(self.optimizer, saved)
        self.groups_added()
        cloud, names, remote = self._cloud_params(), self.model.cloud_half.names_by_id, self.model.cloud_half
        place, given = by_place(saved)
        loaded = self._loaded_settings(saved)
        entries, layouts = self._cloud_entries({**saved, "state": given}, loaded, loading=hooks)
        with load_hooks_aside(self.optimizer, post=not hooks):
            load(self.optimizer, {**saved, "state": {k: e for k, e in saved.get("state", {}).items()
                                                     if place.get(k) not in cloud}})
        changes = [{k: v for k, v in now.items() if v != before.get(k)} for now, before in zip(loaded, self.sent)]
        self.model.outbox.queue(LoadOptimizerState(entries=entries, changes=changes if any(changes) else None))
        self.sent, self._raw = loaded, None
        state = self.optimizer.state
        for i, keys in layouts.items():
            state[cloud[i]] = initial_state.placeholders(names[id(cloud[i])], keys, remote)
        self._initial = []
        self._kept = ([cloud[i] for i in layouts], [state[cloud[i]] for i in layouts])
        self._stated = {names[id(cloud[i])] for i in layouts}
        self._state, self._entries = state, len(state)
        self._version += 1
        for i in layouts:
            self._follow_loaded(cloud[i], names[id(cloud[i])], given[i])

    def _cloud_entries(self, saved: dict[str, Any], settings: list[dict[str, Any]], *, loading: bool
                       ) -> tuple[dict[str, dict[str, Any]], dict[int, dict[str, Any]]]:
        """``saved``'s entries of cloud parameters as the wire carries them, and their layouts by
        index, each checked against the state this optimizer keeps with ``settings`` (``loading``:
        by ``load_state_dict``, else held before attachment)."""
        cloud, names, name = self._cloud_params(), self.model.cloud_half.names_by_id, type(self.optimizer).__name__
        given = saved.get("state", {})
        entries: dict[str, dict[str, Any]] = {}
        layouts: dict[int, dict[str, Any]] = {}
        expected = self._layout([p for i, p in cloud.items() if given.get(i)], settings, loading)
        for i, param in cloud.items():
            entry = given.get(i)
            if not entry:
                continue
            pname = names[id(param)]
            keys = expected.get(id(param), {})
            if set(entry) != set(keys) or not all(fits(v, keys[k]) for k, v in entry.items()):
                raise ConfigError(NOT_ITS_STATE[loading].format(name=name, pname=pname, keys=sorted(keys)))
            entries[pname] = {key: value if isinstance(value, NUMBERS) else wire_value(value)
                              for key, value in entry.items()}
            layouts[i] = {key: layout for key, layout in keys.items() if isinstance(layout[1], torch.dtype)}
        return entries, layouts

    def _follow_loaded(self, param: torch.Tensor, name: str, entry: dict[str, Any]) -> None:
        """Unsplit, torch's load keeps the loaded tensors as the optimizer's state (where no cast was
        needed): the state dict loaded follows training, so one saved again later holds the moments
        of then. Its cloud entries stand for the cloud's from now on, refusing a read once they
        moved on (:mod:`.fetched_state`)."""
        for key, value in list(entry.items()):
            if isinstance(value, NUMBERS):
                continue  # a Python number: the loaded dict keeps it, as unsplit (no later step changes it)
            if key == "step" or (value.dtype, value.device) == (param.dtype, param.device):
                with torch._C.DisableTorchFunctionSubclass():
                    plain = value.detach()
                marker = FetchedCloudState(plain, f"{key} of {name}", self._state_moment, source=OPTIMIZER_STATE)
                try:  # what else holds the loaded tensor (a reference kept before the load) holds the marker
                    torch.utils.swap_tensors(value, marker)
                    marker = value
                except RuntimeError:
                    pass  # held by torch too (a view of it, a weak reference): the dict's entry alone stands for it
                self._fetched[marker] = (param, key)
                entry[key] = marker

    def unsplit(self, fetched: dict[str, dict[str, Any]] | None) -> None:
        """The model is whole again: the cloud parameters' entries become the cloud's state
        (``fetched``; None for a shared half's, which starts afresh here), placed as torch's own
        load places a state, and the optimizer is no longer mirrored."""
        optimizers.forget(self.optimizer)
        names = self.model.cloud_half.names_by_id
        state, index = self.optimizer.state, 0
        packed = self.optimizer.state_dict()["param_groups"]  # the groups as a state dict holds them (ids)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                name = names.get(id(param))
                if name is not None:
                    arrays = (fetched or {}).get(name)
                    state.pop(param, None)
                    if arrays:
                        state[param] = {key: array if isinstance(array, NUMBERS)
                                        else placed(param, key, torch.tensor(array), index, packed)
                                        for key, array in arrays.items()}
                index += 1
        for entry, (param, key) in list(self._fetched.items()):  # current ones are the optimizer's memory now
            if entry._splitft_moment == self._version and key in state.get(param, {}):
                entry.follow(state[param][key])
        self._version += 1

    def _loaded_settings(self, saved: dict[str, Any]) -> list[dict[str, Any]]:
        """Each group's settings once torch's load has taken ``saved``'s (it keeps only the groups'
        parameters), as they are sent; refused, before anything is loaded, where one cannot be."""
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.sent):
            return self.sent  # torch's own load refuses it, with its own words
        out = []
        for group, sent in zip(groups, self.sent):
            settings = dict(sent)
            for key in self.settings:
                if isinstance(group, dict) and key in group:
                    value = plain_setting(group[key])
                    if value != sent.get(key) and (value is NOT_PLAIN or not same_kind(value, sent.get(key))):
                        raise ConfigError(f"{type(self.optimizer).__name__}.load_state_dict: the state dict's {key} is "
                                          f"{group[key]!r} where the optimizer has {sent.get(key)!r}; a split model "
                                          "mirrors a change of a plain number or flag to one of its kind, not this")
                    settings[key] = value
            out.append(settings)
        return out

    def _layout(self, params: list[torch.Tensor], settings: list[dict[str, Any]],
                loading: bool = True) -> dict[int, dict[str, Any]]:
        """The state layout this optimizer keeps for ``params`` (by id) with each group's
        ``settings``; refused when not known (``loading``: by ``load_state_dict``, else held from
        steps before ``split()``)."""
        found = initial_state.layouts(self.optimizer, {id(p) for p in params}, self.settings, settings, numbers=True)
        if found is None:
            raise ConfigError(unknown_layout(type(self.optimizer).__name__, loading))
        return found

    def step_failed(self) -> None:
        """The step raised (the script may catch it and go on): nothing reaches the cloud, whose
        gradients are the script's to clear again."""
        self.model.cloud_half.hidden = False

    def after_step(self) -> None:
        model = self.model
        model.cloud_half.hidden = False
        now, self._raw = self._stepping
        if not model.cloud_half.has_grad <= self._stated:
            self._state_made()
        self._state, self._entries = self.optimizer.state, len(self.optimizer.state)
        lrs: list[Any] = [group.get("lr") for group in now]
        changes = [{k: v for k, v in group.items() if k != "lr" and v != before.get(k)}
                   for group, before in zip(now, self.sent)]
        self.sent = now
        self._version += 1
        model.steps.step += 1
        single = len(lrs) == 1
        model.outbox.queue(Step(id=model.steps.step, lr=lrs[0] if single else None, lrs=None if single else lrs,
                                changes=changes if any(changes) else None))
        if model.link.shared:
            # Other edges train the same cloud half: apply the step now, not with this edge's next
            # message, so it lands between the other edges' steps where the user's loop put it.
            model.link.sync()
        model.on_step()


def _members(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    return [tuple(map(id, group["params"])) for group in optimizer.param_groups]


__all__ = ["OptimizerMirror", "Owner"]
