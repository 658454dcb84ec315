"""The user's model: an HF checkpoint of a supported family initialises the Megatron cells.

Checkpoints built locally with non-default shapes (nothing is downloaded), random biases and norm
scales so every layout is exercised:

* Qwen2: a GQA model with untied embeddings and one with tied embeddings (as the small Qwen2
  releases have), at PP = 1 and PP = 2;
* Qwen3 (per-head q/k norms, a head size of 16 where hidden / heads is 8) and Llama (no biases, a
  head size of 12), each at TP 1, TP 2 and TP 2 × PP 2;
* Qwen3-MoE (Qwen3's attention, 6 experts of which the router picks 2, renormalised) at TP 1,
  TP 2 × EP 2 and TP 2 × PP 2 × EP 2 (each tensor rank holding 3 whole experts).

For each: at start Megatron's outputs equal HF transformers' on the same checkpoint (fp32,
≤ 1e-4: logits where the cell is one stage, every token's loss everywhere), and the export of the
imported weights gives back the original tensors exactly (the import is the export's inverse).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")

from gyre_megatron.hf_import import UnsupportedModel, spec_from_hf_config, spec_from_hf_dir  # noqa: E402
from gyre_core.interfaces import PublicationOptions  # noqa: E402

LAYOUTS = [("qwen2", False, 1, 1, 1), ("qwen2", False, 1, 2, 1), ("qwen2", True, 1, 1, 1), ("qwen2", True, 1, 2, 1),
           ("qwen3", False, 1, 1, 1), ("qwen3", False, 2, 1, 1), ("qwen3", False, 2, 2, 1),
           ("llama", False, 1, 1, 1), ("llama", False, 2, 1, 1), ("llama", False, 2, 2, 1),
           ("llama3", False, 1, 1, 1), ("llama3", False, 2, 2, 1), ("qwen3_yarn", False, 1, 1, 1),
           ("qwen3_yarn", False, 2, 2, 1),
           ("qwen3_moe", False, 1, 1, 1), ("qwen3_moe", False, 2, 1, 2), ("qwen3_moe", False, 2, 2, 2)]
"""(family, tied, tp, pp, ep); ``llama3``: Llama with Llama 3.1's RoPE scaling; ``qwen3_yarn``:
Qwen3 with YaRN (a factor of 4 over a 32-token original window, so every position is changed)"""


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{f}-{'tied' if t else 'untied'}-tp{tp}-pp{pp}" + (f"-ep{ep}" if ep > 1 else "")
                                                     for f, t, tp, pp, ep in LAYOUTS])
def imported(request, tmp_path_factory):
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.preflight import megatron_core_below
    from gyre_megatron.testing import LLAMA3_ROPE, YARN_ROPE, build_checkpoint

    family, tied, tp, pp, ep = request.param
    scaled, yarn = family == "llama3", family == "qwen3_yarn"
    if yarn and megatron_core_below((0, 15)):
        pytest.skip("YaRN for standard attention needs megatron-core >= 0.15")
    family = "llama" if scaled else "qwen3" if yarn else family
    ckpt = tmp_path_factory.mktemp("ckpt")
    original = build_checkpoint(ckpt, tied, seed=11 + int(tied), family=family,
                                rope_scaling=LLAMA3_ROPE if scaled else YARN_ROPE if yarn else None)
    spec = spec_from_hf_dir(ckpt)
    assert spec.rope_llama3_factor == (8.0 if scaled else 0.0) and spec.rope_yarn_factor == (4.0 if yarn else 0.0)
    assert (spec.family, spec.num_query_groups, spec.ffn_hidden_size, spec.tie_embeddings) == (family, 2, 80, tied)
    assert (spec.rope_theta, spec.norm_eps, spec.vocab_size) == (50000.0, 1e-5, 160)
    assert (spec.qkv_bias, spec.qk_norm, spec.kv_channels) == {
        "qwen2": (True, False, 8), "qwen3": (False, True, 16), "llama": (False, False, 12),
        "qwen3_moe": (False, True, 16)}[family]
    assert (spec.num_experts, spec.experts_per_token, spec.expert_ffn_hidden_size, spec.norm_topk_prob) == (
        (6, 2, 24, True) if family == "qwen3_moe" else (0, 0, 0, False))
    with World(RankOptions(cells=1, tp=tp, pp=pp, ep=ep, spec=spec, init_from=str(ckpt)), n_queues=2) as w:
        yield w, ckpt, original, tmp_path_factory.mktemp("export")


def _hf_model(ckpt: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").float().eval()


def test_megatron_starts_with_the_checkpoints_outputs(imported) -> None:
    from gyre_megatron.testing import feed_in_bursts, make_items

    w, ckpt, _, _ = imported
    hf = _hf_model(ckpt)
    items = make_items(3, seq_len=24, vocab=160, seed=2)
    if w.opts.pp == 1:  # the vocabulary is split over the tensor shards: their logits side by side
        shards = w.call(w.ranks_of(0), "logits", items[0]["tokens"])
        mlogits = np.concatenate(shards, axis=-1)
        with torch.no_grad():
            hlogits = hf(items[0]["tokens"]).logits.numpy()
        err = float(np.abs(hlogits - mlogits).max())
        print(f"\nimport {w.opts.spec.family} tp{w.opts.tp} ep{w.opts.ep} pp1 tied={w.opts.spec.tie_embeddings}: "
              f"logits max|HF - Megatron| {err:.3g}, max|logit| {float(np.abs(hlogits).max()):.3g}")
        assert err <= 1e-4 and float(np.abs(mlogits).max()) > 0.1
    tk = w.submit(w.ranks_of(0), "stock_vs_stream", items, 0)
    feed_in_bursts(w.queues[0], items, burst=3, gap_s=0)
    losses = next(r for r in w.wait(tk, 120) if r.get("stock_losses"))["stock_losses"]
    assert len(losses) == len(items)
    for it, mloss in zip(items, losses):
        with torch.no_grad():
            ce = torch.nn.functional.cross_entropy(hf(it["tokens"]).logits[0], it["labels"][0], reduction="none")
        hloss = float((ce * it["loss_mask"][0]).sum())
        assert abs(hloss - mloss) <= 1e-4 * max(1.0, abs(mloss)), (hloss, mloss)


def test_llama3_rope_scaling_matches_transformers_far_into_the_row(imported) -> None:
    """Llama 3.x RoPE scaling changes the slowest frequencies, which matter only far into a row:
    at 1,536 tokens the imported model's logits equal transformers' (scaled), while an unscaled
    RoPE would be off by far more than the tolerance."""
    w, ckpt, _, _ = imported
    if not w.opts.spec.rope_llama3_factor or w.opts.pp > 1:
        pytest.skip("Llama 3 RoPE scaling, one stage")
    tokens = torch.randint(0, 160, (1, 1536), generator=torch.Generator().manual_seed(4))
    mlogits = np.concatenate(w.call(w.ranks_of(0), "logits", tokens), axis=-1)
    raw = json.loads((ckpt / "config.json").read_text())
    with torch.no_grad():
        hlogits = _hf_model(ckpt)(tokens).logits.numpy()
        plain = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**{**{k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_parameters")},
                                                 "rope_theta": 50000.0}), attn_implementation="eager")
        plain.load_state_dict(_hf_model(ckpt).state_dict())
        unscaled = plain.float().eval()(tokens).logits.numpy()
    err, off = float(np.abs(hlogits - mlogits).max()), float(np.abs(hlogits - unscaled).max())
    print(f"\nllama3 RoPE at 1,536 tokens: max|HF - Megatron| {err:.3g}; unscaled RoPE would be off by {off:.3g}")
    assert err <= 1e-4 and off > 100 * max(err, 1e-6)


def test_export_of_the_import_gives_back_the_checkpoint(imported) -> None:
    from gyre_megatron.export import load_hf_model, publish
    from gyre_megatron.testing import read_weights

    w, ckpt, original, out = imported
    ref = publish(w, PublicationOptions(folder=str(out)), version=0)
    exported = read_weights(ref.location)  # each stage wrote its own file
    expected = {k: v for k, v in original.items() if not (w.opts.spec.tie_embeddings and k == "lm_head.weight")}
    assert set(exported) == set(expected)
    for k, v in expected.items():
        assert torch.equal(exported[k], v), k
    cfg = json.loads((Path(ref.location) / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == w.opts.spec.tie_embeddings and cfg["num_key_value_heads"] == 2
    assert cfg["model_type"] == w.opts.spec.family
    assert spec_from_hf_dir(ref.location) == w.opts.spec  # the export's config reads back as the same model
    files = sorted(p.name for p in Path(ref.location).glob("*.safetensors"))
    assert len(files) == w.opts.pp and (w.opts.pp == 1) == (files == ["model.safetensors"])
    load_hf_model(ref.location)  # and loads strictly into the family's transformers class (index and all)


def test_transformer_engines_names_import_and_export_like_the_local_ones(imported) -> None:
    """TransformerEngine's layer spec keeps each layer's norms inside the linear layers they are
    fused into (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``). The names are
    megatron-core's own: its local spec lists them as its norms' TE equivalents
    (``sharded_state_dict_keys_map``). Imported under TE's names, every tensor equals the local
    one; exported from TE's names, the checkpoint comes back exactly."""
    import re

    from gyre_megatron.export import megatron_to_hf
    from gyre_megatron.hf_import import hf_to_megatron, load_hf_state
    from gyre_megatron.model import layer_spec_for

    w, ckpt, original, _ = imported
    if w.opts.tp * w.opts.pp * w.opts.ep > 1:
        pytest.skip("one layout per family: the names do not depend on it")
    spec = w.opts.spec
    keys_map = layer_spec_for(spec, "local").submodules.sharded_state_dict_keys_map
    assert keys_map, "megatron-core no longer lists the TE names of its local norms"

    def te_name(name: str) -> str:
        m = re.match(r"^(decoder\.layers\.\d+\.)(.+)$", name)
        if m is not None:
            for local_prefix, te_prefix in keys_map.items():
                if m.group(2).startswith(local_prefix):
                    return m.group(1) + te_prefix + m.group(2)[len(local_prefix):]
        return name

    local = w.call([0], "settings_in_effect", [])[0]["parameter_names"]
    te = [te_name(n) for n in local]
    assert sum("linear_qkv.layer_norm_weight" in n for n in te) == spec.num_layers
    assert sum("linear_fc1.layer_norm_weight" in n for n in te) == spec.num_layers
    hf = load_hf_state(ckpt)
    by_local, by_te = hf_to_megatron(hf, local, spec, 0), hf_to_megatron(hf, te, spec, 0)
    assert all(torch.equal(by_local[a], by_te[b]) for a, b in zip(local, te))
    back = megatron_to_hf(by_te, spec, 0)
    expected = {k: v for k, v in original.items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_a_mooncake_publication_is_pulled_from_every_stage(imported) -> None:
    """Each stage of the core registers its own part in its own process; the location lists the
    parts, and a puller (the code SGLang's loader runs) reads every part, verified, and gets the
    whole model back exactly. Released versions are gone."""
    from gyre_core.published_weights import PublicationError, WeightPuller, parse_parts
    from gyre_megatron.export import publish, release_older_than

    w, _, original, _ = imported
    if w.opts.spec.tie_embeddings or w.opts.spec.family == "llama":
        pytest.skip("one publication check per layout family is enough")
    ref = publish(w, PublicationOptions(transport="mooncake"), version=5)
    parts = parse_parts(ref.location)
    assert len(parts) == w.opts.pp and len({p.session for p in parts}) == w.opts.pp  # one per stage process
    puller = WeightPuller("127.0.0.1")
    try:
        pulled = puller.pull(ref.location)
        got = {name: t.clone() for name, t in pulled.tensors()}
        assert pulled.version == 5 and not pulled.partial and set(got) == set(original)
        assert all(torch.equal(got[k], v) for k, v in original.items())
        release_older_than(w, 6)
        with pytest.raises(PublicationError):
            puller.pull(ref.location)
    finally:
        puller.close()


def test_tied_copies_stay_in_step_through_an_update(imported) -> None:
    """With tied embeddings and PP = 2 the first stage's embedding and the last stage's output
    layer are two copies of one matrix: their gradients are summed, so one update keeps them equal."""
    from gyre_megatron.testing import feed_in_bursts, make_items

    w, _, original, _ = imported
    if not (w.opts.spec.tie_embeddings and w.opts.pp == 2):
        pytest.skip("only tied embeddings split over two stages have two copies")
    core = w.ranks_of(0)
    tk = w.submit(core, "run_step", 0, 1)
    feed_in_bursts(w.queues[1], make_items(2, seq_len=24, vocab=160, seed=9), burst=2, gap_s=0)
    info = w.wait(tk, 120)
    assert all(i["update_ok"] for i in info)
    first, last = w.call(core, "params_numpy")
    emb, out = first["embedding.word_embeddings.weight"], last["output_layer.weight"]
    assert np.array_equal(emb, out)
    assert not np.array_equal(emb, original["model.embed_tokens.weight"].numpy())  # it did train


_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16}


