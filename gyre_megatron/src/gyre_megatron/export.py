"""Weight export: megatron-core's GPT layout to the serving layout (the Hugging Face names of the
model's family: Qwen2, Qwen3 or Llama, :mod:`gyre_megatron.families`).

Rollout engines (SGLang) load Hugging Face checkpoints, so the core publishes its weights under
HF names, with Megatron's fused tensors split the way the HF modules expect:

* ``linear_qkv`` is laid out per query group ``[q_0..q_{r-1}, k, v]`` (``r`` = heads per group):
  it is regrouped into ``q_proj``, ``k_proj``, ``v_proj`` (weights and biases);
* ``linear_fc1`` is ``[gate; up]`` (SwiGLU): split into ``gate_proj`` and ``up_proj``;
* ``q_layernorm``/``k_layernorm`` (Qwen3) become ``q_norm``/``k_norm``;
* a mixture-of-experts layer's ``mlp.router`` becomes ``mlp.gate``, and expert ``e``'s
  ``linear_fc1``/``linear_fc2`` (named by its global index once the expert-parallel ranks are
  gathered, :func:`gyre_megatron.tp_layout.merge_shards`) ``mlp.experts.<e>.gate_proj``/``up_proj``/``down_proj``;
* layer ``i`` of pipeline stage ``s`` is global layer ``s·L/P + i``.

Tensor-parallel shards are merged first (:func:`gyre_megatron.tp_layout.merge_tp`, on the ranks:
see ``CellRank._serving_tensors``), and everything stays on the ranks: :func:`publish` has each
pipeline stage of the core register its part for engines to pull over Mooncake, or :func:`write`
its own weight file (with an index when there are several) for SGLang's
``/update_weights_from_disk``; the orchestrator only composes the location or writes the index.
The two are :class:`WeightTransport` s, chosen by name in :data:`TRANSPORTS`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch

from gyre_core.interfaces import PublicationOptions, WeightsRef
from gyre_megatron.model import megatron_name
from gyre_megatron.tp_layout import merge_tp

__all__ = ["TRANSPORTS", "DiskTransport", "MooncakeTransport", "WeightTransport", "hf_config", "load_hf_model",
           "megatron_to_hf", "merge_tp", "publish", "release_older_than", "serving_dtype", "shard_file", "write"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def _split_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    r = heads // groups
    g = t.reshape(groups, (r + 2) * head_dim, *t.shape[1:])
    q = g[:, : r * head_dim].reshape(heads * head_dim, *t.shape[1:])
    k = g[:, r * head_dim : (r + 1) * head_dim].reshape(groups * head_dim, *t.shape[1:])
    v = g[:, (r + 1) * head_dim :].reshape(groups * head_dim, *t.shape[1:])
    return q, k, v


def megatron_to_hf(state: Mapping[str, torch.Tensor], spec: Any, layer_offset: int,
                   dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """Rename and split one pipeline stage's (TP-merged) parameters to HF names, cast to
    ``dtype`` (None: each keeps its own, as a publication does)."""
    hd = spec.kv_channels
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = megatron_name(name)
        t = (t.detach() if dtype is None else t.detach().to(dtype)).contiguous()
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name == "output_layer.weight":
            if not getattr(spec, "tie_embeddings", False):  # tied: the last stage's copy of embed_tokens
                out["lm_head.weight"] = t
        elif (m := _LAYER.match(name)) is not None:
            i, rest = layer_offset + int(m.group(1)), m.group(2)
            p = f"model.layers.{i}."
            if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
                out[p + "input_layernorm.weight"] = t
            elif rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
                out[p + "post_attention_layernorm.weight"] = t
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = _split_qkv(t, spec.num_attention_heads, spec.num_query_groups, hd)
                for proj, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[p + f"self_attn.{proj}.{kind}"] = x.contiguous()
            elif rest == "self_attention.linear_proj.weight":
                out[p + "self_attn.o_proj.weight"] = t
            elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                out[p + f"self_attn.{rest.split('.')[1][0]}_norm.weight"] = t
            elif rest == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2, dim=0)
                out[p + "mlp.gate_proj.weight"] = gate.contiguous()
                out[p + "mlp.up_proj.weight"] = up.contiguous()
            elif rest == "mlp.linear_fc2.weight":
                out[p + "mlp.down_proj.weight"] = t
            elif rest == "mlp.router.weight":
                out[p + "mlp.gate.weight"] = t
            elif (e := _EXPERT.match(rest)) is not None:
                x = f"{p}mlp.experts.{e.group(1)}."
                if e.group(2) == "1":
                    gate, up = t.chunk(2, dim=0)
                    out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate.contiguous(), up.contiguous()
                else:
                    out[x + "down_proj.weight"] = t
            else:
                raise KeyError(f"no serving-layout name for Megatron parameter {name}")
        else:
            raise KeyError(f"no serving-layout name for Megatron parameter {name}")
    return out


def hf_config(spec: Any, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of the equivalent HF model of ``spec``'s family, its weights in ``dtype``."""
    from gyre_megatron.families import family_named

    family = family_named(spec.family)
    if family is None:
        raise ValueError(f"no HF family {spec.family!r} to export as")
    return {
        "architectures": [family.architecture], "model_type": family.model_type,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_query_groups,
        "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": dtype, "attention_dropout": 0.0,
        **_rope_scaling(spec), **family.config_fields(spec),
    }


