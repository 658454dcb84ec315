"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, a head size of its own, no biases) with every
MLP a mixture of SwiGLU experts. The router's softmax over all experts picks
``num_experts_per_tok``; with ``norm_topk_prob`` their weights are renormalised to sum to one
(Megatron: top-k of the logits, then softmax over the k), without it they are not (Megatron's
``moe_router_pre_softmax``). Dense layers among sparse ones (``mlp_only_layers``,
``decoder_sparse_step`` > 1) and shared experts are not modelled and are refused."""

from __future__ import annotations

from gyre_megatron.families.base import DecoderFamily

FAMILY = DecoderFamily(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", config_class="Qwen3MoeConfig", qkv_bias=False,
    qk_norm=True, own_head_dim=True, experts=True,
    refused={"use_sliding_window": "full attention", "attention_bias": "attention without biases",
             "mlp_only_layers": "every layer a mixture of experts"},
    config_fields=lambda spec: {
        "head_dim": spec.kv_channels, "attention_bias": False, "use_sliding_window": False,
        "num_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
        "moe_intermediate_size": spec.expert_ffn_hidden_size, "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        "router_aux_loss_coef": 0.0},
)
