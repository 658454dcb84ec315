"""Generate the example task set: small repositories whose one failing test the agent must fix.

Each task is a tiny Python module with one planted bug (a wrong operator, an off-by-one, a wrong
constant) and a ``unittest`` file that fails until the bug is fixed. The tests check each answer's
exact type before its value, so an object that claims to equal everything fails them; they are
scored by ``gyre-score unittest``, which runs the record's copy of them, never the workspace's. The records carry their files
inline (``workspace``: ``{"path": "content"}``), so ``train.jsonl`` and ``eval.jsonl`` are the
whole task set: copy the folder and point ``[task] train`` at it. Deterministic (seeded):

    python examples/tasks/make_tasks.py            # writes train.jsonl (48) and eval.jsonl (12)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (function name, correct body, buggy body, [(args, expected)])
KINDS = [
    ("add", "return a + b", "return a - b", [((2, 3), 5), ((-1, 1), 0)]),
    ("mul", "return a * b", "return a + b", [((3, 4), 12), ((0, 5), 0)]),
    ("clamp", "return max(lo, min(x, hi))", "return min(lo, max(x, hi))", [((5, 0, 3), 3), ((-2, 0, 3), 0)]),
    ("last", "return xs[-1]", "return xs[0]", [(([1, 2, 3],), 3), ((["a", "b"],), "b")]),
    ("total", "return sum(xs)", "return sum(xs[1:])", [(([1, 2, 3],), 6), (([5],), 5)]),
    ("count_even", "return sum(1 for x in xs if x % 2 == 0)", "return sum(1 for x in xs if x % 2 == 1)",
     [(([1, 2, 4],), 2), (([],), 0)]),
    ("first_n", "return xs[:n]", "return xs[:n - 1]", [(([1, 2, 3], 2), [1, 2]), (([4], 1), [4])]),
    ("is_adult", "return age >= 18", "return age > 18", [((18,), True), ((17,), False)]),
    ("square", "return x * x", "return x * 2", [((3,), 9), ((0,), 0)]),
    ("reverse", "return s[::-1]", "return s[::2]", [(("abc",), "cba"), (("",), "")]),
]
ARGS = {"add": "a, b", "mul": "a, b", "clamp": "x, lo, hi", "last": "xs", "total": "xs", "count_even": "xs",
        "first_n": "xs, n", "is_adult": "age", "square": "x", "reverse": "s"}
MODULES = ["util", "mathx", "core", "helpers", "lib", "tools"]


def task(i: int, rng: random.Random) -> dict:
    name, _, bug, cases = KINDS[i % len(KINDS)]
    module = f"{rng.choice(MODULES)}{i}"
    source = f'"""Small helpers."""\n\n\ndef {name}({ARGS[name]}):\n    {bug}\n'
    # exact type first: an object whose __eq__ always answers True (a known reward hack) fails here
    checks = "\n".join(f"        got = {module}.{name}(*{args!r})\n        self.assertIs(type(got), {type(want).__name__})\n"
                        f"        self.assertEqual(got, {want!r})" for args, want in cases)
    test = (f"import unittest\n\nimport {module}\n\n\nclass Test{name.title().replace('_', '')}(unittest.TestCase):\n"
            f"    def test_{name}(self):\n{checks}\n\n\nif __name__ == '__main__':\n    unittest.main()\n")
    return {
        "prompt": (f"The repository in the current directory has a failing test, test_{module}.py. Fix the bug "
                   f"in {module}.py so that `python3 -m unittest` passes. Do not change the test."),
        "workspace": {f"{module}.py": source, f"test_{module}.py": test},
        "function": name,
    }


def main() -> None:
    rng = random.Random(0)
    tasks = [task(i, rng) for i in range(60)]
    rng.shuffle(tasks)
    for name, part in (("train.jsonl", tasks[:48]), ("eval.jsonl", tasks[48:])):
        (HERE / name).write_text("".join(json.dumps(t) + "\n" for t in part))
    print(f"wrote {HERE / 'train.jsonl'} (48 tasks) and {HERE / 'eval.jsonl'} (12 tasks)")


if __name__ == "__main__":
    main()
