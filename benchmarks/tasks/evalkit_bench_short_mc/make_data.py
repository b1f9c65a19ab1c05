"""Writes test.jsonl: 100 one-paragraph shop problems with 4 numeric choices, asked 0-shot (seeded, reproducible).

The benchmark's short-context multiple-choice task: 100 documents x 4 choices = 400 log-likelihood requests
of about 65 tokens each, shaped like ARC, PIQA or a numeric-answer MC: no shared few-shot context, so the 4
choices of a question share only their own ~60-token question.
Run: python benchmarks/tasks/evalkit_bench_short_mc/make_data.py
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/tasks: task_data.py
from task_data import choice_row, write_rows  # noqa: E402

PLACES = ["bakery", "library", "toy shop", "garden centre", "bookshop", "fruit stall", "hardware store", "cafe"]
THINGS = ["boxes of pencils", "crates of apples", "bags of flour", "packs of cards", "jars of honey",
          "rolls of tape", "sacks of seeds", "tins of paint"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]

rng = random.Random(20261201)
rows = []
for i in range(100):
    place, thing = rng.choice(PLACES), rng.choice(THINGS)
    first, second, third = rng.sample(DAYS, 3)
    start, more = rng.randint(10, 60), rng.randint(3, 40)
    sold = rng.randint(1, min(30, start + more - 1))
    answer = start + more - sold
    question = (f"On {first} the {place} had {start} {thing}. On {second} a delivery brought {more} more, and "
                f"on {third} the {place} sold {sold} of them to a school. How many {thing} does the {place} "
                f"have now?")
    wrong = {answer + 1, answer - 1, answer + 10, start + more + sold, start + more} - {answer}
    rows.append(choice_row(rng, i, question, answer, wrong))
write_rows(__file__, rows, "questions")
