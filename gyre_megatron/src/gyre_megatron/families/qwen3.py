"""Qwen3 dense: per-head RMSNorm of queries and keys (``q_norm``, ``k_norm``) before RoPE, a head
size of its own (``head_dim``, e.g. 128 at hidden 1024 with 16 heads), no biases
(``attention_bias``, which would bias ``o_proj`` too, is refused). Megatron's ``qk_layernorm``
and ``kv_channels`` are the same thing."""

from __future__ import annotations

from gyre_megatron.families.base import DecoderFamily

FAMILY = DecoderFamily(
    model_type="qwen3", architecture="Qwen3ForCausalLM", config_class="Qwen3Config", qkv_bias=False,
    qk_norm=True, own_head_dim=True,
    refused={"use_sliding_window": "full attention", "attention_bias": "attention without biases"},
    config_fields=lambda spec: {"head_dim": spec.kv_channels, "attention_bias": False, "use_sliding_window": False},
)
