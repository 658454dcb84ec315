"""The ``gyre`` entry point of ``gyre-megatron``.

Implements ``gyre_make_training_side``: a :class:`gyre_core.interfaces.TrainingSide` backed by
megatron-core ranks (:mod:`gyre_megatron.side`). torch and megatron-core are imported inside the
hook bodies only: this module is imported whenever ``gyre-orchestrate`` starts, including for
simulations on machines without Megatron.
"""

from __future__ import annotations

from typing import Any, Mapping

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import TrainingOptions

from gyre_megatron import __version__


@hookimpl
def gyre_plugin_info() -> dict[str, Any]:
    return {"name": "gyre-megatron", "version": __version__, "seams": ["training"]}


@hookimpl
def gyre_make_training_side(cell: int, options: TrainingOptions) -> Any:
    """Cell ``cell``'s side over megatron-core ranks (the first call of a run starts them all);
    ``None`` when megatron-core is not installed."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return None
    from gyre_megatron.side import MegatronTrainingSide

    return MegatronTrainingSide(cell, options)


@hookimpl
def gyre_shutdown() -> None:
    """Stop the rank worlds the training sides share (nothing to do when none was started)."""
    import sys

    side = sys.modules.get("gyre_megatron.side")  # never imported: no world was started
    if side is not None:
        side.shutdown_worlds()


@hookimpl
def gyre_preflight(config: Mapping[str, Any]) -> list[str]:
    """What the training side of ``config`` would fail to load: megatron-core, and Mooncake's
    transfer engine wherever a satellite can join (it pulls the core's weights over it), and
    whether ``[training.megatron]`` is settings megatron-core takes."""
    from gyre_megatron.preflight import training_side_problems

    training = config.get("training", {})
    return training_side_problems(cells=int(config.get("scheduler", {}).get("cells", 1)),
                                  model_dir=str(config.get("model", {}).get("dir") or ""),
                                  launcher=str(config.get("cluster", {}).get("launcher") or "local"),
                                  megatron=training.get("megatron") or {},
                                  transformer_impl=str(training.get("transformer_impl") or "auto"),
                                  layout={**{k: training[k] for k in ("tp", "pp", "ep", "precision", "lr")
                                             if k in training},
                                          "steps": config.get("run", {}).get("steps", 1),
                                          "model": config.get("model", {})})
