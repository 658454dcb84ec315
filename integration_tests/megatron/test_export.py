"""§5: a Megatron GPTModel's exported weights, loaded into HF Qwen2, give the same outputs.

PP = 1: logits compared directly. The PP = 2 case (checkpoint assembled from both stages by the
publisher; HF's per-token losses equal Megatron's) runs in ``test_streaming_cells.py`` to share
its launch.
Tolerance: float32 throughout; the two implementations differ in op order (fused QKV vs separate
projections, attention kernels), so ``atol = 1e-4`` on logits of magnitude ~1 (measured: 0 with eager attention on CPU).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")

from gyre_megatron.export import load_hf_model  # noqa: E402
from gyre_megatron.testing import make_items  # noqa: E402


def test_export_pp1_logits_match_hf(tmp_path) -> None:
    from gyre_megatron.export import publish
    from gyre_core.interfaces import PublicationOptions
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions

    with World(RankOptions(cells=1, pp=1), n_queues=1) as w:
        ref = publish(w, PublicationOptions(folder=str(tmp_path)), version=3)
        tokens = make_items(1, seed=5)[0]["tokens"]
        mlogits = w.call([0], "logits", tokens)[0]  # [1, S, V]
    assert ref.version == 3 and ref.location.endswith("v3")
    hf = load_hf_model(ref.location)
    with torch.no_grad():
        hlogits = hf(tokens).logits.numpy()
    assert hlogits.shape == mlogits.shape
    err = float(np.abs(hlogits - mlogits).max())
    print(f"\nexport pp1: logits max|HF - Megatron| {err:.3g}")
    assert err <= 1e-4, err
    assert float(np.abs(mlogits).max()) > 0.1
