"""How much a training run changed the held-out pass rate, by importance sampling: precise where
two separate evaluations are not.

Two evaluations of 256 samples each measure a pass rate to about ±0.03, so a change of 0.02
between two close versions is invisible. Here the held-out episodes are sampled once, from the
*before* model, the way a run samples them (both turns of :mod:`agent` at temperature 1, the
tool's answer in between, at most 16 and 8 tokens, stopping at the end-of-turn token), and each
is scored by :mod:`reward`. Then the *after* model's probability of the same episode gives the
exact change in expected reward:

    E_after[r] − E_before[r] = E_before[r · (w − 1)],   w = π_after(episode) / π_before(episode)

(the tool is deterministic, so ``w`` is the ratio of the two models' probabilities of the sampled
tokens). The estimate is unbiased; its standard error is small while ``w`` stays near 1, i.e. for
versions a few steps apart, and grows as they drift (compare ``max_w``).

    python benchmarks/lookup/held_out_change.py --before RUN/weights/v0 --after RUN/checkpoint [--samples 4]

Prints one JSON object: the before model's pass rate, the change with its standard error, and
how far ``w`` ranged.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from agent import tool_result  # noqa: E402
from reward import answer_of  # noqa: E402
from warm_start import _ids, _records  # noqa: E402

TURN_TOKENS = (16, 8)  # what agent.py asks for in its two calls


@torch.no_grad()
def _logprob(model: Any, ids: list[int], start: int) -> float:
    """Log-probability of ``ids[start:]`` given ``ids[:start]``, in float64."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
    return float(logp.gather(1, x[0, 1:, None])[start - 1:, 0].sum())


@torch.no_grad()
def _sample_turn(before: Any, after: Any, tok: Any, msgs: list[dict[str, str]], max_new: int, end: int,
                 gen: torch.Generator) -> tuple[str, float]:
    """One reply sampled from ``before`` (temperature 1), and log π_after − log π_before of it."""
    prompt = _ids(tok, msgs, True)
    out: list[int] = []
    x, past = torch.tensor([prompt]), None
    for _ in range(max_new):
        res = before(input_ids=x, past_key_values=past, use_cache=True)
        past = res.past_key_values
        t = int(torch.multinomial(torch.softmax(res.logits[0, -1].float(), -1), 1, generator=gen))
        out.append(t)
        if t == end:
            break
        x = torch.tensor([[t]])
    full = prompt + out
    return tok.decode([t for t in out if t != end]), _logprob(after, full, len(prompt)) - _logprob(before, full, len(prompt))


def held_out_change(before_dir: Path, after_dir: Path, records: list[dict[str, Any]], samples: int,
                    seed: int = 0) -> dict[str, Any]:
    """The importance-sampled change of the mean reward on ``records`` from ``before_dir`` to ``after_dir``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(before_dir))
    before, after = (transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                     for d in (before_dir, after_dir))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = torch.Generator().manual_seed(seed)
    rewards: list[float] = []
    weights: list[float] = []
    for _ in range(samples):
        for rec in records:
            table = json.loads(rec["workspace"]["table.json"])
            msgs = [{"role": "user", "content": rec["prompt"]}]
            first, d1 = _sample_turn(before, after, tok, msgs, TURN_TOKENS[0], end, gen)
            msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": tool_result(first, table)}]
            answer, d2 = _sample_turn(before, after, tok, msgs, TURN_TOKENS[1], end, gen)
            rewards.append(1.0 if answer_of(answer) == int(rec["answer"]) else 0.0)
            weights.append(math.exp(d1 + d2))
    xs = [r * (w - 1.0) for r, w in zip(rewards, weights)]
    n = len(xs)
    change = sum(xs) / n
    se = math.sqrt(sum((x - change) ** 2 for x in xs) / (n - 1) / n)
    return {"before": str(before_dir), "after": str(after_dir), "episodes": n,
            "before_pass_rate": round(sum(rewards) / n, 4), "change": round(change, 4), "se": round(se, 4),
            "z": round(change / se, 2) if se > 0 else None,
            "min_w": round(min(weights), 4), "max_w": round(max(weights), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="model folder the episodes are sampled from")
    ap.add_argument("--after", type=Path, required=True, help="model folder whose pass rate is estimated")
    ap.add_argument("--eval", type=Path, default=HERE / "eval.jsonl", help="the held-out records")
    ap.add_argument("--samples", type=int, default=4, help="episodes per record")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(held_out_change(a.before, a.after, _records(a.eval), a.samples, a.seed)))


if __name__ == "__main__":
    main()
