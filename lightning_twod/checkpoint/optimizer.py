"""The optimizers' states in checkpoints, beside the sharded tables' (``tables``).

* In a distributed checkpoint, the dense optimizers' tensors are DCP data under
  ``optimizer_<index>.<parameter>.<name>`` and the rest (param groups, numbers) goes to
  ``trainer_state.pt`` (``optimizer_tensors`` splits the two).
* A single-file checkpoint of the unsharded model holds one optimizer state over every parameter,
  tables included; ``dense_optimizer_state`` maps it onto an optimizer of the dense parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
    template = optimizer.state_dict()
    mapped: dict = {"state": {}, "param_groups": []}
    for saved, group, indices in zip(saved_groups, groups, (g["params"] for g in template["param_groups"]),
                                     strict=True):
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
