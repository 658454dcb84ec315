"""Warm start for the ``lookup`` task: a tiny HF model taught to attempt it by supervised
fine-tuning on generated demonstrations, so RL starts from a policy that sometimes succeeds.

A tiny Qwen2 (:func:`gyre_core.tiny_model.build_tiny_model`, its tokenizer trained here) is
fine-tuned on two-turn demonstrations (``lookup <name>``; then the code the tool returned), loss on
the assistant turns only, with AdamW on the CPU. The demonstrations are ``sft.jsonl``'s, whose
asked (name, code) pairs the RL train and held-out sets do not hold: fine-tuned on the RL tasks
themselves, the model remembers their codes, and RL raises the train reward by recall alone.
Every ``--eval-every`` steps the held-out pass rate is measured the way a run scores it: the
harness's two turns (:mod:`agent`), sampled at temperature 1, scored by :mod:`reward`. Training stops at the first
evaluation whose pass rate reaches ``--target`` (or after ``--max-steps``) and the model is saved
with its tokenizer and chat template: a ``model.dir`` for ``gyre-orchestrate run``.

    python benchmarks/lookup/warm_start.py --out runs/lookup-start [--target 0.3] [--seed 0]

Prints one JSON object (pass rate per evaluation, steps, seconds).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from agent import tool_result  # noqa: E402
from reward import answer_of  # noqa: E402


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def demonstration(tok: Any, rec: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids of the whole two-turn conversation and a mask over the assistant turns."""
    table = json.loads(rec["workspace"]["table.json"])
    first = f"lookup {rec['name']}"
    msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": first},
            {"role": "user", "content": tool_result(first, table)}, {"role": "assistant", "content": str(rec["answer"])}]
    ids: list[int] = []
    mask: list[float] = []
    for i in range(len(msgs)):  # each prefix renders to a prefix of the next (the template's promise)
        part = _ids(tok, msgs[: i + 1], False)
        new = part[len(ids):]
        if msgs[i]["role"] == "assistant":
            head = len(_ids(tok, msgs[:i], True)) - len(ids)  # "<|im_start|>assistant\n" is the prompt's
            mask += [0.0] * head + [1.0] * (len(new) - head)
        else:
            mask += [0.0] * len(new)
        ids = part
    return ids, mask


def _ids(tok: Any, msgs: list[dict[str, str]], gen: bool) -> list[int]:
    out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5: a BatchEncoding


@torch.no_grad()
def _reply(model: Any, tok: Any, msgs: list[dict[str, str]], max_new: int, gen: torch.Generator) -> str:
    ids = torch.tensor([_ids(tok, msgs, True)])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out: list[int] = []
    past = None
    x = ids
    for _ in range(max_new):
        res = model(input_ids=x, past_key_values=past, use_cache=True)
        past = res.past_key_values
        probs = torch.softmax(res.logits[0, -1].float(), -1)
        t = int(torch.multinomial(probs, 1, generator=gen))
        if t == end:
            break
        out.append(t)
        x = torch.tensor([[t]])
    return tok.decode(out)


def pass_rate(model: Any, tok: Any, records: list[dict[str, Any]], seed: int) -> float:
    """The held-out pass rate as a run scores it: both turns sampled at temperature 1."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    wins = 0
    for rec in records:
        table = json.loads(rec["workspace"]["table.json"])
        msgs = [{"role": "user", "content": rec["prompt"]}]
        first = _reply(model, tok, msgs, 16, gen)
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": tool_result(first, table)}]
        wins += answer_of(_reply(model, tok, msgs, 8, gen)) == int(rec["answer"])
    model.train()
    return wins / len(records)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train", type=Path, default=HERE / "sft.jsonl",
                    help="demonstrations (default: sft.jsonl, whose asked pairs RL never trains or evaluates on)")
    ap.add_argument("--eval", type=Path, default=HERE / "eval.jsonl")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--target", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import transformers

    from gyre_core.tiny_model import build_tiny_model

    t0 = time.monotonic()
    torch.manual_seed(a.seed)
    build_tiny_model(a.out, hidden_size=a.hidden, num_layers=a.layers, intermediate_size=2 * a.hidden,
                     max_position_embeddings=2048, seed=a.seed)
    tok = transformers.AutoTokenizer.from_pretrained(str(a.out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a.out), dtype=torch.float32)
    train, held = _records(a.train), _records(a.eval)
    demos = [demonstration(tok, r) for r in train]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    rng = random.Random(a.seed)
    curve = [{"step": 0, "pass_rate": pass_rate(model, tok, held, a.seed)}]
    step = 0
    while step < a.max_steps and curve[-1]["pass_rate"] < a.target:
        batch = rng.sample(demos, a.batch)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0.0] * (width - len(m)) for _, m in batch])
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(ids.shape[0], -1)
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % a.eval_every == 0:
            curve.append({"step": step, "loss": round(float(loss), 4), "pass_rate": pass_rate(model, tok, held, a.seed)})
            print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
    model.save_pretrained(str(a.out), safe_serialization=True)
    print(json.dumps({"out": str(a.out), "steps": step, "pass_rate": curve[-1]["pass_rate"], "curve": curve,
                      "eval_records": len(held), "seconds": round(time.monotonic() - t0, 1),
                      "hidden": a.hidden, "layers": a.layers, "lr": a.lr, "batch": a.batch}))


if __name__ == "__main__":
    main()
