"""Weight import: a Hugging Face dense decoder checkpoint as the cell's megatron-core model.

The inverse of :mod:`gyre_megatron.export`, for every family of :mod:`gyre_megatron.families`
(Qwen2, Qwen3, Llama): every size is read from the checkpoint's ``config.json`` (layers,
hidden, heads, KV heads, head size, FFN size, rope theta, RMSNorm eps, vocabulary, tied or
untied embeddings, q/k/v biases, q/k norms), and each stage takes its layers' tensors, fused the
way Megatron's modules expect:

* ``q_proj``, ``k_proj``, ``v_proj`` (weights, and biases where the family has them) →
  ``linear_qkv`` laid out per query group ``[q_0..q_{r-1}, k, v]``;
* ``gate_proj`` and ``up_proj`` → ``linear_fc1`` as ``[gate; up]``;
* ``q_norm``/``k_norm`` (Qwen3) → ``q_layernorm``/``k_layernorm``;
* mixture-of-experts layers (Qwen3-MoE): ``mlp.gate`` → ``mlp.router``, and expert ``e``'s
  ``gate_proj``/``up_proj``/``down_proj`` → ``mlp.experts.local_experts.<e − first>``'s
  ``linear_fc1``/``linear_fc2`` on the rank whose first expert is ``first`` (expert parallelism);
* global layer ``s·L/P + i`` → layer ``i`` of pipeline stage ``s``; with tied embeddings the last
  stage's output layer starts as a copy of ``embed_tokens`` (megatron-core keeps the two in step).

What the import cannot represent is refused before a run starts (:func:`spec_from_hf_config`
raises :class:`UnsupportedModel` naming every unsupported setting), never silently approximated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from gyre_megatron.families import FAMILIES, family_named
from gyre_megatron.model import megatron_name

__all__ = ["UnsupportedModel", "hf_to_megatron", "load_hf_state", "spec_from_hf_config", "spec_from_hf_dir"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


class UnsupportedModel(ValueError):
    """The checkpoint uses something the import does not support; ``problems`` lists it."""

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{where}: unsupported model: " + "; ".join(problems))


def spec_from_hf_config(raw: Mapping[str, Any], where: str = "config.json", seed: int = 1234) -> Any:
    """The :class:`~gyre_megatron.model.ModelSpec` of an HF ``config.json`` (as a dict) of a
    supported family."""
    from gyre_megatron.model import ModelSpec

    problems: list[str] = []
    arch = list(raw.get("architectures") or [])
    family = family_named(str(raw.get("model_type")))
    if family is None or (arch and arch != [family.architecture]):
        supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())
        problems.append(f"model_type {raw.get('model_type')!r} / architectures {arch} (supported: {supported})")
    else:
        problems += family.problems(raw)
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw.get('hidden_act')!r} (supported: silu)")
    # transformers >= 5 writes RoPE settings as ``rope_parameters``; older releases as rope_theta/rope_scaling
    rope = {**dict(raw.get("rope_parameters") or {}), **dict(raw.get("rope_scaling") or {})}
    rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    yarn = _yarn_fields(rope, raw, problems) if rope.get("rope_type", rope.get("type")) == "yarn" else {}
    rope_llama3_factor = 0.0 if yarn else _llama3_factor(rope, problems)
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if not isinstance(raw.get(k), int)]
    if missing:
        problems.append(f"missing or non-integer {', '.join(missing)}")
    head_dim = 0
    if not problems and family is not None:
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        kv = int(raw.get("num_key_value_heads") or heads)
        if family.own_head_dim and raw.get("head_dim") is not None:
            head_dim = int(raw["head_dim"])
        elif hidden % heads:
            problems.append(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        elif raw.get("head_dim") not in (None, hidden // heads):
            problems.append(f"head_dim {raw.get('head_dim')} differs from hidden_size / num_attention_heads")
        if heads % kv:
            problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    experts = _expert_fields(raw, problems) if family is not None and family.experts else {}
    if problems or family is None:
        raise UnsupportedModel(where, problems)
    return ModelSpec(
        num_layers=int(raw["num_hidden_layers"]), hidden_size=int(raw["hidden_size"]),
        ffn_hidden_size=int(raw["intermediate_size"]), num_attention_heads=int(raw["num_attention_heads"]),
        num_query_groups=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        vocab_size=int(raw["vocab_size"]), max_seq_len=int(raw.get("max_position_embeddings", 2048)),
        rope_theta=rope_theta, norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), seed=seed,
        family=family.model_type, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
        head_dim=head_dim if head_dim != int(raw["hidden_size"]) // int(raw["num_attention_heads"]) else 0,
        rope_llama3_factor=rope_llama3_factor, **yarn, **experts,
    )


def _yarn_fields(rope: Mapping[str, Any], raw: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """A ``config.json``'s YaRN settings as :class:`ModelSpec` fields (HF's defaults where it is
    silent); megatron-core builds YaRN for standard attention from 0.15 on."""
    import math

    from gyre_megatron.preflight import _located_megatron_core_version, megatron_core_below

    if megatron_core_below((0, 15)):
        problems.append(f"rope_scaling of type 'yarn' needs megatron-core >= 0.15 for standard attention "
                        f"(installed: {_located_megatron_core_version()})")
        return {}
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        problems.append(f"rope_scaling yarn with factor {factor!r} (expected a number >= 1)")
        return {}
    if rope.get("mscale") is not None or rope.get("mscale_all_dim") is not None:
        problems.append("rope_scaling yarn with mscale / mscale_all_dim (supported: attention_factor or its default)")
        return {}
    original = rope.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    attention = rope.get("attention_factor")
    return {"rope_yarn_factor": float(factor), "rope_yarn_original_positions": int(original),
            "rope_yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
            "rope_yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
            "rope_yarn_attention_factor": float(attention) if attention is not None
            else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0),
            "rope_yarn_truncate": bool(rope.get("truncate", True))}


def _llama3_factor(rope: Mapping[str, Any], problems: list[str]) -> float:
    """The Llama 3 RoPE-scaling factor of a ``config.json``'s RoPE settings (0: plain RoPE); what
    megatron-core's RoPE cannot represent goes to ``problems``."""
    from gyre_megatron.model import LLAMA3_ROPE_FIXED

    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return 0.0
    if kind != "llama3":
        problems.append(f"rope_scaling of type {kind!r} (supported: plain RoPE, llama3 and yarn)")
        return 0.0
    odd = {k: rope.get(k) for k, v in LLAMA3_ROPE_FIXED.items()
           if not isinstance(rope.get(k), (int, float)) or float(rope[k]) != v}
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        problems.append(f"rope_scaling llama3 with factor {factor!r} (expected a positive number)")
        return 0.0
    if odd:
        problems.append(f"rope_scaling llama3 with {odd} (megatron-core's scaling fixes {LLAMA3_ROPE_FIXED})")
        return 0.0
    return float(factor)