@pytest.mark.parametrize("change, named", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma'"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures ['LlamaForCausalLM']"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling llama3 with {'low_freq_factor': None"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 4096}}, "'original_max_position_embeddings': 4096"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "model_type 'qwen2_moe'"),
    ({**_MOE, "mlp_only_layers": [1]}, "mlp_only_layers"),
    ({**_MOE, "decoder_sparse_step": 2}, "decoder_sparse_step 2"),
    ({**_MOE, "num_experts_per_tok": 8}, "num_experts_per_tok 8 exceeds num_experts 4"),
    ({**_MOE, "moe_intermediate_size": None}, "moe_intermediate_size None"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling of type 'linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}}, "rope_scaling of type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707}},
     "rope_scaling"),  # DeepSeek's mscale pair (and, before megatron-core 0.15, YaRN itself)
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_key_value_heads": 4}, "not a multiple of num_key_value_heads 4"),
])
def test_unsupported_architectures_are_refused_by_name(change: dict, named: str) -> None:
    base = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 48, "intermediate_size": 80,
            "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 160}
    spec_from_hf_config(base)  # the base itself is fine
    assert spec_from_hf_config({**base, **_MOE}).num_experts == 4  # so is its mixture-of-experts twin
    with pytest.raises(UnsupportedModel) as e:
        spec_from_hf_config({**base, **change})
    assert named in str(e.value)
