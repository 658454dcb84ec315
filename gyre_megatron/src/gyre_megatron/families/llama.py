"""Llama dense (Llama 2/3 and the many models in its layout): no biases, a head size of its own
(``head_dim``). ``attention_bias`` (which biases ``o_proj`` as well as q/k/v), ``mlp_bias`` and
Llama 3.1's scaled RoPE are refused."""

from __future__ import annotations

from typing import Any, Mapping

from gyre_megatron.families import DenseFamily


def _problems(raw: Mapping[str, Any]) -> list[str]:
    out = []
    if raw.get("attention_bias"):
        out.append("attention_bias true (supported: attention without biases)")
    if raw.get("mlp_bias"):
        out.append("mlp_bias true (supported: an MLP without biases)")
    if int(raw.get("pretraining_tp") or 1) != 1:
        out.append(f"pretraining_tp {raw.get('pretraining_tp')} (supported: 1)")
    return out


FAMILY = DenseFamily(
    model_type="llama", architecture="LlamaForCausalLM", config_class="LlamaConfig",
    qkv_bias=False, own_head_dim=True, problems=_problems,
    config_fields=lambda spec: {"head_dim": spec.kv_channels, "attention_bias": False, "mlp_bias": False},
)
