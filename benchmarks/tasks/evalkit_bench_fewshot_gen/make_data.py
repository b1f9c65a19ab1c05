"""Writes test.jsonl: 100 two-step word problems for five-shot generation of up to 128 tokens (seeded).

The served benchmark's long-generation task (issue 31): five fixed worked examples in the task's description
(evalkit_bench_fewshot_gen.yaml) give every prompt a ~400-token context, and generation stops only at a blank
line or 128 new tokens, so decoding dominates: the case where the number of requests in flight matters.
Run: python benchmarks/tasks/evalkit_bench_fewshot_gen/make_data.py
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/tasks: task_data.py
from task_data import NAMES, THINGS, write_rows  # noqa: E402

rng = random.Random(20261232)
rows = []
for i in range(100):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    boxes, each, lost = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 9)
    answer = boxes * each - lost
    question = (f"{name} buys {boxes} boxes of {thing} with {each} {thing} in each box. On the way home {name} "
                f"loses {lost} {thing}. How many {thing} does {name} have at home?")
    rows.append({"id": i, "question": question, "answer": str(answer)})
write_rows(__file__, rows, "problems")
