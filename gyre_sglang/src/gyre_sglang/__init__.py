"""Gyre's SGLang backend.

Provides the serving side of a Gyre cell: the client the orchestrator uses to stop intake, abort
and hand requests off for rerouting, release and resume engine memory, and load newly published
weights, plus KV-cache pin-and-hand-off over Mooncake and an SGLang server plugin. It attaches to
``gyre-core`` through the ``gyre`` entry-point group (:mod:`gyre_sglang.plugin`); SGLang itself is
imported lazily, only when a cell is created.
"""

__version__ = "0.1.0"
