"""The dense decoder families Gyre imports from and exports to Hugging Face checkpoints.

One module per family says what its checkpoints hold beyond the shared layout (RMSNorm,
SwiGLU MLP, grouped-query attention, plain RoPE): whether attention projections carry biases,
whether queries and keys are normalised per head, whether ``config.json`` names a head size of
its own, and which settings the family has that Gyre does not model (refused by name). The
tensor mapping itself is shared (:mod:`gyre_megatron.hf_import`, :mod:`gyre_megatron.export`):
the families differ in which tensors exist, not in how the shared ones are laid out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["FAMILIES", "DenseFamily", "family_named"]


@dataclass(frozen=True)
class DenseFamily:
    model_type: str
    """``model_type`` in ``config.json``."""
    architecture: str
    """``architectures[0]`` in ``config.json`` (the transformers class that loads it)."""
    config_class: str
    """The transformers configuration class (tests build reference models with it)."""
    qkv_bias: bool
    """The q/k/v projections carry biases (and no other linear layer does)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (``self_attn.q_norm``/``k_norm``)."""
    own_head_dim: bool = False
    """``config.json`` names ``head_dim``, which may differ from ``hidden_size / heads``."""
    problems: Callable[[Mapping[str, Any]], list[str]] = field(default=lambda raw: [])
    """What the family's config asks for that the mapping cannot represent."""
    config_fields: Callable[[Any], dict[str, Any]] = field(default=lambda spec: {})
    """The family's own ``config.json`` keys for a :class:`~gyre_megatron.model.ModelSpec`."""


def _families() -> dict[str, DenseFamily]:
    from gyre_megatron.families import llama, qwen2, qwen3

    return {f.model_type: f for f in (qwen2.FAMILY, qwen3.FAMILY, llama.FAMILY)}


FAMILIES: dict[str, DenseFamily] = {}
"""``model_type`` → family, filled on first use."""


def family_named(model_type: str) -> DenseFamily | None:
    if not FAMILIES:
        FAMILIES.update(_families())
    return FAMILIES.get(model_type)
