"""Writes test.jsonl: 100 two-step arithmetic word problems with 4 numeric choices (seeded, reproducible).

The benchmark's multiple-choice task: 100 documents x 4 choices = 400 log-likelihood requests, each
behind the same ~200-token few-shot context (evalkit_bench_mc.yaml), the case prefix caching serves.
Run: python benchmarks/tasks/evalkit_bench_mc/make_data.py
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/tasks: task_data.py
from task_data import NAMES, THINGS, choice_row, write_rows  # noqa: E402

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
    rows.append(choice_row(rng, i, question, answer, wrong))
write_rows(__file__, rows, "questions")
