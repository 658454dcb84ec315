"""Model folders a user keeps: complete, in the model's own dtype, loadable by transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from gyre_core.orchestrator.hf_folders import model_dtype, prunable_hf, write_hf_folder  # noqa: E402
from gyre_core.tiny_model import cached_tiny_model  # noqa: E402


def test_a_bf16_model_is_kept_in_bf16_and_loads_with_the_same_outputs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = cached_tiny_model()  # float32 weights, as a publication carries them
    user = tmp_path / "user-model"  # the user's model folder declares bfloat16
    shutil.copytree(src, user)
    cfg = json.loads((user / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (user / "config.json").write_text(json.dumps(cfg))
    assert model_dtype(user) == "bfloat16" and model_dtype(None) == "float32"

    dest = tmp_path / "hf" / "step4"
    write_hf_folder(dest, lambda p: shutil.copy2(src / "model.safetensors", p), src / "config.json", user,
                    model_dtype(user))
    assert not dest.with_name("step4.partial").exists()
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (dest / "model.safetensors").stat().st_size < 0.6 * (src / "model.safetensors").stat().st_size
    kept = AutoModelForCausalLM.from_pretrained(str(dest), torch_dtype="auto")
    assert next(kept.parameters()).dtype is torch.bfloat16
    ref = AutoModelForCausalLM.from_pretrained(str(src))
    for (name, p), (_, q) in zip(kept.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), name  # the same weights, cast once
    ids = AutoTokenizer.from_pretrained(str(dest))("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(kept(ids).logits).all()


def test_a_float32_model_is_copied_bit_for_bit(tmp_path: Path) -> None:
    src = cached_tiny_model()
    dest = tmp_path / "checkpoint"
    write_hf_folder(dest, lambda p: shutil.copy2(src / "model.safetensors", p), src / "config.json", src, "float32")
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (dest / "tokenizer.json").exists()


def test_only_the_newest_folders_are_kept() -> None:
    assert prunable_hf([2, 4, 6, 8], keep_last=2) == [2, 4]
    assert prunable_hf([2, 4], keep_last=0) == []
