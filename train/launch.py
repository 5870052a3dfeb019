"""Work split across launched processes, for the offline scripts (data generation, feature caching).

Under ``accelerate launch --multi_gpu --num_processes N`` or ``torchrun --nproc_per_node N``, each
process takes a fixed share of the work units (rank r takes units r, r+N, r+2N, ...), writes only
files of its own, and rank 0 assembles the result after a barrier. Without a launcher the state is
None and one process does everything, through the same code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from datetime import timedelta

import torch

# Ranks may finish far apart (a resumed run whose work was left unevenly), so the end-of-run
# barrier waits long; a rank that fails ends the whole launch anyway.
BARRIER_TIMEOUT = timedelta(hours=24)


def launch_state():
    """accelerate's ``PartialState`` when this process is one of several, else None.

    On a machine without a GPU the state is a CPU (gloo) one, so ``accelerate launch --multi_gpu``
    really starts cooperating processes there. Raises ``RuntimeError`` when the launcher started
    several processes that accelerate does not see as one job (they would overwrite each other)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    state = PartialState(cpu=cpu, timeout=BARRIER_TIMEOUT)
    if state.num_processes != world:
        raise RuntimeError(f"{world} processes were launched but accelerate sees {state.num_processes}: they would "
                           "write the same files. Launch with `accelerate launch --multi_gpu --num_processes N` "
                           "or `torchrun --nproc_per_node N`")
    return state


def rank_and_world(state) -> tuple[int, int]:
    """(process index, process count) of a ``PartialState``-like object; (0, 1) for None."""
    return (0, 1) if state is None else (int(state.process_index), int(state.num_processes))


def my_units(num_units: int, state) -> range:
    """The work units this process owns: r, r+N, r+2N, ... (all of them for a single process)."""
    rank, world = rank_and_world(state)
    return range(rank, num_units, world)


def wait_for_everyone(state) -> None:
    """A barrier across the launched processes (nothing for a single process)."""
    if state is not None:
        state.wait_for_everyone()


def main_process_first(state):
    """Context in which rank 0 runs first and the others after it (e.g. to build a model folder
    once: transformers' ``save_pretrained`` writes on global rank 0 only)."""
    return contextlib.nullcontext() if state is None else state.main_process_first()


def end_process() -> None:
    """End one rank of a finished several-process run with status 0, once every rank has passed a
    last barrier and its output is flushed, without the interpreter's teardown; nothing for a single
    process. For a process's own entry point only (a script's ``__main__``, ``headway train``).

    Why: ``destroy_process_group`` does not free the gloo process group while DDP's reducer or
    accelerate's state still holds it, so its C++ side was torn down by exit-time destructors while
    the peer ranks exited, and a rank now and then aborted after a finished run (SIGABRT, "terminate
    called without an active exception"; seen in CI on the two-machine loopback run, also with the
    group destroyed). ``os._exit`` runs no destructor, and after the barrier no collective is in flight."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    dist.barrier()  # every rank has written its files and finished its last collective
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
