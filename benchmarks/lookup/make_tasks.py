"""The ``lookup`` task: a two-turn task whose reward depends on the prompt and on a tool result.

Each record names one entry of a small table the agent cannot see (``table.json`` in its
workspace, read by the harness, not shown to the model): the model must first ask for the entry
the prompt names (turn 1), then answer with the code the tool returned (turn 2). A reply that
asks for another entry gets that entry's code, so copying the wrong name, or answering without
reading the result, scores 0. Reward: 1 when the final answer's first number is the entry's code.

    python benchmarks/lookup/make_tasks.py [--train 512] [--eval 64] [--sft 512] [--seed 0]

writes ``train.jsonl`` and ``eval.jsonl`` beside this file (disjoint (name, code) pairs in the two),
and ``sft.jsonl``, the warm start's demonstrations, whose asked pairs are in neither: a warm start
fine-tuned on the RL tasks themselves remembers their codes, and RL then raises the train reward
by recalling them (the held-out pass rate, which needs the tool result read, stays flat).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

NAMES = ("file", "code", "test", "bug", "function", "class", "value", "error", "result", "output", "input",
         "user", "tool", "command", "path", "agent")
"""Entry names: whole tokens of the tiny models' tokenizer (:mod:`gyre_core.tiny_model`)."""
ENTRIES = 6
"""Entries per table: the asked one and five distractors."""


def prompt_for(name: str) -> str:
    return f"Find the code of {name}. First ask: lookup {name}. Then answer with the code."


def make_record(rng: random.Random) -> dict[str, Any]:
    names = rng.sample(NAMES, ENTRIES)
    table = {n: rng.randint(10, 99) for n in names}
    name = rng.choice(names)
    return {"prompt": prompt_for(name), "name": name, "answer": table[name],
            "workspace": {"table.json": json.dumps(table)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--sft", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    held = [make_record(rng) for _ in range(a.eval)]
    seen = {(r["name"], r["answer"]) for r in held}
    train: list[dict[str, Any]] = []
    while len(train) < a.train:  # held-out: no (name, code) pair of the eval set is trained on
        r = make_record(rng)
        if (r["name"], r["answer"]) not in seen:
            train.append(r)
    used = seen | {(r["name"], r["answer"]) for r in train}
    sft: list[dict[str, Any]] = []
    while len(sft) < a.sft:  # drawn after the two above, so they stay as they were
        r = make_record(rng)
        if (r["name"], r["answer"]) not in used:
            sft.append(r)
    a.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held), ("sft.jsonl", sft)):
        (a.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"train": len(train), "eval": len(held), "sft": len(sft), "out": str(a.out)}))


if __name__ == "__main__":
    main()
