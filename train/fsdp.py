"""FSDP2 for the drafter under training: torch's ``fully_shard``, applied by headway itself.

accelerate runs FSDP only on GPUs (on a CPU it silently trains unsharded), so headway shards the
training module with torch's own ``fully_shard`` on the process group that accelerate (or
torchrun) set up: the same code on CPUs (gloo) and GPUs (NCCL). One FSDP unit, the training
module: its trainable parameters, their gradients and the optimizer state are sharded across the
ranks at rest and gathered for each forward (a drafter is one layer or a few heads; its losses read
weights such as an lm_head directly, which a single unit keeps whole during the forward). The
frozen target is not a submodule of the training module and stays whole on every rank.

Checkpoints: every rank writes its own shards of the trainable weights and the optimizer state
with torch.distributed.checkpoint (its format: a file per rank plus metadata), and a resumed run
reads them resharded to its own number of processes. The export alone gathers whole weights.
Every function here is collective: all ranks call it, in the same order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` (in place) as one FSDP unit; build the optimizer afterwards (the sharded
    parameters are new tensors)."""
    fully_shard(model)
    return model


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter of a sharded ``model``, whole, on CPU, on every rank."""
    names = _trainable_names(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().contiguous() for k, v in full.items() if k in names}


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    names = _trainable_names(model)
    weights = {k: v for k, v in get_model_state_dict(model).items() if k in names}  # this rank's shards
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of the trainable weights and of the optimizer state to ``folder``."""
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(folder))


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Read ``save_state``'s shards back, resharded to this run's processes (any number)."""
    state = _sharded_state(model, optimizer)  # the layout to fill (initialises the optimizer's state)
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def unshard_for_export(model: torch.nn.Module) -> None:
    """Replace every sharded trainable parameter by its whole tensor, on every rank, so that the
    export and the parameter fingerprints read ordinary tensors. The module is not trained after this."""
    state = trainable_state(model)
    device = next(model.parameters()).device
    for name, value in state.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._parameters[leaf] = torch.nn.Parameter(value.to(device), requires_grad=True)
