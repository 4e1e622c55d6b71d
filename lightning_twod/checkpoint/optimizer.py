"""The optimizers' states in checkpoints, beside the sharded tables' (``tables``).

* In a distributed checkpoint, the dense optimizers' tensors are DCP data under
  ``optimizer_<index>.<parameter>.<name>`` and the rest (param groups, numbers) goes to
  ``trainer_state.pt`` (``optimizer_tensors`` splits the two).
* A ``ZeroRedundancyOptimizer`` holds each parameter's state on one rank only: a checkpoint holds
  it consolidated, one state per parameter as any other optimizer's (``state_to_save``); a ZeRO
  optimizer takes its own parameters' part back, and a plain optimizer loads it as its own
  (``load_request``, ``load_state``).
* A single-file checkpoint of the unsharded model holds one optimizer state over every parameter,
  tables included; ``dense_optimizer_state`` maps it onto an optimizer of the dense parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.optim import ZeroRedundancyOptimizer


def optimizer_tensors(index: int, state: dict) -> tuple[dict[str, Tensor], dict]:
    """Split an FQN-keyed optimizer state dict into its tensors (flat keys) and the rest."""
    tensors, rest = {}, {"param_groups": state.get("param_groups", []), "state": {}}
    for fqn, values in state.get("state", {}).items():
        for name, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer_{index}.{fqn}.{name}"] = value
            else:
                rest["state"].setdefault(fqn, {})[name] = value
    return tensors, rest


def state_to_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state keyed by parameter names (DCP's ``get_optimizer_state_dict``), as a
    distributed checkpoint holds it; a collective for a ``ZeroRedundancyOptimizer``.

    A ZeRO optimizer's state is consolidated on the first rank of its process group, as Lightning's
    ``Strategy.optimizer_state`` does: that rank returns the state of every parameter, the others an
    empty state (they write none of it).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return get_optimizer_state_dict(model, optimizer)
    optimizer.consolidate_state_dict(to=0)
    if optimizer.rank != 0:
        return {"param_groups": [], "state": {}}
    state, names = optimizer.state_dict(), _parameter_names(model, optimizer)
    return {"state": {names[index]: values for index, values in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def load_request(index: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 saved: Mapping[str, object]) -> dict[str, Tensor]:
    """The tensors to read for optimizer ``index`` (keys of ``optimizer_tensors``), to be filled in place.

    ``saved``: the checkpoint's DCP metadata by key. A ``ZeroRedundancyOptimizer`` reads every saved
    tensor of its index on every rank (its state is small: dense parameters only), since
    ``load_state`` hands it the whole state to keep its part of.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer_tensors(index, get_optimizer_state_dict(model, optimizer))[0]
    prefix = f"optimizer_{index}."
    return {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in saved.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, path: object) -> None:
    """Load a state keyed by parameter names (as ``state_to_save`` gives it) into ``optimizer``.

    ``path``: the checkpoint it was read from, for errors. Raises ``KeyError`` when a
    ``ZeroRedundancyOptimizer``'s parameters are not the saved ones in the saved order, or the state
    holds an entry for a name that is none of them.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        set_optimizer_state_dict(model, optimizer, state)
        return
    names = _parameter_names(model, optimizer)
    saved = [name for group in state["param_groups"] for name in group["params"]]
    if saved != names:
        raise KeyError(f"checkpoint {path}: its state of {type(optimizer).__name__} is for the parameters "
                       f"{saved[:5]}..., this one has {names[:5]}...; was it saved with the same configure_optimizers?")
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise KeyError(f"checkpoint {path} holds {type(optimizer).__name__} state for {unknown[:5]}, which are not "
                       f"parameters of the model (those are {names[:5]}...); was it saved from this model?")
    optimizer.load_state_dict({
        "state": {index[name]: values for name, values in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    })


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names in ``model`` of ``optimizer``'s parameters, in the order of its groups (its state's indices)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def dense_optimizer_state(state: dict, optimizer: torch.optim.Optimizer, unsharded: list[tuple[str, bool]],
                          model: torch.nn.Module) -> tuple[dict | None, str]:
    """An optimizer state saved for the unsharded model (tables included), for ``optimizer`` whose
    groups hold only the dense parameters: ``(state, "")``, or ``(None, why)`` when it cannot map.

    ``unsharded``: ``(parameter name, is a table)`` of the unsharded model in its order. Each saved
    group must be the current group plus table parameters, all in the model's order (what an
    optimizer built from ``model.parameters()`` or from filtered lists of it has); every restored
    tensor must have its parameter's shape.
    """
    saved_groups, groups = state.get("param_groups", []), optimizer.param_groups
    if len(saved_groups) != len(groups):
        return None, f"{len(saved_groups)} parameter group(s) in the checkpoint, {len(groups)} here"
    position = {name: i for i, (name, _) in enumerate(unsharded)}
    tables = [name for name, table in unsharded if table]
    names = {id(p): n for n, p in model.named_parameters()}
    mapped: dict = {"state": {}, "param_groups": []}
    start = 0  # a state numbers its groups' parameters in order (computed: a ZeRO optimizer has no state_dict here)
    for saved, group in zip(saved_groups, groups, strict=True):
        indices = range(start, start + len(group["params"]))
        start += len(indices)
        dense = [names.get(id(p)) for p in group["params"]]
        if any(n not in position for n in dense) or dense != sorted(dense, key=position.__getitem__):
            return None, "its parameters are not the model's, in the model's order"
        extra = len(saved["params"]) - len(dense)
        if extra == 0:
            order = dense
        elif extra == len(tables):
            order = sorted(dense + tables, key=position.__getitem__)
        else:
            return None, (f"a group held {len(saved['params'])} parameters, here {len(dense)} dense and "
                          f"{len(tables)} tables")
        new_index = dict(zip(dense, indices, strict=True))
        params = dict(zip(group["params"], dense, strict=True))
        shapes = {name: p.shape for p, name in params.items()}
        for name, saved_index in zip(order, saved["params"], strict=True):
            if name not in new_index or saved_index not in state.get("state", {}):
                continue
            values = state["state"][saved_index]
            wrong = [k for k, v in values.items() if isinstance(v, Tensor) and v.dim() and v.shape != shapes[name]]
            if wrong:
                return None, f"its {wrong} for {name!r} has another shape than the parameter"
            mapped["state"][new_index[name]] = values
        mapped["param_groups"].append({**saved, "params": list(indices)})
    return mapped, ""
