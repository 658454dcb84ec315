"""Gyre's Megatron backend.

Provides the training side of a Gyre cell on top of megatron-core: a pausable streaming 1F1B
schedule, prefix-group collectives so satellites can join a running batch, gradient aggregation
and the optimizer on the core cell only, and weight export from the Megatron layout to the serving
layout. It attaches to ``gyre-core`` through the ``gyre`` entry-point group
(:mod:`gyre_megatron.plugin`); megatron-core is imported lazily, only when a cell is created.
"""

__version__ = "0.1.0"
