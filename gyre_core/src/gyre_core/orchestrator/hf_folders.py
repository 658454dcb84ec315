"""Model folders a user keeps: the run's final ``checkpoint/`` and the periodic ``hf/step<N>/``.

Each is a complete Hugging Face folder (weights, ``config.json``, tokenizer and chat template) that
transformers and SGLang load as is, and that a later run can start from (``model.dir``). The
weights are written in the model's own dtype: the ``torch_dtype`` of the user's ``config.json``
(``model.dir``), float32 for a model Gyre built itself. Publications travel in the trainer's
parameter dtype; a bf16 model is saved as bf16, not at twice its size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

__all__ = ["TOKENIZER_FILES", "model_dtype", "prunable_hf", "write_hf_folder"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_dtype(model_dir: str | Path | None) -> str:
    """The dtype a model folder declares (``torch_dtype``, or transformers' newer ``dtype``)."""
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        return "float32"
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return dtype if dtype in _DTYPES else "float32"


def write_hf_folder(dest: Path, write_weights: Callable[[Path], None], config: Path, tokenizer_dir: Path,
                    dtype: str) -> None:
    """``dest`` as a complete model folder: ``write_weights(folder)`` writes the weight files
    into it (``model.safetensors``, or one file per pipeline stage with HF's
    ``model.safetensors.index.json``), each then cast to ``dtype`` one file at a time (no more
    than one file's tensors in memory); ``config.json`` is ``config``'s with that dtype. Written
    under a temporary name and renamed, so a folder that exists is whole."""
    from safetensors.torch import load_file, save_file

    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_weights(tmp)
    target = _DTYPES[dtype]
    for weights in sorted(tmp.glob("*.safetensors")):
        tensors = load_file(str(weights))
        if any(t.is_floating_point() and t.dtype != target for t in tensors.values()):
            save_file({k: (t.to(target) if t.is_floating_point() else t).contiguous() for k, t in tensors.items()},
                      str(weights))
        del tensors
    cfg = json.loads(config.read_text())
    cfg["torch_dtype"] = dtype
    if "dtype" in cfg:  # newer transformers write (and prefer) this name
        cfg["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def prunable_hf(saved: Mapping[int, Path] | Sequence[int], keep_last: int) -> list[int]:
    """Steps whose periodic HF folders may go: all but the ``keep_last`` newest (0: none)."""
    if keep_last <= 0:
        return []
    steps = sorted(saved)
    return steps[:-keep_last]
