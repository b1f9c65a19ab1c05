"""What checking every prompt against max_model_len before the engine starts costs on a task of MMLU's size.

A generated multiple-choice task of 14,042 documents (MMLU's test split) x 4 choices = 56,168 log-likelihood
requests, each context ~600 tokens (five worked examples, as MMLU's 5-shot prompts), is prepared as a run prepares
it (evalkit/run/evaluate.py prepare) with the embedded model's tokenizer; printed: the seconds of each stage, the
check's (``check_lengths``: the requests built by lm-eval, then encoded and budgeted) beside loading the task.
Run: .venv/bin/python -m benchmarks.check_lengths [DOCUMENTS] (about a minute on 2 CPU cores at the default size).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

WORDS = ["apple", "river", "engine", "theory", "market", "signal", "forest", "method", "value", "system", "order",
         "history", "energy", "number", "figure", "policy", "animal", "report", "surface", "language"]


def write_task(folder: Path, documents: int) -> None:
    """A task YAML and its test.jsonl: questions of 30-60 words, 4 choices of 3-8 words, five fixed examples."""
    rng = random.Random(0)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = [{"question": words(30, 60) + "?", "choices": [words(3, 8) for _ in range(4)], "answer": rng.randrange(4)}
            for _ in range(documents)]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shots = "".join(f"Question: {words(60, 90)}?\nAnswer: {words(3, 8)}\n\n" for _ in range(5))
    (folder / "bench_lengths.yaml").write_text(
        "task: bench_lengths\ndataset_path: json\ndataset_kwargs: {data_files: {test: test.jsonl}}\ntest_split: test\n"
        f"output_type: multiple_choice\ndescription: {json.dumps(shots)}\ndoc_to_text: \"Question: {{{{question}}}}"
        "\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\ntarget_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n")


def main() -> None:
    from evalkit.config import compose_config
    from evalkit.run.evaluate import Stopwatch, prepare

    documents = int(sys.argv[1]) if len(sys.argv) > 1 else 14042
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), documents)
        cfg = compose_config(["tasks=[bench_lengths]", f"tasks_dirs=[{tmp}]", f"output_dir={tmp}/result"])
        watch = Stopwatch()
        prepare(cfg, check_devices=False, watch=watch)
    print(f"{documents} documents x 4 choices, the embedded model's tokenizer:")
    for stage, seconds in watch.laps.items():
        print(f"  {stage:14s} {seconds:7.2f} s")


if __name__ == "__main__":
    main()
