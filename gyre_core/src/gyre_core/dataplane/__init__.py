"""The data plane: from a terminated execution to a gradient.

``assessment`` turns evaluator answers into rewards and scheduler events; ``trajectory_buffer``
holds scored executions by group until N valid rewards make the group ready; ``materialise``
turns a ready group's selected trajectories into weighted token rows; ``packing`` packs them into
micro-steps of a token budget per data-parallel rank, pushed to the ``microstep_queue`` that
training cells claim from; ``objective`` is the execution-level GSPO loss. Pure Python and torch.
"""

from gyre_core.dataplane.assessment import AssessmentLedger, EvalState, RewardRange
from gyre_core.dataplane.materialise import TrainingRow, execution_weights, materialise_group
from gyre_core.dataplane.microstep_queue import MicroStepQueue, QueueClosed
from gyre_core.dataplane.objective import (
    GSPOConfig,
    TokenBatch,
    group_advantages,
    gspo_loss,
    log_ratio_sums,
    target_logprobs,
)
from gyre_core.dataplane.packing import MicroStep, Pack, PackingConfig, StreamPackingBuffer
from gyre_core.dataplane.trajectory_buffer import (
    GroupNotReady,
    ReadyGroup,
    ScoredExecution,
    TrajectoryBuffer,
)

__all__ = [
    "AssessmentLedger",
    "EvalState",
    "GSPOConfig",
    "GroupNotReady",
    "MicroStep",
    "MicroStepQueue",
    "Pack",
    "PackingConfig",
    "QueueClosed",
    "ReadyGroup",
    "RewardRange",
    "ScoredExecution",
    "StreamPackingBuffer",
    "TokenBatch",
    "TrainingRow",
    "TrajectoryBuffer",
    "execution_weights",
    "group_advantages",
    "gspo_loss",
    "log_ratio_sums",
    "materialise_group",
    "target_logprobs",
]