def _expert_fields(raw: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """A mixture-of-experts ``config.json``'s expert settings as :class:`ModelSpec` fields; what
    the mapping cannot represent goes to ``problems``. transformers 5 writes the expert count as
    ``num_local_experts``, earlier releases (and published checkpoints) as ``num_experts``."""
    n = raw.get("num_experts", raw.get("num_local_experts"))
    k, width = raw.get("num_experts_per_tok"), raw.get("moe_intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (n, k, width)):
        problems.append(f"num_experts {n}, num_experts_per_tok {k}, moe_intermediate_size {width}: "
                        "expected positive integers")
        return {}
    if int(k) > int(n):
        problems.append(f"num_experts_per_tok {k} exceeds num_experts {n}")
    if raw.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step {raw.get('decoder_sparse_step')} (supported: 1, every layer sparse)")
    if raw.get("shared_expert_intermediate_size"):
        problems.append("shared experts (supported: routed experts only)")
    return {"num_experts": int(n), "experts_per_token": int(k), "expert_ffn_hidden_size": int(width),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False))}


def spec_from_hf_dir(path: str | Path, seed: int = 1234) -> Any:
    p = Path(path) / "config.json"
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(str(p), [f"not readable ({exc})"]) from None
    return spec_from_hf_config(raw, str(p), seed)


def load_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (one file or an index of shards)."""
    from safetensors.torch import load_file

    d = Path(path)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files (convert .bin checkpoints to safetensors first)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    r = heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, r * head_dim, *rest), k.reshape(groups, head_dim, *rest),
             v.reshape(groups, head_dim, *rest))
    return torch.cat(parts, dim=1).reshape(groups * (r + 2) * head_dim, *rest)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], names: list[str], spec: Any, layer_offset: int,
                   expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of one stage's Megatron parameters ``names`` from an HF state dict; local
    expert ``j`` is the checkpoint's expert ``expert_offset + j``."""
    hd = spec.kv_channels

    def get(key: str) -> torch.Tensor:
        if key not in hf:
            raise KeyError(f"checkpoint has no tensor {key}")
        return hf[key]

    out: dict[str, torch.Tensor] = {}
    for full in names:
        name = megatron_name(full)
        if name == "embedding.word_embeddings.weight":
            t = get("model.embed_tokens.weight")
        elif name == "decoder.final_layernorm.weight":
            t = get("model.norm.weight")
        elif name == "output_layer.weight":
            t = hf["lm_head.weight"] if "lm_head.weight" in hf and not spec.tie_embeddings else get("model.embed_tokens.weight")
        elif (m := _LAYER.match(name)) is not None:
            p = f"model.layers.{layer_offset + int(m.group(1))}."
            rest = m.group(2)
            if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
                t = get(p + "input_layernorm.weight")
            elif rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
                t = get(p + "post_attention_layernorm.weight")
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = (get(p + f"self_attn.{x}.{kind}") for x in ("q_proj", "k_proj", "v_proj"))
                t = _fuse_qkv(q, k, v, spec.num_attention_heads, spec.num_query_groups, hd)
            elif rest == "self_attention.linear_proj.weight":
                t = get(p + "self_attn.o_proj.weight")
            elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                t = get(p + f"self_attn.{rest.split('.')[1][0]}_norm.weight")
            elif rest == "mlp.linear_fc1.weight":
                t = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            elif rest == "mlp.linear_fc2.weight":
                t = get(p + "mlp.down_proj.weight")
            elif rest == "mlp.router.weight":
                t = get(p + "mlp.gate.weight")
            elif (e := _EXPERT.match(rest)) is not None:
                x = f"{p}mlp.experts.{expert_offset + int(e.group(1))}."
                t = (torch.cat([get(x + "gate_proj.weight"), get(x + "up_proj.weight")]) if e.group(2) == "1"
                     else get(x + "down_proj.weight"))
            else:
                raise KeyError(f"no HF {spec.family} tensor for Megatron parameter {full}")
        else:
            raise KeyError(f"no HF {spec.family} tensor for Megatron parameter {full}")
        out[full] = t
    return out
