"""Qwen2 and Qwen2.5 dense: biases on q/k/v (and nowhere else), head size ``hidden / heads``."""

from __future__ import annotations

from typing import Any, Mapping

from gyre_megatron.families import DenseFamily


def _problems(raw: Mapping[str, Any]) -> list[str]:
    return ["use_sliding_window true (supported: full attention)"] if raw.get("use_sliding_window") else []


FAMILY = DenseFamily(
    model_type="qwen2", architecture="Qwen2ForCausalLM", config_class="Qwen2Config",
    qkv_bias=True, problems=_problems,
    config_fields=lambda spec: {"use_sliding_window": False},
)