def _rope_scaling(spec: Any) -> dict[str, Any]:
    """``rope_scaling`` as the checkpoint had it: YaRN's or Llama 3.x's (nothing for plain RoPE)."""
    from gyre_megatron.model import LLAMA3_ROPE_FIXED

    if getattr(spec, "rope_yarn_factor", 0.0):
        return {"rope_scaling": {"rope_type": "yarn", "factor": spec.rope_yarn_factor,
                                 "original_max_position_embeddings": spec.rope_yarn_original_positions,
                                 "beta_fast": spec.rope_yarn_beta_fast, "beta_slow": spec.rope_yarn_beta_slow,
                                 "attention_factor": spec.rope_yarn_attention_factor,
                                 "truncate": spec.rope_yarn_truncate}}
    factor = float(getattr(spec, "rope_llama3_factor", 0.0))
    if factor <= 0:
        return {}
    return {"rope_scaling": {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE_FIXED}}


def gather_serving_tensors(world: Any) -> dict[str, torch.Tensor]:
    """The core's weights in the serving (HF) layout, in float32, gathered from each of its
    pipeline stages into this process (tests and checks; publications never do this)."""
    parts = world.call(world.ranks_of(0), "export_hf")
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for part in parts for k, v in part.items()}


def serving_dtype(precision: str) -> str:
    """The dtype weights are published in: the parameters' own (bf16 training serves bf16)."""
    return "bfloat16" if precision == "bf16" else "float32"


def shard_file(stage: int, stages: int) -> str:
    """HF's names for a checkpoint's weight files: one file, or one per pipeline stage."""
    return "model.safetensors" if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def write(world: Any, version: int, folder: str | Path) -> Any:
    """Policy ``version`` as an HF checkpoint in ``folder``: each pipeline stage of the core writes
    its own weight file (tensor shards merged on the stage's first rank), in the parameters'
    dtype; this process writes only the index (several stages) and ``config.json``. No process
    holds more than one stage's weights. Returns the folder's :class:`WeightsRef`."""

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    opts = world.opts
    written = [w for w in world.call(world.ranks_of(0), "write_part", version, str(out)) if w]
    if opts.pp > 1:
        weight_map = {n: w["file"] for w in written for n in w["tensors"]}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config(opts.spec, serving_dtype(opts.precision)), indent=1))
    return WeightsRef(version=version, location=str(out))


class WeightTransport(Protocol):
    """How a published policy version reaches the engines (``publication.transport``): the one
    place a transport is chosen; the engine side tells them apart by the location's form
    (``gyre_sglang.serving_side.load_any``)."""

    def publish(self, world: Any, version: int) -> WeightsRef: ...

    def release_older_than(self, world: Any, version: int) -> None:
        """Every engine holds ``version`` or newer: what older versions hold may go."""


@dataclass(frozen=True)
class MooncakeTransport:
    """Each stage of the core registers its own part (one buffer, manifest, CRC32) for the engines
    to pull (:mod:`gyre_core.published_weights`); the location lists the parts
    (:func:`gyre_core.published_weights.compose`). Nothing is gathered or written."""

    def publish(self, world: Any, version: int) -> WeightsRef:
        from gyre_core.published_weights import compose

        parts = [p for p in world.call(world.ranks_of(0), "publish_part", version) if p]
        return WeightsRef(version=version, location=compose(version, parts))

    def release_older_than(self, world: Any, version: int) -> None:
        world.call(world.ranks_of(0), "release_parts_older_than", version)


@dataclass(frozen=True)
class DiskTransport:
    """Each stage of the core writes its own file into ``<folder>/v<version>`` (:func:`write`),
    for SGLang's ``/update_weights_from_disk``; the folders stay (a shared file system holds them)."""

    folder: str

    def publish(self, world: Any, version: int) -> WeightsRef:
        return write(world, version, Path(self.folder) / f"v{version}")

    def release_older_than(self, world: Any, version: int) -> None:
        return None  # nothing is exposed: a folder is read by whoever loads it, whenever


TRANSPORTS: dict[str, Callable[[PublicationOptions], WeightTransport]] = {
    "mooncake": lambda publication: MooncakeTransport(),
    "disk": lambda publication: DiskTransport(publication.folder),
}
"""``publication.transport`` → its transport (the run configuration admits exactly these names)."""


def publish(world: Any, publication: PublicationOptions, version: int) -> WeightsRef:
    """Publish policy ``version`` where the engines load it, by the run's transport."""
    return TRANSPORTS[publication.transport](publication).publish(world, version)


def release_older_than(world: Any, version: int) -> None:
    """Stop exposing the parts of versions before ``version`` (every engine holds a newer one).
    Only Mooncake exposes anything; with disk the ranks hold no part and this is a no-op."""
    MooncakeTransport().release_older_than(world, version)


def load_hf_model(path: str) -> torch.nn.Module:
    """Load a published checkpoint into its family's ``transformers`` model (eager attention,
    fp32), refusing any missing or unexpected tensor. Through ``from_pretrained``, so that
    transformers' own conversions apply (5.x fuses each layer's experts on load). Used by tests
    to check the export."""
    import transformers

    from gyre_megatron.families import family_named

    raw = json.loads((Path(path) / "config.json").read_text())
    family = family_named(str(raw.get("model_type")))
    if family is None:
        raise KeyError(f"{path}: no supported family {raw.get('model_type')!r}")
    # eager experts too: the grouped GEMM transformers picks by default has no float64 kernel
    extra = {"experts_implementation": "eager"} if family.experts else {}
    model, info = getattr(transformers, family.architecture).from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True, **extra)
    missing, unexpected = list(info.get("missing_keys", [])), list(info.get("unexpected_keys", []))
    if unexpected or any("rotary" not in k for k in missing) or info.get("mismatched_keys"):
        raise KeyError(f"checkpoint does not fit {family.architecture}: missing {missing}, unexpected {unexpected}, "
                       f"mismatched {info.get('mismatched_keys')}")
    return model.float().eval()
