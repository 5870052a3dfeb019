"""FSDP2 for the drafter under training: torch's ``fully_shard``, applied by headway itself.

accelerate runs FSDP only on GPUs (on a CPU it silently trains unsharded), so headway shards the
training module with torch's own ``fully_shard`` on the process group that accelerate (or
torchrun) set up: the same code on CPUs (gloo) and GPUs (NCCL). One FSDP unit, the training
module: its trainable parameters, their gradients and the optimizer state are sharded across the
ranks at rest and gathered for each forward (a drafter is one layer or a few heads; its losses read
weights such as an lm_head directly, which a single unit keeps whole during the forward). The
frozen target is not a submodule of the training module and stays whole on every rank.

Checkpoints hold the whole trainable state (gathered by torch.distributed.checkpoint's state-dict
helpers and written by rank 0 as safetensors), so an FSDP run resumes with any number of processes.
Every function here is collective: all ranks call it, in the same order.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from headway.train.checkpoint import flatten_state, unflatten_state

_SEP = "::"  # between a parameter's name and its optimizer state's name (names hold dots)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` (in place) as one FSDP unit; build the optimizer afterwards (the sharded
    parameters are new tensors)."""
    fully_shard(model)
    return model


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter of a sharded ``model``, whole, on CPU, on every rank."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().contiguous() for k, v in full.items() if k in names}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole trainable tensors (from ``trainable_state``) into a sharded ``model``."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer's whole state as (tensors keyed 'param::name', JSON metadata)."""
    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    tensors, scalars = flatten_state(sd["state"], _SEP)
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars, "keys": "parameter names"}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         meta: dict) -> None:
    """Restore what ``optimizer_state`` returned, resharded over this run's processes."""
    state = unflatten_state(tensors, meta["scalars"], _SEP)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": meta["param_groups"]},
                             options=StateDictOptions(full_state_dict=True))


def unshard_for_export(model: torch.nn.Module) -> None:
    """Replace every sharded trainable parameter by its whole tensor, on every rank, so that the
    export and the parameter fingerprints read ordinary tensors. The module is not trained after this."""
    state = trainable_state(model)
    device = next(model.parameters()).device
    for name, value in state.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._parameters[leaf] = torch.nn.Parameter(value.to(device), requires_grad=True)
