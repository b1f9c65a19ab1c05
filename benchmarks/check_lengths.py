"""What checking every prompt against max_model_len before the engine starts costs on a task of MMLU's size.

A generated multiple-choice task of 14,042 documents (MMLU's test split) x 4 choices = 56,168 log-likelihood
requests of about 500 tokens each (five worked examples, as MMLU's 5-shot prompts), checked as a run checks it
(evalkit/run/before_engine.py check_lengths) with the embedded model's tokenizer; printed: the seconds of each step,
beside loading the task: the check as a run makes it (texts whose byte bound shows they fit max_model_len, 4096 by
default, are not encoded: lengths.token_bound) and, apart, with every text encoded. The run itself builds and
encodes the same requests again once its engine started.
Run: .venv/bin/python -m benchmarks.check_lengths [DOCUMENTS] (about two minutes on 2 CPU cores at the default size).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
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
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.tokenizer import TokenizerOnly, load_tokenizer
    from evalkit.harness import lengths
    from evalkit.harness.tasks import load_tasks
    from evalkit.run.before_engine import harness_lm

    documents = int(sys.argv[1]) if len(sys.argv) > 1 else 14042
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), documents)
        cfg = compose_config(["tasks=[bench_lengths]", f"tasks_dirs=[{tmp}]", f"output_dir={tmp}/result"])
        laps, clock = {}, time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            laps[stage], clock = time.perf_counter() - clock, time.perf_counter()

        manager, tasks = load_tasks(list(cfg.tasks), task_data={}, extra_dirs=list(cfg.tasks_dirs))
        lap("load the task (the run's own)")
        model_dir = resolve_model_path(cfg.vllm_path)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=False, add_bos_token=None, with_vllm=False)
        lm = harness_lm(cfg, TokenizerOnly(tokenizer, max_model_len=cfg.max_model_len, trust_remote_code=False,
                                           template_from="vllm"))
        lap("load the tokenizer")
        requests = lengths.build_requests(lm, manager.load(tasks)["tasks"], limit=None, samples=None, num_fewshot=None,
                                          fewshot_seed=1234, system_instruction=None, apply_chat_template=False,
                                          fewshot_as_multiturn=False)
        lap("build the requests (lm-eval)")
        checked = lengths.longest(lm, requests, cfg.max_model_len)
        lap("bound, encode what may not fit")
        every = harness_lm(cfg, TokenizerOnly(tokenizer, max_model_len=cfg.max_model_len, trust_remote_code=False,
                                              template_from="vllm"))
        found = lengths.longest(every, requests)
        lap("(encode every text instead)")
    count = sum(len(r) for r in requests.values())
    print(f"{documents} documents x 4 choices = {count} requests; the longest needs max_model_len={found.needs}; "
          f"at max_model_len={cfg.max_model_len} {len(lm.engine.encoded)} texts encoded "
          f"({'none' if checked is None else checked.needs} needed)")
    for stage, seconds in laps.items():
        print(f"  {stage:32s} {seconds:7.1f} s")
    print(f"  {'the check (the three before)':32s} {sum(list(laps.values())[1:4]):7.1f} s")


if __name__ == "__main__":
    main()
