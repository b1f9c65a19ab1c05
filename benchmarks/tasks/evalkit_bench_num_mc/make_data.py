"""Writes test.jsonl: 100 arithmetic questions whose 4 numeric choices are several tokens each (seeded, reproducible).

The served benchmark's multi-token multiple-choice task (issue 31): answers of 4 to 6 digits, which the embedded
model's tokenizer writes as one token per digit, so no choice is a one-token continuation and every choice is
scored token by token (chained next-token reads on a server). Run: python benchmarks/tasks/evalkit_bench_num_mc/make_data.py
"""

import json
import random
from pathlib import Path

rng = random.Random(20261231)
rows = []
for i in range(100):
    a, b = rng.randint(101, 999), rng.randint(12, 99)
    answer = a * b
    question = f"What is {a} multiplied by {b}?"
    wrong = {answer + 10, answer - 10, answer + 100, a * (b + 1), a * (b - 1), (a + 1) * b} - {answer}
    choices = [answer, *rng.sample(sorted(wrong), 3)]
    rng.shuffle(choices)
    rows.append({"id": i, "question": question, "choices": [str(c) for c in choices],
                 "answer": choices.index(answer)})
out = Path(__file__).with_name("test.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} questions to {out}")
