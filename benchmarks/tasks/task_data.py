"""What the benchmark tasks' make_data.py scripts share: a question's shuffled numeric choices, and test.jsonl."""

import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jade"]
THINGS = ["apples", "marbles", "stickers", "books", "shells", "coins", "pencils", "cards"]


def choice_row(rng: random.Random, i: int, question: str, answer: int, wrong: set[int]) -> dict:
    """Document i: the answer among 3 of the wrong ones, shuffled, its index the gold answer."""
    choices = [answer, *rng.sample(sorted(wrong - {answer}), 3)]
    rng.shuffle(choices)
    return {"id": i, "question": question, "choices": [str(c) for c in choices], "answer": choices.index(answer)}


def write_rows(script: str, rows: list[dict], noun: str) -> None:
    """rows as test.jsonl beside the script that made them."""
    out = Path(script).with_name("test.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} {noun} to {out}")
