"""One rank of a Gyre training cell: its pipeline stage, groups, and the step protocol.

Layout: K cells with one parallel layout (a PP-stage pipeline of TP-wide stages per cell); cell
0 is the core. ``initialize_model_parallel(order="tp-cp-ep-pp-dp")`` puts data parallelism
outermost and tensor parallelism innermost, so cell ``c`` is the contiguous block of ``T·P``
ranks from ``c·T·P``, rank ``c·T·P + s·T + t`` is tensor shard ``t`` of stage ``s``, and the
pipeline and tensor groups are megatron-core's own. All process groups exist from start-up
because torch cannot grow a group:

* per cell, a gloo *side group* (the stream's control channel, join decisions, token counts);
* for every prefix size ``m = 2..K`` and shard ``(s, t)``, the *prefix group* of ranks
  ``{c·T·P + s·T + t : c < m}``: gradients are summed over the prefix of cells taking part in
  a step, shard by shard.

Step protocol (``run_step``): the core exposes its weights (Mooncake), every participating cell's
leader claims micro-steps from the shared queue and streams them through its pipeline; a satellite
joins by registering in the c10d store (atomic ``compare_set``) and pulling the core's weights.
When the core's stream has drained it closes the join window (the same ``compare_set`` keys),
which fixes the participating prefix ``m``; grads and token counts are all-reduced over the
prefix group; the core alone normalises, clips and steps its optimizer; the new parameters are
broadcast to the satellites that stay for the next step of the burst.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from gyre_core.interfaces import StepFailed

from gyre_megatron import compat
from gyre_megatron.checks import RankChecks
from gyre_megatron.figures import objective_figures
from gyre_megatron.model import build_stage, gpt_forward_step, make_optimizer
from gyre_megatron.offload import Offloader
from gyre_megatron.rank_options import RankOptions
from gyre_megatron.streaming import ControlChannel, run_streaming_1f1b

__all__ = ["CellRank", "RankOptions", "StepFailed"]


class CellRank(RankChecks):
    def __init__(self, rank: int, world: int, opts: RankOptions, queues: Sequence[Any]) -> None:
        from gyre_megatron.patching import ensure_cpu_patches

        self.patch = ensure_cpu_patches()
        from megatron.core import parallel_state as ps

        self.rank, self.world, self.opts, self.queues = rank, world, opts, queues
        if opts.precision == "bf16" and not torch.cuda.is_available():
            raise ValueError("precision bf16 needs CUDA: megatron-core's mixed-precision optimizer wraps only "
                             "CUDA parameters (use fp32 on a machine without GPUs)")
        K, P, T = opts.cells, opts.pp, opts.tp
        n = opts.cell_size
        assert world == K * n, f"world {world} != cells {K} x tp {T} x pp {P}"
        self.cell, self.shard = divmod(rank, n)
        """``shard``: this rank's place in its cell, ``stage·T + tp_rank`` (the same in every cell)."""
        self.stage, self.tp_rank = divmod(self.shard, T)
        self.is_core = self.cell == 0
        ps.initialize_model_parallel(
            tensor_model_parallel_size=T,
            pipeline_model_parallel_size=P,
            # expert parallelism on the tensor group (order "tp-cp-ep-pp-dp" with expert TP 1
            # makes the expert groups the tensor groups): a cell's experts stay inside its ranks
            expert_model_parallel_size=opts.ep,
            expert_tensor_parallel_size=1 if opts.ep > 1 else T,
            order="tp-cp-ep-pp-dp",
            distributed_timeout_minutes=opts.data_timeout_s / 60.0,
        )
        self.pp_group = ps.get_pipeline_model_parallel_group()
        assert sorted(dist.get_process_group_ranks(self.pp_group)) == [
            self.cell * n + s * T + self.tp_rank for s in range(P)]
        self.tp_group = ps.get_tensor_model_parallel_group()
        side_to = timedelta(seconds=opts.side_timeout_s)
        data_to = timedelta(seconds=opts.data_timeout_s)
        self.side_group = None
        for c in range(K):  # new_group is collective over the world: same order everywhere
            g = dist.new_group(list(range(c * n, c * n + n)), backend="gloo", timeout=side_to)
            if c == self.cell:
                self.side_group = g
        self.prefix: dict[int, Any] = {}
        for m in range(2, K + 1):
            for i in range(n):
                g = dist.new_group([c * n + i for c in range(m)], backend=data_backend(), timeout=data_to)
                if i == self.shard and self.cell < m:
                    self.prefix[m] = g
        self.store = dist.distributed_c10d._get_default_store()
        self.store.set_timeout(timedelta(seconds=opts.store_timeout_s))
        from gyre_megatron.megatron_settings import make_scheduler, split_settings

        settings = split_settings(opts.megatron)  # checked in the orchestrator's preflight already
        from gyre_megatron.model import resolve_transformer_impl

        self.transformer_impl = resolve_transformer_impl(opts.transformer_impl)
        """The layer spec this rank built: ``transformer_engine`` or ``local``."""
        self.ddp, self.config = build_stage(opts.spec, self.stage, P, T, opts.precision, opts.ep, settings,
                                            impl=self.transformer_impl)
        self.model = self.ddp
        if opts.init_from:
            self._load_hf(opts.init_from)
        self.reference: list[torch.Tensor] | None = None
        """A KL penalty's reference policy: this rank's parameters as the run started (the warm
        start), frozen; every training rank holds its own shard, since satellites train too."""
        if opts.objective.kl_coef > 0:
            self.hold_reference()
        # with tied embeddings and P > 1 the first stage's embedding and the last stage's output
        # layer are two copies of one matrix: their gradients are summed over this group
        self.embedding_group = ps.get_embedding_group() if opts.spec.tie_embeddings and P > 1 else None
        # get_megatron_optimizer gathers parameter keys over the whole world, so every rank builds
        # one; only the core keeps it (Adam allocates no state before its first step).
        opt = make_optimizer(self.ddp, opts.lr, opts.precision, settings)
        self.optimizer = opt if self.is_core else None
        self.scheduler = (make_scheduler(opt, opts.lr, opts.total_steps, settings)
                          if self.is_core else None)
        """megatron-core's learning-rate and weight-decay schedule over the run's steps (core only)."""
        self.p2p = compat.P2P(self.pp_group, self.config)
        self.leader = self.cell * n
        """Stage 0, tensor shard 0: claims the cell's micro-steps."""
        self.last = self.cell * n + (P - 1) * T
        """Last stage, tensor shard 0: reports the cell's token count and objective figures."""
        self.offloader = Offloader()
        self.version = 0 if self.is_core else -1
        """Policy version this cell's parameters hold (``step`` before an update, ``step+1`` after);
        a satellite starts unknown (-1), so its first join always pulls."""
        self._endpoint: Any = None
        self._engine: Any = None
        self._satellite_weights: Any = None
        self._publication_parts: Any = None
        self._parts: set[int] = set()
        """Versions whose part this rank published and still exposes (every shard keeps the set)."""
        self._saved: Any = None

    def _load_hf(self, path: str) -> None:
        from gyre_megatron.hf_import import hf_to_megatron, load_hf_state
        from gyre_megatron.tp_layout import expert_offset, shard_tp, split_tp

        opts = self.opts
        per_stage = opts.spec.num_layers // opts.pp
        named = dict(self.ddp.module.named_parameters())
        tensors = hf_to_megatron(load_hf_state(path), list(named), opts.spec, self.stage * per_stage,
                                 expert_offset(opts.spec.num_experts, opts.ep, self.tp_rank))
        with torch.no_grad():
            for name, full in tensors.items():
                p = named[name]
                t = shard_tp(name, full, split_tp(name, opts.tp, opts.ep), self.tp_rank)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def _sum_tensor_partial_grads(self) -> None:
        """Sum over the tensor group the gradients each tensor rank holds only a part of: the
        per-head q/k norm scales (each rank normalises its own heads) and, under sequence
        parallelism, every replicated parameter (norms, the router: each rank saw its share of
        the sequence). megatron-core's ``finalize_model_grads`` does this; Gyre's step, which
        reduces over cells itself, does it here (the core, after the cells' sum)."""
        if self.opts.tp == 1:
            return
        sp = bool(self.config.sequence_parallel)
        grads = [p.main_grad for n, p in self.ddp.module.named_parameters()
                 if (sp and getattr(p, "sequence_parallel", False)) or "q_layernorm" in n or "k_layernorm" in n]
        if grads:
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.tp_group)
            for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)

    def _sum_tied_embedding_grads(self) -> None:
        if self.embedding_group is None or not (self.stage == 0 or self.stage == self.opts.pp - 1):
            return
        module = self.ddp.module
        module = getattr(module, "module", module)  # bf16: inside the Float16Module
        weight = module.shared_embedding_or_output_weight()
        dist.all_reduce(weight.main_grad, group=self.embedding_group)

    # ------------------------------------------------------------------ helpers
    @property
    def params(self) -> list[torch.Tensor]:
        return [p.data for p in self.ddp.module.parameters()]

    @property
    def mooncake_endpoint(self) -> Any:
        """Where this rank's Mooncake engine listens: the address of its own node that the other
        ranks and the engines reach."""
        if self._endpoint is None:
            from gyre_core.transfer_endpoint import WILDCARDS, MooncakeEndpoint, advertised_host

            m = self.opts.mooncake
            # the address of this rank's node toward the orchestrator (a wildcard control host
            # names no peer: then toward the address this rank dialed, or the rendezvous host)
            peer = m.peer if m.peer not in WILDCARDS else None
            dialed = os.environ.get("GYRE_CONTROL", "").rpartition(":")[0]
            host = m.host or advertised_host(peer or dialed or os.environ.get("MASTER_ADDR"))
            self._endpoint = MooncakeEndpoint(host, m.protocol, m.device)
        return self._endpoint

    @property
    def mooncake_engine(self) -> Any:
        """This rank's one Mooncake engine, shared by its publication parts and its satellite
        exposure (created on first use: init takes milliseconds)."""
        if self._engine is None:
            from gyre_core.transfer_endpoint import start_transfer_engine

            self._engine = start_transfer_engine(self.mooncake_endpoint)
        return self._engine

    def _mooncake_parts(self) -> Any:
        from gyre_core.weight_parts import MooncakeParts

        return MooncakeParts(self.mooncake_endpoint, engine=lambda: self.mooncake_engine)

    @property
    def satellite_weights(self) -> Any:
        """The satellite pull, through the run's weight transport (``publication.transport``)."""
        if self._satellite_weights is None:
            from gyre_megatron.transfer import SatelliteWeights

            if self.opts.weights_transport == "disk":
                from gyre_core.weight_parts import DiskParts

                parts: Any = DiskParts(os.path.join(self.opts.weights_folder, "satellite"))
            else:
                parts = self._mooncake_parts()
            self._satellite_weights = SatelliteWeights(self.store, parts)
        return self._satellite_weights

    def _shape_of(self, item: Any) -> list[tuple[int, ...]]:
        """A pipeline message ``[sequence, rows, hidden]``: sequence-parallel stages pass their share."""
        seq = item["tokens"].shape[1] // (self.opts.tp if self.config.sequence_parallel else 1)
        return [(seq, item["tokens"].shape[0], self.config.hidden_size)]

    def _control(self, queue_idx: int | None, items: Sequence[Any] | None = None,
                 objective: Any = None) -> ControlChannel:
        claim = None
        objective = objective or self.opts.objective
        if self.rank == self.leader:
            if queue_idx is not None:
                from gyre_megatron.microsteps import as_item

                q = self.queues[queue_idx]
                multiple = self.opts.tp if self.config.sequence_parallel else 1
                claim = lambda t: as_item(q.claim(t), objective, multiple)  # noqa: E731
            else:
                it = iter(list(items or []))
                claim = lambda _t: next(it, None)  # noqa: E731
        return ControlChannel(self.side_group, self.leader, claim, self.opts.heartbeat_s)

    def _tokens_from_last(self, tokens: int) -> int:
        """The cell's token count, known on its last stage, on every stage (a tensor broadcast:
        nothing pickled crosses between ranks)."""
        box = torch.tensor([int(tokens) if self.rank == self.last else 0], dtype=torch.int64)
        dist.broadcast(box, src=self.last, group=self.side_group)
        return int(box[0])

    def _stream(self, control: ControlChannel) -> Any:
        reference = self._reference_weights if self.reference is not None else None
        return run_streaming_1f1b(self.model, self.config, self.p2p, control, gpt_forward_step, self._shape_of,
                                  reference)

    def hold_reference(self) -> None:
        """Keep a frozen copy of this rank's parameters as they are now (the reference policy)."""
        self.reference = [p.detach().clone() for p in self.params]

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """This stage's parameters are the reference's inside the block: each parameter's data
        is pointed at the reference's tensor (nothing is copied), and back on the way out."""
        assert self.reference is not None
        params = list(self.ddp.module.parameters())
        current = [p.data for p in params]
        for p, r in zip(params, self.reference, strict=True):
            p.data = r
        try:
            yield
        finally:
            for p, c in zip(params, current, strict=True):
                p.data = c

    def grad_buffers(self) -> list[torch.Tensor]:
        buffers = list(self.ddp.buffers) + list(getattr(self.ddp, "expert_parallel_buffers", []))
        return [b.grad_data for b in buffers]

    def zero_grads(self) -> None:
        self.ddp.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def _local_grad_square(self) -> float:
        """This rank's share of the squared gradient norm: a tensor replicated across the tensor
        group (norm scales) counts on shard 0 only, and the last stage's copy of tied embeddings
        (megatron-core marks it ``shared``; after the tied sum it holds the first stage's
        gradient) not at all, as in megatron-core's own norm: the shared matrix counts once."""
        params = [p for p in self.ddp.module.parameters() if not getattr(p, "shared", False)]
        if self.opts.tp == 1 and len(params) == len(list(self.ddp.module.parameters())):
            return sum(float(b.double().pow(2).sum()) for b in self.grad_buffers())
        # an expert megatron marks ``allreduce=False``: with expert parallelism each rank holds its own
        return sum(float(p.main_grad.double().pow(2).sum()) for p in params
                   if self.tp_rank == 0 or getattr(p, "tensor_model_parallel", False)
                   or (self.opts.ep > 1 and not getattr(p, "allreduce", True)))

    def grads_numpy(self) -> list[Any]:
        return [p.main_grad.detach().clone().cpu().numpy() for p in self.ddp.module.parameters()]

    def params_numpy(self) -> dict[str, Any]:
        # numpy has no bfloat16: bf16 parameters are read as float32 (exactly representable)
        return {n: p.detach().clone().cpu().float().numpy() for n, p in self.ddp.module.named_parameters()}

    def ping(self) -> dict[str, Any]:
        import socket

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return {"rank": self.rank, "cell": self.cell, "stage": self.stage, "tp_rank": self.tp_rank,
                "node": socket.gethostname(), "device": device,
                "mcore": compat.mcore_version(),
                "patch": None if self.patch is None else list(self.patch.notes), "pid": os.getpid()}

    # ------------------------------------------------------------------ §5 export
    def export_hf(self) -> dict[str, Any]:
        """This stage's parameters under HF names, its tensor shards merged (on shard 0;
        the other shards of the stage answer ``{}``)."""
        # offloaded (Colocate publishes after the pool left training): read the host copy
        return self._as_hf({n: self.offloader.host_view(p.data) for n, p in self.ddp.module.named_parameters()})

    def _as_hf(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """This stage's tensors ``state`` (Megatron names, this rank's shards) in the serving
        layout as float32 numpy arrays (tests and checks): see :meth:`_serving_tensors`."""
        # Clone before .numpy(): numpy on a view of a parameter marks the parameter's storage
        # non-resizable for good, and leave_training could no longer release it in place.
        return {k: v.detach().float().clone().cpu().numpy() for k, v in self._serving_tensors(state).items()}

    def _serving_tensors(self, state: dict[str, torch.Tensor], copy: bool = True) -> dict[str, torch.Tensor]:
        """This stage's tensors ``state`` (Megatron names, this rank's shards) in the serving
        layout, in their own dtype, on the host: gathered over the tensor group and merged,
        renamed on tensor shard 0 (the other shards answer ``{}``). ``copy=False``: host tensors
        may stay views of the parameters (for a caller that copies them at once)."""
        from gyre_megatron.export import megatron_to_hf
        from gyre_megatron.tp_layout import merge_shards

        if self.opts.tp > 1:  # every shard takes part in each gather, in the same (name) order
            full = {}
            for name, t in state.items():
                parts = [torch.empty_like(t) for _ in range(self.opts.tp)]
                dist.all_gather(parts, t.detach().contiguous(), group=self.tp_group)
                full.update(merge_shards(name, parts, self.opts.ep, self.opts.spec.num_experts))
            if self.tp_rank != 0:
                return {}
            state = full
        per_stage = self.opts.spec.num_layers // self.opts.pp
        hf = megatron_to_hf(state, self.opts.spec, self.stage * per_stage, dtype=None)
        return {k: v.detach().to("cpu", copy=copy).contiguous() for k, v in hf.items()}

    # ------------------------------------------------------------------ publication (§5)
    @property
    def publication_parts(self) -> Any:
        """This rank's part of each version published over Mooncake, put for the engines to pull
        (:mod:`gyre_core.weight_parts`); on the rank's own Mooncake engine."""
        if self._publication_parts is None:
            self._publication_parts = self._mooncake_parts()
        return self._publication_parts

    def _weights_now(self, copy: bool = True) -> dict[str, torch.Tensor]:
        # offloaded (Colocate publishes after the pool left training): read the host copy
        return self._serving_tensors({n: self.offloader.host_view(p.data) for n, p in self.ddp.module.named_parameters()},
                                     copy)

    def publish_part(self, version: int) -> str | None:
        """Core: register this stage's weights (serving layout, the parameters' dtype) as its part
        of policy ``version`` and answer the part's location (tensor shard 0; the other shards
        take part in the merge and answer None). The bytes never leave this process: engines
        pull them from here."""
        if not self.is_core:
            return None
        tensors = self._weights_now(copy=False)  # copied into the registered buffer right below
        self._parts.add(version)  # on every shard: write_part must take the same branch on all
        if not tensors:
            return None
        return str(self.publication_parts.put(version, tensors))

    def close_publication(self) -> None:
        """Unregister every part this rank still exposes and drop its Mooncake engine (exit)."""
        self._parts.clear()
        if self._satellite_weights is not None:
            self._satellite_weights.release()
        if self._publication_parts is not None:
            self._publication_parts.close()
            self._publication_parts = None

    def release_parts_older_than(self, version: int) -> None:
        self._parts = {v for v in self._parts if v >= version}
        if self._publication_parts is not None:
            self._publication_parts.release_older_than(version)

    def write_part(self, version: int, folder: str) -> dict[str, Any]:
        """Core: write this stage's part of policy ``version`` as its weight file in ``folder``
        (:func:`gyre_megatron.export.shard_file`) and answer ``{"file", "tensors"}`` (tensor shard
        0; the others answer ``{}``): the bytes published as ``version`` while this rank still
        exposes them, else its parameters now (``version`` itself when nothing was published since)."""
        if not self.is_core:
            return {}
        from safetensors.torch import save_file

        from gyre_megatron.export import shard_file

        if version in self._parts:
            parts = self._publication_parts
            tensors = parts.publisher.tensors(version) if parts is not None else {}
        else:
            tensors = self._weights_now()
        if not tensors:
            return {}
        name = shard_file(self.stage, self.opts.pp)
        path = os.path.join(folder, name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return {"file": name, "tensors": sorted(tensors)}

    def _legacy_checkpoint_file(self, path: str) -> str:
        return f"{path}.stage{self.stage}" + (f".tp{self.tp_rank}" if self.opts.tp > 1 else "")

    # ------------------------------------------------------------------ durability
    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Core only: the core's parameters, optimizer state and policy version as the folder
        ``path``, a megatron-core distributed checkpoint (:mod:`gyre_megatron.checkpointing`)
        that loads at any TP/PP/EP. Satellites hold no authoritative state (they pull) and take
        no part."""
        if not self.is_core:
            return {}
        from gyre_megatron.checkpointing import save_training_state, sharded_training_state

        with self._host_state():
            state, _ = sharded_training_state(self.ddp, self.optimizer, self.version)
            save_training_state(state, path, self.side_group)
        return {"path": path, "version": self.version}

    @contextlib.contextmanager
    def _host_state(self) -> Iterator[None]:
        """While this rank's state is offloaded (a colocated core after its burst): parameters,
        master weights, Adam's state and buffers read from their host copies, and pointed back at
        their released storages afterwards, so nothing comes back to the device to be saved."""
        if not self.offloader.offloaded:
            yield
            return
        view, undo = self.offloader.host_view, []
        params = list(self.ddp.module.parameters())
        params += [p for opt in self._torch_optimizers() for g in opt.param_groups for p in g["params"]]
        seen: set[int] = set()
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                undo.append((p, "data", p.data))
                p.data = view(p.data)
        holders: list[dict[str, Any]] = [m._buffers for m in self.ddp.module.modules()]
        holders += [st for opt in self._torch_optimizers() for st in opt.state.values()]
        for d in holders:
            for k, v in list(d.items()):
                if isinstance(v, torch.Tensor):
                    undo.append((d, k, v))
                    d[k] = view(v)
        try:
            yield
        finally:
            for holder, key, original in reversed(undo):
                if isinstance(holder, dict):
                    holder[key] = original
                else:
                    setattr(holder, key, original)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Core only: restore what :meth:`save_checkpoint` wrote (after a restart), at this
        world's layout whatever layout wrote it. A checkpoint of an earlier Gyre (one
        ``torch.save`` file per rank beside ``path``) loads at its own layout only."""
        if not self.is_core:
            return {}
        if self.offloader.offloaded:
            raise RuntimeError("load_checkpoint: this rank's state is offloaded (load before it leaves training)")
        if not os.path.isdir(path):
            return self._load_legacy_checkpoint(path)
        from gyre_megatron.checkpointing import load_training_state, restore_optimizer, sharded_training_state

        # optimizer.sharded_state_dict(is_loading=True) allocates Adam's state to load into
        state, parts = sharded_training_state(self.ddp, self.optimizer, self.version, is_loading=True)
        loaded = load_training_state(state, path, self.side_group)
        self.ddp.module.load_state_dict(loaded["model"])
        if self.optimizer is not None:
            restore_optimizer(self.optimizer, parts, loaded)
        self.version = int(loaded["gyre"]["version"])
        self.zero_grads()
        return {"version": self.version}

    def _load_legacy_checkpoint(self, path: str) -> dict[str, Any]:
        # Clone what torch.load made: its storages are not resizable, so leave_training could no
        # longer release them in place (the optimizer keeps the loaded state tensors as they are).
        # weights_only: a checkpoint path comes from the journal, and loading must not run code
        state = _owned(torch.load(self._legacy_checkpoint_file(path), weights_only=True))
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"], strict=True):
                p.copy_(saved)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.zero_grads()
        return {"version": self.version}

    # ------------------------------------------------------------------ §4 enter / leave
    def _state_tensors(self) -> list[torch.Tensor]:
        ts = list(self.params) + self.grad_buffers() + [b for b in self.ddp.module.buffers()]
        ts += list(self.reference or [])
        for opt in self._torch_optimizers():
            for st in opt.state.values():
                ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
            # bf16: the float32 master weights (fp32: the parameters themselves, already counted)
            ts += [p for g in opt.param_groups for p in g["params"]]
        return ts

    def _torch_optimizers(self) -> list[Any]:
        """The torch optimizers under the core's megatron-core optimizer: one, or with a mixture
        of experts one per chained optimizer (dense and expert parameters); none on satellites."""
        from gyre_megatron.checkpointing import sub_optimizers

        return [o.optimizer for o in sub_optimizers(self.optimizer)] if self.optimizer is not None else []

    def leave_training(self) -> dict[str, Any]:
        if self._satellite_weights is not None:
            self._satellite_weights.release()  # storages move on restore: re-register next step
        released = self.offloader.offload(self._state_tensors())
        remaining = sum(t.untyped_storage().nbytes() for t in self._state_tensors())
        return {"released_bytes": released, "remaining_bytes": remaining}

    def enter_training(self) -> dict[str, Any]:
        return {"restored_bytes": self.offloader.restore()}

    # ------------------------------------------------------------------ §3 the step
    def _key(self, step: int, what: str) -> str:
        return f"gyre/step{step}/{what}"

    def run_step(self, step: int, queue_idx: int, final: bool = False, die_after: int | None = None) -> dict[str, Any]:
        """Take part in training step ``step`` (core: StartStep; satellite: JoinStep).

        Returns this rank's statistics; raises :class:`StepFailed` (after re-queue bookkeeping
        on the core) when a participant fails.
        """
        info: dict[str, Any] = {"rank": self.rank, "cell": self.cell, "stage": self.stage}
        if self.is_core:
            self.satellite_weights.expose(self._key(step, f"w{self.shard}"), step, self.params)
            self.version = step
        else:
            decision = None
            if self.rank == self.leader:
                got = self.store.compare_set(self._key(step, f"join{self.cell}"), "", "joined")
                decision = got.decode() if isinstance(got, bytes) else str(got)
            decision = ControlChannel(self.side_group, self.leader, None).broadcast(decision)
            if decision != "joined":
                info["joined"] = False
                return info
            info["joined"] = True
            if self.version != step:
                t0 = time.monotonic()
                nbytes, _ = self.satellite_weights.pull(self._key(step, f"w{self.shard}"), self.params)
                info["pull_bytes"], info["pull_s"] = nbytes, time.monotonic() - t0
                info["pull_from"] = self.satellite_weights.last_peer
                self.version = step
        control = self._control(queue_idx)
        if self.rank == self.leader:  # claim ledger: survives this process, read on failure
            ledger = self._key(step, f"claimed{self.cell}")
            self.store.set(ledger, "")
            control.on_claim = lambda i: self.store.append(ledger, f"{i},")
        if die_after is not None and self.rank == self.leader:  # fault injection (tests)
            inner = control.claim
            count = [0]

            def claim(t: float) -> Any:  # dies after ``die_after`` items, or at the end of the stream
                if count[0] >= die_after:
                    os._exit(17)
                item = inner(t)  # type: ignore[misc]
                if item is None:
                    os._exit(17)
                count[0] += 1
                return item

            control.claim = claim
        res = self._stream(control)
        info.update(micro_steps=res.micro_steps, pauses=res.pauses, claimed=control.claimed)
        if self.rank == self.last:
            info["objective"] = objective_figures(res.losses, res)
        # token count of this cell, from its last stage to every stage
        tokens = self._tokens_from_last(res.tokens)
        # the join window closes on the core once its stream has drained
        if self.is_core and self.rank == self.leader:
            m = 1
            for c in range(1, self.opts.cells):
                got = self.store.compare_set(self._key(step, f"join{c}"), "", "closed")
                if (got.decode() if isinstance(got, bytes) else str(got)) == "joined" and m == c:
                    m += 1
            self.store.set(self._key(step, "m"), str(m))
        m = int(self.store.get(self._key(step, "m")))
        if self.cell >= m:
            raise StepFailed(f"cell {self.cell} joined step {step} outside the prefix of {m} cells")
        info["m"] = m
        total = torch.tensor([float(tokens)], dtype=torch.float64)
        if m > 1:
            own = [b.clone() for b in self.grad_buffers()]  # a failed all-reduce may leave partial sums
            t0 = time.monotonic()
            try:
                g = self.prefix[m]
                for buf in self.grad_buffers():
                    dist.all_reduce(buf, group=g)
                dist.all_reduce(total, group=g)
            except Exception as e:  # a participant died or hung: apply nothing
                for buf, o in zip(self.grad_buffers(), own):
                    buf.copy_(o)
                info.update(failed=True, error=f"{type(e).__name__}: {e}"[:300], detect_s=time.monotonic() - t0)
                return self._recover(step, m, tokens, info)
            del own
        return self._finish(step, float(total), final, m, info)

    def _recover(self, step: int, m: int, tokens: int, info: dict[str, Any]) -> dict[str, Any]:
        """After a failed gradient all-reduce: find the surviving prefix, keep its gradients.

        Every live participant reports itself in the store; the core's leader waits (at most the
        data-group timeout plus a margin: a survivor not adjacent to the dead rank only fails
        when its own wait times out) and fixes ``m'``, the longest prefix of cells whose ranks
        all reported. Cells below ``m'`` keep their gradients for :meth:`resume_step`; the
        micro-steps claimed by cells ``m'..m−1`` are re-queued.
        """
        self.store.set(self._key(step, f"alive{self.rank}"), "1")
        key = self._key(step, "survivors")
        if self.is_core and self.rank == self.leader:
            n = self.opts.cell_size
            deadline = time.monotonic() + self.opts.data_timeout_s + 2.0
            alive = {0}
            while time.monotonic() < deadline and len(alive) < m:
                for c in range(1, m):
                    keys = [self._key(step, f"alive{c * n + i}") for i in range(n)]
                    if c not in alive and self.store.check(keys):
                        alive.add(c)
                time.sleep(0.05)
            survivors = 1
            while survivors in alive:
                survivors += 1
            self.store.set(key, str(survivors))
        survivors = int(self.store.get(key))
        info["survivors"] = survivors
        if self.is_core:
            info["requeue"] = {c: self._claims(step, c) for c in range(survivors, m)}
        if self.cell < survivors:
            self._pending = {"step": step, "tokens": tokens, "m": survivors}
        else:
            self.zero_grads()
        return info

    def _claims(self, step: int, cell: int) -> list[int]:
        """What cell ``cell`` claimed in ``step``, from its ledger. A cell that died after it
        registered but before it wrote its ledger (while pulling the core's weights) claimed
        nothing: its claims are made only through the ledger."""
        key = self._key(step, f"claimed{cell}")
        if not self.store.check([key]):
            return []
        raw = self.store.get(key)
        return [int(x) for x in (raw.decode() if isinstance(raw, bytes) else str(raw)).split(",") if x]

    def resume_step(self, step: int, queue_idx: int, final: bool = False) -> dict[str, Any]:
        """Finish a step that failed, on the surviving prefix: stream the re-queued micro-steps
        (queue ``queue_idx``) on top of the kept gradients, reduce over the survivors' prefix
        group, update on the core. Called on the core and on every surviving satellite."""
        pending = getattr(self, "_pending", None)
        if pending is None or pending["step"] != step:
            raise StepFailed(f"no failed step {step} to resume on rank {self.rank}")
        m = int(pending["m"])
        control = self._control(queue_idx)
        res = self._stream(control)
        tokens = self._tokens_from_last(res.tokens)
        self._pending = None
        total = torch.tensor([float(pending["tokens"] + tokens)], dtype=torch.float64)
        if m > 1:
            for buf in self.grad_buffers():
                dist.all_reduce(buf, group=self.prefix[m])
            dist.all_reduce(total, group=self.prefix[m])
        info = {"rank": self.rank, "cell": self.cell, "micro_steps": res.micro_steps,
                "claimed": control.claimed, "m": m}
        if self.rank == self.last:
            info["objective"] = objective_figures(res.losses, res)
        return self._finish(step, float(total), final, m, info)

    def _finish(self, step: int, total: float, final: bool, m: int, info: dict[str, Any]) -> dict[str, Any]:
        """Normalise, clip and update on the core; then send the new weights to satellites."""
        info["total_tokens"] = total
        if self.is_core:
            self._sum_tensor_partial_grads()
            self._sum_tied_embedding_grads()
            if self.opts.normalise_by_tokens:  # not for objectives whose W_t already normalise
                for buf in self.grad_buffers():
                    buf.div_(max(total, 1.0))
            if self.opts.keep_update_grads:
                self.update_grads = self.grads_hf()
            local = self._local_grad_square()
            sq = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(sq, group=self.side_group)
            norm = float(sq.sqrt())
            if self.opts.clip_grad > 0 and norm > self.opts.clip_grad:
                for buf in self.grad_buffers():
                    buf.mul_(self.opts.clip_grad / (norm + 1e-6))
            if self._satellite_weights is not None:
                self._satellite_weights.release()  # the snapshot window is over
            if self.scheduler is not None:
                from gyre_megatron.megatron_settings import apply_schedule

                info["lr"] = apply_schedule(self.scheduler, step)
            if total > 0:
                ok, _, _ = self.optimizer.step()
            else:  # every group of the step came up empty: Adam's momentum alone must not move it
                ok = True
                info["skipped_update"] = "no trainable tokens"
            info["grad_norm"], info["update_ok"] = norm, bool(ok)
        self.zero_grads()
        if not final and m > 1:
            try:
                for p in self.params:
                    dist.broadcast(p, src=self.shard, group=self.prefix[m])  # the core's same shard
                self.version = step + 1
            except Exception as e:  # a satellite died after the update: the core's step stands
                info["broadcast_failed"] = f"{type(e).__name__}: {e}"[:300]
                self.version = step + 1 if self.is_core else -1  # a satellite pulls at its next join
        else:  # a satellite leaving after the burst's last step keeps stale weights
            self.version = step + 1 if self.is_core else -1
        return info


def _owned(obj: Any) -> Any:
    """``obj`` with every tensor inside replaced by a clone that owns an ordinary storage."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_owned(v) for v in obj)
    return obj


def data_backend() -> str:
    """The backend of the default and data groups: gloo on CPU; with CUDA gloo for CPU tensors and
    NCCL for device tensors (one group serves both)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def rank_device(rank: int) -> torch.device:
    """The device this rank trains on, made current: ``cuda:LOCAL_RANK`` (a launcher's local
    rank; ranks spawned on one machine take GPUs in rank order, so a cell's ranks hold adjacent
    GPUs), or the CPU where CUDA is absent."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def log_to(path: str) -> None:
    """Point this process's stdout and stderr (the descriptors, so native code too) at ``path``."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def worker_main(
    rank: int, world: int, port: int, opts: RankOptions, queues: Sequence[Any], cmd_q: Any, res_q: Any
) -> None:
    """Entry point of a rank the orchestrator spawned on its own machine."""
    from gyre_core.procutil import die_with_parent

    die_with_parent()  # an orchestrator killed outright must not leave ranks behind
    if opts.log_dir:  # before megatron-core is imported: its notices go to the log, not the console
        log_to(os.path.join(opts.log_dir, f"rank{rank}.log"))
    serve_rank(rank, world, f"tcp://127.0.0.1:{port}", opts, queues, cmd_q, res_q)


def start_rank(rank: int, world: int, init_method: str, opts: RankOptions, queues: Sequence[Any]) -> CellRank:
    """Join the process group at ``init_method`` and build this rank (every launcher's first step)."""
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's "no TransformerEngine/Apex" notices, once per rank
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    device = rank_device(rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    # with CUDA, tensors on the GPU go over NCCL (gradients, pipeline, tensor-parallel
    # collectives) and CPU tensors over gloo (control messages, token counts) in every group
    dist.init_process_group(data_backend(), init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=opts.store_timeout_s))
    return CellRank(rank, world, opts, queues)


def answer(cr: CellRank, message: tuple[Any, ...]) -> tuple[int, int, bool, Any]:
    """Run one command ``(seq, method, args, kwargs)`` on ``cr``: ``(rank, seq, ok, payload)``,
    the payload an error's text when it raised."""
    seq, name, args, kwargs = message
    try:
        return (cr.rank, seq, True, getattr(cr, name)(*args, **kwargs))
    except BaseException as e:
        return (cr.rank, seq, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def stop_rank() -> None:
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def serve_rank(rank: int, world: int, init_method: str, opts: RankOptions, queues: Sequence[Any], cmd_q: Any,
               res_q: Any) -> None:
    """Init the process group, build the rank, serve commands from ``cmd_q`` until ``exit``.

    Answers go to ``res_q`` as ``(rank, seq, ok, payload)``: a local queue, or a rank's control
    connection (:class:`gyre_megatron.control.ControlClient`), which sends them by value."""
    try:
        cr = start_rank(rank, world, init_method, opts, queues)
        res_q.put((rank, -1, True, cr.ping()))
    except BaseException:
        res_q.put((rank, -1, False, traceback.format_exc()))
        return
    while True:
        message = cmd_q.get()
        if message[1] == "exit":
            break
        res_q.put(answer(cr, message))
    cr.close_publication()
    stop_rank()
