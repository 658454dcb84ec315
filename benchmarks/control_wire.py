"""The torchrun control wire's cost on one micro-step: encode and decode, against pickle.

A micro-step of 32 rows × 512 tokens (16,384 tokens: ids, mask, behaviour log-probs, response ids
and the objective's weights per row) goes through :mod:`gyre_megatron.wire` (JSON header, raw
tensor bytes) and through pickle, 20 times each. Prints one JSON object.

    python benchmarks/control_wire.py
"""

from __future__ import annotations

import json
import pickle
import time

import torch

from gyre_core.dataplane.materialise import TrainingRow
from gyre_core.dataplane.packing import MicroStep, Pack
from gyre_core.interfaces import RoleClass
from gyre_core.trajectory import TrajectoryRow
from gyre_megatron.wire import decode, encode


def micro_step(rows: int = 32, n: int = 512) -> MicroStep:
    out = []
    for i in range(rows):
        row = TrajectoryRow(execution_id=i, group_id=0, role=RoleClass.MAIN_AGENT_TASK,
                            token_ids=torch.randint(0, 1000, (n,)),
                            loss_mask=torch.cat([torch.tensor([False]), torch.ones(n - 1, dtype=torch.bool)]),
                            behaviour_logprobs=torch.cat([torch.zeros(1), -torch.rand(n - 1)]),
                            response_ids=torch.cat([torch.tensor([-1]), torch.full((n - 1,), 3)]))
        out.append(TrainingRow(row, i, 0.5, torch.rand(n)))
    return MicroStep(0, 0, (Pack(tuple(out), rows),))


def main() -> None:
    m = micro_step()
    result: dict = {"benchmark": "control_wire", "tokens": 32 * 512}
    for name, enc, dec in (("wire", encode, lambda e: decode(*e)),
                           ("pickle", lambda x: pickle.dumps(x, 5), pickle.loads)):
        t = time.perf_counter()
        for _ in range(20):
            e = enc(m)
        te = (time.perf_counter() - t) / 20
        t = time.perf_counter()
        for _ in range(20):
            dec(e)
        td = (time.perf_counter() - t) / 20
        size = len(e[0]) + sum(len(a) for a in e[1]) if name == "wire" else len(e)
        result[name] = {"bytes": size, "encode_ms": round(te * 1e3, 2), "decode_ms": round(td * 1e3, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
