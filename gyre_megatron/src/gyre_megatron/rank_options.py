"""What every rank of a run is started with: the layout, the model, the optimizer and timeouts.

Its own module, below :mod:`gyre_megatron.runtime` (which builds a rank from it) and
:mod:`gyre_megatron.wire` (which carries it to torchrun-started ranks), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from gyre_core.interfaces import MooncakeOptions, ObjectiveConfig
from gyre_megatron.model import ModelSpec

__all__ = ["RankOptions"]


@dataclass(frozen=True)
class RankOptions:
    cells: int
    pp: int
    spec: ModelSpec = ModelSpec()
    lr: float = 1e-3
    clip_grad: float = 1.0
    megatron: Mapping[str, Any] = field(default_factory=dict)
    """``[training.megatron]`` (:mod:`gyre_megatron.megatron_settings`): megatron-core settings by
    their own names, applied to every stage's configs, the core's optimizer and its schedule."""
    total_steps: int = 0
    """The run's steps: what a learning-rate schedule decays over by default."""
    data_timeout_s: float = 60.0
    """Timeout of the data groups (pipeline P2P, prefix collectives)."""
    side_timeout_s: float = 60.0
    """Timeout of the side groups; heartbeats keep a paused pipeline well inside it."""
    heartbeat_s: float = 0.5
    store_timeout_s: float = 60.0
    normalise_by_tokens: bool = True
    """Divide the summed gradient by the batch's loss-bearing tokens (plain per-token losses);
    off for the data plane's weights ``W_t``, which already normalise per execution."""
    init_from: str = ""
    """An HF checkpoint directory (a family of :mod:`gyre_megatron.families`) whose weights every
    cell starts from (empty: ``spec``'s seeded random init). ``spec`` must be
    :func:`gyre_megatron.hf_import.spec_from_hf_dir`'s."""
    objective: ObjectiveConfig = ObjectiveConfig()
    """The objective of data-plane micro-steps and its settings (``training.objective``,
    ``clip_low``, ``clip_high``, ...), built once from the run configuration and handed as is to
    every loss."""
    mooncake: MooncakeOptions = MooncakeOptions()
    """Each rank's Mooncake endpoint for satellite joins (an empty ``host``: every rank advertises
    its own node's address, see :func:`gyre_core.transfer_endpoint.advertised_host`)."""
    weights_transport: str = "mooncake"
    """How a joining satellite pulls the core's parameters (:mod:`gyre_core.weight_parts`): the
    run's ``publication.transport``, ``mooncake`` or ``disk``."""
    weights_folder: str = ""
    """``disk``: the run's weight folder (``publication.folder``, seen by every node); the core
    puts its parameters under its ``satellite/`` for the step's joins."""
    log_dir: str = ""
    """A folder for ``rank<N>.log``: a rank the orchestrator spawns writes its stdout and stderr
    there (upstream notices, native logs), as each engine does to ``engine<N>.log``. Empty: the
    rank keeps its parent's console."""
    tp: int = 1
    """Tensor-parallel width of every stage (megatron-core's column/row-parallel layers)."""
    ep: int = 1
    """Expert-parallel width of a mixture-of-experts model, folded onto the tensor group: 1
    (each expert split like the dense MLP) or ``tp`` (each tensor rank holds whole experts)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16`` parameters with a float32 optimizer (see :data:`gyre_megatron.model.PRECISIONS`)."""
    transformer_impl: str = "auto"
    """Which layer spec builds the stages (:func:`gyre_megatron.model.resolve_transformer_impl`)."""
    keep_update_grads: bool = False
    """Tests: the core keeps each update's gradient (reduced over cells, before clipping and the
    optimizer) for :meth:`~gyre_megatron.checks.RankChecks.update_grads_hf`."""

    @property
    def cell_size(self) -> int:
        """Ranks per cell: ``tp × pp``."""
        return self.tp * self.pp
