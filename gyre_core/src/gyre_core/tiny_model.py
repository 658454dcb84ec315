"""Build a tiny model (Qwen2 by default) and a locally trained tokenizer, with nothing downloaded.

Tests, benchmarks and the embedded default of ``gyre-orchestrate run`` need a real model directory
that SGLang can serve and transformers can load: config, safetensors weights, a tokenizer and a
chat template that renders tools and tool calls the way Qwen/Hermes models do (``<tool_call>``
blocks holding ``{"name": ..., "arguments": ...}``, tool results inside ``<tool_response>``). No
model hub is reachable, so the tokenizer is trained here on a small synthetic corpus that covers
the template's markup, JSON and everyday words; the weights are random (seeded), so the model
is deterministic but not clever. Building takes a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_model", "cached_tiny_model"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Qwen2.5 / Hermes style: tools listed in the system turn as JSON signatures, each tool call of an
# assistant turn as a <tool_call> JSON block, each tool result as a <tool_response> inside a user
# turn. ``tojson`` keeps the key order it is given, which is what makes a restored payload render
# back to the tokens the model sampled. An assistant turn always starts with the generation prompt
# (``<|im_start|>assistant\n``), even when it is empty, so a recorded answer's rendering extends
# the prompt it answered (what the proxy's incremental encoding keys on).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an is are was be to of and in that it for on with as at by from this file code test run "
    "read write edit list make fix bug add remove function class return value error result output "
    "input user assistant system tool call name arguments command description path content text "
    "true false null none yes no ok done task step answer question please thanks summary agent "
    "python bash ls cat echo grep sed git diff commit status print import def if else for while "
    "number string object array type properties required integer boolean timeout background"
).split()


def _corpus(rng: random.Random, lines: int) -> list[str]:
    out: list[str] = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        sentence = " ".join(words)
        kind = i % 5
        if kind == 0:
            out.append(sentence.capitalize() + ".")
        elif kind == 1:
            args = {rng.choice(_WORDS): rng.choice(_WORDS + [str(rng.randint(0, 999))]) for _ in range(3)}
            out.append('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (rng.choice(_WORDS), json.dumps(args)))
        elif kind == 2:
            out.append("<|im_start|>user\n" + sentence + "<|im_end|>\n<|im_start|>assistant\n")
        elif kind == 3:
            out.append("<tool_response>\n" + sentence + " " + str(rng.randint(0, 10**6)) + "\n</tool_response>")
        else:
            out.append("$ " + " ".join(rng.choice(_WORDS) for _ in range(4)) + " && echo " + str(rng.random()))
    out.append("".join(chr(c) for c in range(32, 127)))
    return out


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    family: str = "qwen2",
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random model with a locally trained BPE tokenizer to ``out_dir``.

    Returns ``out_dir``. Deterministic for a given ``seed``. The saved directory loads with
    ``AutoTokenizer``/``AutoModelForCausalLM`` and is served by SGLang. ``family``: ``qwen2``
    (the default), ``qwen3`` (q/k norms, a head twice ``hidden / heads`` wide) or ``llama``
    (no biases) or ``qwen3_moe`` (Qwen3's attention, 4 experts of half the FFN width, 2 per
    token), to run the whole job on each family a user may bring. ``rope_scaling``: the HF
    config's RoPE scaling (e.g. Llama 3.1's ``{"rope_type": "llama3", "factor": 8.0, ...}``).
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    families = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
                "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 2 * hidden_size // num_heads}),
                "llama": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": hidden_size // num_heads}),
                "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
                    "head_dim": 2 * hidden_size // num_heads, "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": intermediate_size // 2, "norm_topk_prob": True})}
    if family not in families:
        raise ValueError(f"family {family!r}: expected one of {sorted(families)}")
    config_class, model_class, own = families[family]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(rng, 4000), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = max_position_embeddings
    tok.save_pretrained(out)

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        torch_dtype="float32",
        **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {}),
        **own,
    )
    model = getattr(transformers, model_class)(config)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" for one shard says nothing
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    gen = {"eos_token_id": [config.eos_token_id], "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def cached_tiny_model(cache_root: str | Path | None = None, **kwargs: Any) -> Path:
    """:func:`build_tiny_model` once per machine: reuse a finished build keyed by its inputs.

    Fast tests need the tokenizer and template, not a fresh model each session; the key covers the
    build arguments and the chat template, so changing either rebuilds. The build goes to a
    temporary directory that is renamed into place, so a half-written model is never reused.
    """
    root = Path(cache_root or os.environ.get("GYRE_CACHE_DIR") or Path.home() / ".cache" / "gyre")
    key = hashlib.sha256(json.dumps([sorted(kwargs.items()), CHAT_TEMPLATE, SPECIAL_TOKENS]).encode()).hexdigest()[:16]
    target = root / f"tiny-model-{key}"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tiny-build-", dir=root))
    try:
        build_tiny_model(tmp, **kwargs)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
