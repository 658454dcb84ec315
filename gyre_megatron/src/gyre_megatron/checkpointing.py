"""The core's training state as a megatron-core distributed checkpoint, loadable at another layout.

A checkpoint is one folder in megatron-core's ``torch_dist`` format (``metadata.json``,
``common.pt`` and PyTorch Distributed Checkpoint files): every tensor is stored by its global
shape and each rank's offset in it, as the model's and the optimizer's ``sharded_state_dict``
describe them, so a run saved at one TP/PP/EP resumes at another, and a Megatron-LM job (or
``megatron.core.dist_checkpointing.load``) reads a Gyre run's model weights. (The optimizer's
tensors carry megatron-core's keys too, but not its per-optimizer nesting: see
:func:`sharded_training_state`.)

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
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["load_training_state", "restore_optimizer", "save_training_state", "sharded_training_state", "sub_optimizers"]

GYRE_KEY = "gyre"
"""The common (unsharded) part Gyre adds: ``{"version": int, "optimizer_step": int | None}``."""


def sub_optimizers(optimizer: Any) -> list[Any]:
    """megatron-core's optimizers under ``optimizer``: a mixture of experts chains one for the
    dense and one for the expert parameters; how many depends on the layout."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _sharded_leaves(parts: list[Any]) -> list[Any]:
    """Every sharded tensor (or factory) in ``parts``, in a fixed order. Not keyed by their
    global key: one key names a whole stack of layers, each rank holding several of its slices."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return [v for part in parts for v in nested_values(part) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]


def _common_step(tree: Any) -> Any:
    """Adam's step count, which megatron-core's optimizers keep once for all parameters."""
    if isinstance(tree, dict):
        if "common_step" in tree:
            return tree["common_step"]
        for v in tree.values():
            found = _common_step(v)
            if found is not None:
                return found
    return None


def sharded_training_state(ddp: Any, optimizer: Any, version: int, is_loading: bool = False
                           ) -> tuple[dict[str, Any], list[Any]]:
    """The state to save or load, and the optimizer's own sharded state dicts (one per chained
    optimizer) that :func:`restore_optimizer` fills after a load.

    The model's sharded state is megatron-core's. The optimizer's tensors are stored under their
    global keys (``optimizer.state.exp_avg.<parameter>``) without megatron-core's per-optimizer
    nesting and prefixes: those follow the chain of optimizers, which differs between layouts (a
    mixture of experts at EP 2 chains two, at EP 1 one), so a checkpoint in them would not load at
    another. Adam's step count, one for all parameters, goes with Gyre's own state."""
    model = ddp.module.sharded_state_dict()
    parts = [o.sharded_state_dict(model, is_loading=is_loading) for o in sub_optimizers(optimizer)] \
        if optimizer is not None else []
    step = next((s for s in map(_common_step, parts) if s is not None), None)
    gyre = {"version": int(version), "optimizer_step": None if step is None else int(step)}
    state: dict[str, Any] = {"model": model, GYRE_KEY: gyre}
    if parts:
        state["optimizer"] = {str(i): v for i, v in enumerate(_sharded_leaves(parts))}
    return state, parts


def restore_optimizer(optimizer: Any, parts: list[Any], loaded: dict[str, Any]) -> None:
    """Load the tensors ``loaded`` holds (:func:`load_training_state`) into each of
    ``optimizer``'s chained optimizers, through their own ``load_state_dict``."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    step = loaded[GYRE_KEY].get("optimizer_step")
    # the loaded tensor of each sharded leaf, by the leaf's place in the state that was loaded
    tensors = {id(v): loaded["optimizer"][str(i)] for i, v in enumerate(_sharded_leaves(parts))}

    def filled(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: filled(v) for k, v in node.items()}
        if isinstance(node, list):
            return [filled(v) for v in node]
        if isinstance(node, (ShardedTensor, ShardedTensorFactory)):
            return tensors[id(node)]
        if isinstance(node, LocalNonpersistentObject):
            return node.unwrap()
        return node

    def with_step(tree: Any) -> None:
        """Put the saved step where megatron-core's ``load_state_dict`` looks for it (an
        optimizer's state allocated for loading has none yet)."""
        if isinstance(tree, dict):
            if "state" in tree and "param_groups" in tree:
                tree["state"]["common_step"] = torch.tensor(float(step))
            else:
                for v in tree.values():
                    with_step(v)

    for sub, part in zip(sub_optimizers(optimizer), parts, strict=True):
        state = filled(part)
        if step is not None:
            with_step(state)
        sub.load_state_dict(state)


def save_training_state(state: dict[str, Any], directory: str, group: Any) -> None:
    """Write ``state`` (:func:`sharded_training_state`) to ``directory`` with every rank of
    ``group`` (the core cell) and no other. Written to ``directory.partial`` first and renamed
    once every rank's part is on disk, so a crash mid-save leaves no folder by the final name."""
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
