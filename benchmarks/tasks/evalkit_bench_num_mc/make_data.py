"""Writes test.jsonl: 100 arithmetic questions whose 4 numeric choices are several tokens each (seeded, reproducible).

The served benchmark's multi-token multiple-choice task (issue 31): answers of 4 to 6 digits, which the embedded
model's tokenizer writes as one token per digit, so no choice is a one-token continuation and every choice is
scored token by token (chained next-token reads on a server). Run: python benchmarks/tasks/evalkit_bench_num_mc/make_data.py
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/tasks: task_data.py
from task_data import choice_row, write_rows  # noqa: E402

rng = random.Random(20261231)
rows = []
for i in range(100):
    a, b = rng.randint(101, 999), rng.randint(12, 99)
    answer = a * b
    question = f"What is {a} multiplied by {b}?"
    wrong = {answer + 10, answer - 10, answer + 100, a * (b + 1), a * (b - 1), (a + 1) * b} - {answer}
    rows.append(choice_row(rng, i, question, answer, wrong))
write_rows(__file__, rows, "questions")
