"""Which hooks a ghost refuses: a cloud module's hooks would run on the edge, or never.

A hook on a module of the cloud half cannot do there what it does unsplit: a forward or backward
hook inside the half would never run (its code runs in the cloud), and a state-dict hook would
meet the edge's placeholders, while ``model.state_dict()`` fetches the cloud's values past it.
Each is refused when registered after ``split()``, and by ``split()`` when registered before
(:func:`refuse_hooks`), naming where the hook can go instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import CutError


HOOKS = ("register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook",
         "register_full_backward_pre_hook", "register_backward_hook")
#: A module's state-dict hooks: a cloud module's state is fetched and pushed without them.
STATE_HOOKS = ("register_state_dict_pre_hook", "register_state_dict_post_hook", "_register_state_dict_hook",
               "register_load_state_dict_pre_hook", "_register_load_state_dict_pre_hook",
               "register_load_state_dict_post_hook")
#: Where a module keeps its state-dict hooks.
STATE_HOOK_TABLES = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")
#: The process-wide hooks every module's call runs (torch.nn.modules.module.register_module_*_hook).
GLOBAL_HOOKS = (nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks,
                nn.modules.module._global_backward_pre_hooks, nn.modules.module._global_backward_hooks)

#: Where a module keeps the hooks each registration adds.
HOOK_TABLES = {"register_forward_pre_hook": "_forward_pre_hooks", "register_forward_hook": "_forward_hooks",
               "register_full_backward_hook": "_backward_hooks", "register_full_backward_pre_hook": "_backward_pre_hooks",
               "register_backward_hook": "_backward_hooks"}


#: Libraries whose models register hooks of their own: transformers installs output-recording
#: hooks the first time a forward asks for hidden states or attentions; they record, never change
#: what a module returns, and the cloud's copy of the model installs its own when asked.
LIBRARY_HOOKS = ("transformers.",)
#: Whose state-dict hooks a cloud module may hold: torch's and the model libraries' own, made by the
#: factory too (the cloud's copy of the module holds the same).
STATE_HOOK_LIBRARIES = ("transformers.", "peft.", "torch.")


def library_hook(hook: Any) -> bool:
    module = getattr(hook, "__module__", None) or ""
    return module.startswith(LIBRARY_HOOKS)


def never_run(ushape: bool, index: int) -> tuple[str, ...]:
    """The hooks the ``index``-th cloud module's ghost cannot run on itself. A plain split's first
    runs its forward pre-hooks (then stops the forward), the others run nothing; a U-shape trunk's
    modules run their forward hooks on the edge (one that reads an inner module's output is refused
    at the forward), but no backward hook: the trunk's backward runs in the cloud."""
    if ushape:
        return HOOKS[2:]
    return HOOKS[1:] if index == 0 else HOOKS


def refuse_hooks(stages: Any, tensors: dict[str, torch.Tensor], ushape: bool) -> None:
    """Hooks registered before ``split()`` on what goes to the cloud: refused as they would be
    after it (they would never run, and training would silently differ), before anything changed."""
    for i, (name, module) in enumerate(zip(stages.names, stages.stages)):
        never = never_run(ushape, i)
        for key, sub in module.named_modules():
            for hook in (HOOKS if key else never):
                if any(not library_hook(h) for h in getattr(sub, HOOK_TABLES[hook], {}).values()):
                    where = f"{name}.{key}" if key else name
                    raise CutError(f"{where!r} has a hook ({hook}, registered before split()): that module runs in the "
                                   "cloud, so the hook would never run there; remove it, register it on a module that "
                                   "stays on the edge, or cut elsewhere")
            held = [h for table in STATE_HOOK_TABLES for h in getattr(sub, table, {}).values()]
            if any(not (getattr(getattr(h, "hook", h), "__module__", None) or "").startswith(STATE_HOOK_LIBRARIES)
                   for h in held):
                where = f"{name}.{key}" if key else name
                raise CutError(f"{where!r} has a state-dict hook (registered before split()): that module's state is "
                               "the cloud's, which model.state_dict() and load_state_dict() fetch and push without "
                               "it; remove it and transform the state dict yourself around those calls")
    for name, tensor in tensors.items():
        if getattr(tensor, "_backward_hooks", None) or getattr(tensor, "_post_accumulate_grad_hooks", None):
            raise CutError(f"cloud parameter {name!r} has a gradient hook (register_hook or "
                           "register_post_accumulate_grad_hook, before split()): its gradient is computed and "
                           "accumulated in the cloud, where the hook would never run; remove it or cut elsewhere")


def refused_hook(where: str, hook: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if args and library_hook(args[0]):
            raise CutError("the forward asked for hidden states or attentions (output_hidden_states, "
                           "output_attentions), which transformers records with hooks on every layer, but "
                           f"{where!r} runs in the cloud, where they would not record: leave them off with a split "
                           "model, or ask the unsplit one (model.unsplit())")
        raise CutError(f"{hook} on {where!r}: that module runs in the cloud, so the hook would never run; "
                       "register it before split() on a module that stays on the edge, or cut elsewhere")
    return refuse


def refused_state_hook(where: str, hook: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CutError(f"{hook} on {where!r}: that module's state is the cloud's, which model.state_dict() and "
                       "load_state_dict() fetch and push without running the edge's hooks; transform the state dict "
                       "yourself around those calls, or register the hook on the unsplit model")
    return refuse


__all__ = ["GLOBAL_HOOKS", "HOOKS", "HOOK_TABLES", "STATE_HOOKS", "library_hook", "never_run", "refuse_hooks",
           "refused_hook", "refused_state_hook"]
