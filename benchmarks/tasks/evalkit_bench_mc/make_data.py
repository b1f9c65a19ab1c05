"""Writes test.jsonl: 100 two-step arithmetic word problems with 4 numeric choices (seeded, reproducible).

The benchmark's multiple-choice task: 100 documents x 4 choices = 400 log-likelihood requests, each
behind the same ~200-token few-shot context (evalkit_bench_mc.yaml), the case prefix caching serves.
Run: python benchmarks/tasks/evalkit_bench_mc/make_data.py
"""

import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jade"]
THINGS = ["apples", "marbles", "stickers", "books", "shells", "coins", "pencils", "cards"]

rng = random.Random(20261211)
rows = []
for i in range(100):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    start, more = rng.randint(5, 40), rng.randint(2, 30)
    less = rng.randint(1, min(15, start + more - 1))  # never all of them: the answer is at least 1
    answer = start + more - less
    question = (f"{name} has {start} {thing}. {name} gets {more} more {thing} and then gives {less} away. "
                f"How many {thing} does {name} have now?")
    wrong = {answer + 1, answer - 1, answer + 10, start + more + less, start + more} - {answer}
    choices = [answer, *rng.sample(sorted(wrong), 3)]
    rng.shuffle(choices)
    rows.append({"id": i, "question": question, "choices": [str(c) for c in choices],
                 "answer": choices.index(answer)})
out = Path(__file__).with_name("test.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} questions to {out}")
