"""The dense decoder families Gyre imports from and exports to Hugging Face checkpoints.

One module per family says what its checkpoints hold beyond the shared layout (RMSNorm,
SwiGLU MLP, grouped-query attention, plain RoPE): whether attention projections carry biases,
whether queries and keys are normalised per head, whether ``config.json`` names a head size of
its own, and which settings the family has that Gyre does not model (refused by name). The
tensor mapping itself is shared (:mod:`gyre_megatron.hf_import`, :mod:`gyre_megatron.export`):
the families differ in which tensors exist, not in how the shared ones are laid out.
"""

from __future__ import annotations

from gyre_megatron.families import llama, qwen2, qwen3
from gyre_megatron.families.base import DenseFamily

__all__ = ["FAMILIES", "DenseFamily", "family_named"]

FAMILIES: dict[str, DenseFamily] = {f.model_type: f for f in (qwen2.FAMILY, qwen3.FAMILY, llama.FAMILY)}
"""``model_type`` → family."""


def family_named(model_type: str) -> DenseFamily | None:
    return FAMILIES.get(model_type)
