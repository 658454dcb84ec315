"""The core's training state as a megatron-core distributed checkpoint, loadable at another layout.

A checkpoint is one folder in megatron-core's ``torch_dist`` format (``metadata.json``,
``common.pt`` and PyTorch Distributed Checkpoint files): every tensor is stored by its global
shape and each rank's offset in it, as the model's and the optimizer's ``sharded_state_dict``
describe them, so a run saved at one TP/PP/EP resumes at another, and a Megatron-LM job (or
``megatron.core.dist_checkpointing.load``) reads the model and optimizer of a Gyre run.

Why not ``dist_checkpointing.save`` itself: it is collective over the whole torch.distributed
world (a world barrier, rank-0 coordination over the default group), and in Gyre the world holds
every cell, while only the core cell (global ranks ``0..n-1``, so its group ranks are its global
ranks) holds the authoritative state; satellites may be serving, switching roles, or dead. So the
pieces of megatron-core's save run here with the core's own group: its pre-processing (factories,
the common part), its ``torch_dist`` conversion and save planner, and PyTorch's checkpoint
writer/reader on ``process_group=core``. Loading goes through ``dist_checkpointing.load`` with a
load strategy bound to that group.

What is in a checkpoint: the model and the optimizer (Adam's moments, fp32 master weights in bf16,
the step counts), and Gyre's own ``version``. Not in it: the learning-rate schedule (a function
of the step, recomputed), and the RNG streams (Gyre's training draws none: dropout is 0 unless a
team's ``[training.megatron]`` sets it, and then a resumed run's dropout masks differ from an
uninterrupted one's).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["load_training_state", "save_training_state", "sharded_training_state"]

GYRE_KEY = "gyre"
"""The common (unsharded) part Gyre adds: ``{"version": int}``."""


def sharded_training_state(ddp: Any, optimizer: Any, version: int, is_loading: bool = False) -> dict[str, Any]:
    """The model's and the optimizer's sharded state (megatron-core's own descriptions of which
    slice of each global tensor this rank holds) and Gyre's version."""
    module = ddp.module
    model = module.sharded_state_dict()
    state: dict[str, Any] = {"model": model, GYRE_KEY: {"version": int(version)}}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model, is_loading=is_loading)
    return state


def _map_sharded_data(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply ``fn`` to the data of every sharded tensor (and factory) in ``state``, in place."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for v in nested_values(state):
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and isinstance(v.data, torch.Tensor):
            v.data = fn(v.data)


def save_training_state(state: dict[str, Any], directory: str, group: Any,
                        host_view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Write ``state`` (:func:`sharded_training_state`) to ``directory`` with every rank of
    ``group`` (the core cell) and no other. Written to ``directory.partial`` first and renamed
    once every rank's part is on disk, so a crash mid-save leaves no folder by the final name.
    ``host_view``: read offloaded tensors where their bytes are (a core that left training)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed import checkpoint as dcp

    first = dist.get_rank(group) == 0
    partial = directory + ".partial"
    if first:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier(group=group)
    if host_view is not None:
        _map_sharded_data(state, host_view)
    sharded, common = save_preprocess(state, validate_access_integrity=False)
    if first:
        torch.save(common, os.path.join(partial, "common.pt"))
    # megatron-core's torch_dist conversion: keys by their sharded names, one main replica each
    # (within the core: tensor shard 0 of a tensor every tensor shard holds whole)
    flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    pyt = mcore_torch.mcore_to_pyt_state_dict(flat, False)
    dcp.save(pyt, storage_writer=dcp.FileSystemWriter(partial),
             planner=mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
             process_group=group)
    if first:
        backend = mcore_torch.TorchDistSaveShardedStrategy("torch_dist", 1)
        save_config(CheckpointingConfig(backend.backend, backend.version), partial)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(partial, directory)
    dist.barrier(group=group)


def _group_load_strategy(group: Any) -> Any:
    """megatron-core's ``torch_dist`` load strategy with PyTorch's checkpoint reader planning
    over ``group`` instead of the whole world (0.13 to 0.16 read through the module's
    ``checkpoint.load_state_dict``, which is bound to the group for the call)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    real = mcore_torch.checkpoint

    class InGroup:
        """``torch.distributed.checkpoint`` whose ``load_state_dict`` plans over ``group``."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def load_state_dict(*args: Any, **kwargs: Any) -> Any:
            return real.load_state_dict(*args, **{**kwargs, "process_group": group})

    class GroupLoad(mcore_torch.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            mcore_torch.checkpoint = InGroup()  # the rank runs one call at a time: no other reader
            try:
                return super().load(sharded_state_dict, checkpoint_dir)
            finally:
                mcore_torch.checkpoint = real

    return GroupLoad()


def load_training_state(state: dict[str, Any], directory: str, group: Any) -> dict[str, Any]:
    """Read ``directory`` into the shapes ``state`` (:func:`sharded_training_state` with
    ``is_loading=True``) describes, whatever TP/PP/EP wrote it; answers the loaded state dict
    (tensors in place of the sharded descriptions, and ``state["gyre"]`` as saved)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(state, directory, sharded_strategy=_group_load_strategy(group),
                                   validate_access_integrity=False)
