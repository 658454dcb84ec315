"""Gyre core: the backend-independent half of Gyre.

Gyre trains long-horizon LLM agents with RL on a cluster whose GPUs are split into K *cells*, each
of which switches at fine grain between serving rollouts and training. This package holds
everything that does not need a GPU stack: the run configuration, the scheduler (one state
machine with an injected clock) and the simulator that drives it, the token-in/token-out proxy,
trajectory trees, selection, rewards, buffers and packing, the objective, harness adapters, the
pluggy hook specifications (:mod:`gyre_core.hookspecs`) through which the Megatron and SGLang
plugins attach, and the ``gyre-orchestrate`` command. It never imports Megatron or SGLang itself;
installed plugins are found through the ``gyre`` entry-point group (:mod:`gyre_core.plugins`).
"""

__version__ = "0.1.0"
