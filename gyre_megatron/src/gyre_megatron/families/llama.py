"""Llama dense (Llama 2/3 and the many models in its layout): no biases, a head size of its own
(``head_dim``). ``attention_bias`` (which biases ``o_proj`` as well as q/k/v), ``mlp_bias`` and
Llama 3.1's scaled RoPE are refused."""

from __future__ import annotations

from gyre_megatron.families.base import DecoderFamily

FAMILY = DecoderFamily(
    model_type="llama", architecture="LlamaForCausalLM", config_class="LlamaConfig", qkv_bias=False,
    own_head_dim=True,
    refused={"attention_bias": "attention without biases", "mlp_bias": "an MLP without biases"},
    config_fields=lambda spec: {"head_dim": spec.kv_channels, "attention_bias": False, "mlp_bias": False},
)
