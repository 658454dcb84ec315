"""What one decoder family's HF checkpoints hold beyond the shared layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["DecoderFamily"]


@dataclass(frozen=True)
class DecoderFamily:
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
    experts: bool = False
    """Every MLP is a mixture of SwiGLU experts: a router (HF ``mlp.gate``, Megatron's
    ``mlp.router``) picks ``num_experts_per_tok`` of ``mlp.experts.<e>`` per token."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """``config.json`` switches the mapping cannot represent when set → what is supported instead."""
    config_fields: Callable[[Any], dict[str, Any]] = field(default=lambda spec: {})
    """The family's own ``config.json`` keys for a :class:`~gyre_megatron.model.ModelSpec`."""

    def problems(self, raw: Mapping[str, Any]) -> list[str]:
        """What ``raw`` (a ``config.json``) asks of this family that the mapping cannot represent."""
        return [f"{key} {raw[key]!r} (supported: {instead})" for key, instead in self.refused.items() if raw.get(key)]
