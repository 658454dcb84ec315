"""Qwen2 and Qwen2.5 dense: biases on q/k/v (and nowhere else), head size ``hidden / heads``."""

from __future__ import annotations

from gyre_megatron.families.base import DecoderFamily

FAMILY = DecoderFamily(
    model_type="qwen2", architecture="Qwen2ForCausalLM", config_class="Qwen2Config", qkv_bias=True,
    refused={"use_sliding_window": "full attention"},
    config_fields=lambda spec: {"use_sliding_window": False},
)
