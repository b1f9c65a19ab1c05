"""Writes test.jsonl: 100 two-step word problems for five-shot generation of up to 128 tokens (seeded).

The served benchmark's long-generation task (issue 31): five fixed worked examples in the task's description
(evalkit_bench_fewshot_gen.yaml) give every prompt a ~400-token context, and generation stops only at a blank
line or 128 new tokens, so decoding dominates: the case where the number of requests in flight matters.
Run: python benchmarks/tasks/evalkit_bench_fewshot_gen/make_data.py
"""

import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jade"]
THINGS = ["apples", "marbles", "stickers", "books", "shells", "coins", "pencils", "cards"]

rng = random.Random(20261232)
rows = []
for i in range(100):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    boxes, each, lost = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 9)
    answer = boxes * each - lost
    question = (f"{name} buys {boxes} boxes of {thing} with {each} {thing} in each box. On the way home {name} "
                f"loses {lost} {thing}. How many {thing} does {name} have at home?")
    rows.append({"id": i, "question": question, "answer": str(answer)})
out = Path(__file__).with_name("test.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} problems to {out}")
