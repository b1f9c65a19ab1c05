"""Progress lines (evalkit/run/progress.py) with a fake clock; its stand-in for vLLM's tqdm bar driven the way
vLLM 0.32 drives it (vllm/entrypoints/common/offline.py), plus a check that vLLM still drives it that way;
the supervisor's Terminal, which shows those lines on a TTY and elsewhere.

Run: pytest tests/test_progress.py
"""

import importlib.util
import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from evalkit.run.progress import EngineBar, Progress, Terminal, clock_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def progress(total=160, interval=2.0, label="loglikelihood"):
    clock, stream = Clock(), io.StringIO()
    return Progress(label, total, stream=stream, interval=interval, clock=clock), clock, stream


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_line_format_rate_and_eta():
    p, clock, stream = progress()
    clock.now += 10.0
    p.advance(120, tokens=18_300)
    # 120 requests in 10 s: 40 left take 3.3 s
    assert lines(stream) == ["evalkit: progress loglikelihood 120/160 requests, 1,830 tok/s, ETA 0:03"]


def test_at_most_one_line_per_interval():
    p, clock, stream = progress(total=100, interval=2.0)
    for _ in range(10):
        clock.now += 0.5
        p.advance(1, tokens=10)
    # lines at 2.0 s and 4.0 s after the start, none in between
    assert lines(stream) == ["evalkit: progress loglikelihood 4/100 requests, 20 tok/s, ETA 0:48",
                             "evalkit: progress loglikelihood 8/100 requests, 20 tok/s, ETA 0:46"]


def test_eta_in_hours_and_without_tokens():
    p, clock, stream = progress(total=1000, label="generate_until")
    clock.now += 60.0
    p.advance(10)
    assert lines(stream) == ["evalkit: progress generate_until 10/1000 requests, ETA 1:39:00"]
    assert clock_text(59.6) == "1:00" and clock_text(3600) == "1:00:00"


def test_close_prints_the_final_line_once():
    p, clock, stream = progress()
    clock.now += 12.3
    p.advance(160, tokens=22_509)
    p.close()
    p.close()
    p.advance(1)
    assert lines(stream)[-1] == "evalkit: done loglikelihood 160/160 requests in 12.3 s, 1,830 tok/s"
    assert len(lines(stream)) == 2


def test_close_of_a_long_run_and_of_no_requests():
    p, clock, stream = progress(total=5, interval=1e9)
    clock.now += 125.0
    p.advance(5, tokens=1000)
    p.close()
    assert lines(stream) == ["evalkit: done loglikelihood 5/5 requests in 2:05, 8 tok/s"]
    empty, _, stream = progress(total=0)
    empty.close()
    assert lines(stream) == ["evalkit: done loglikelihood 0/0 requests in 0.0 s"]


def run_engine_as_vllm(use_tqdm, finished: list, clock: Clock) -> list:
    """vLLM 0.32's use of use_tqdm, step by step: maybe_tqdm(prompts, desc="Rendering prompts") in
    _add_completion_requests, then _run_engine's bar (`finished`: per engine step, the outputs that finish)."""
    prompts = [f"p{i}" for i in range(sum(len(step) for step in finished))]
    rendered = list(use_tqdm(prompts, desc="Rendering prompts"))
    pbar = use_tqdm(total=len(rendered), desc="Processed prompts", dynamic_ncols=True,
                    postfix=f"est. speed input: {0:.2f} toks/s, output: {0:.2f} toks/s")
    outputs, total_in_toks, total_out_toks = [], 0, 0
    for step in finished:
        clock.now += 0.7
        for output in step:
            outputs.append(output)
            n = len(output.outputs)
            total_in_toks += len(output.prompt_token_ids) * n
            in_spd = total_in_toks / pbar.format_dict["elapsed"]
            total_out_toks += sum(len(stp.token_ids) for stp in output.outputs)
            out_spd = total_out_toks / pbar.format_dict["elapsed"]
            pbar.postfix = f"est. speed input: {in_spd:.2f} toks/s, output: {out_spd:.2f} toks/s"
            pbar.update(n)
            if pbar.n == len(rendered):
                pbar.refresh()
    pbar.close()
    assert rendered == prompts
    return outputs


def output(prompt_tokens: int, generated: int):
    return SimpleNamespace(prompt_token_ids=list(range(prompt_tokens)),
                           outputs=[SimpleNamespace(token_ids=list(range(generated)))])


def test_engine_bar_counts_requests_and_tokens_as_vllm_reports_them():
    p, clock, stream = progress(total=5, interval=1.0)
    bar = p.engine_bar()
    steps = [[output(37, 1), output(123, 1)], [], [output(1001, 1)]]
    run_engine_as_vllm(bar, steps, clock)  # a first chunk of 3 requests
    assert (p.done, p.tokens) == (3, 37 + 123 + 1001 + 3)
    run_engine_as_vllm(bar, [[output(5, 250), output(6, 7)]], clock)  # the second chunk, a fresh bar
    assert (p.done, p.tokens) == (5, 1164 + 5 + 250 + 6 + 7)
    p.close()
    assert lines(stream) == ["evalkit: progress loglikelihood 3/5 requests, 554 tok/s, ETA 0:01",  # 2.1 s in
                             "evalkit: done loglikelihood 5/5 requests in 2.8 s, 511 tok/s"]


def test_engine_bar_without_elapsed_time_or_postfix_counts_requests():
    p, clock, _ = progress()
    bar = p.engine_bar()(total=3, desc="Processed prompts")
    bar.update(1)  # vLLM's pooling path: no postfix
    bar.postfix = "est. speed input: 5.00 toks/s, output: 1.00 toks/s"
    bar.update(1)  # a postfix, but elapsed never read: no way to turn speeds into tokens
    assert (p.done, p.tokens, bar.n) == (2, 0, 2)
    assert bar.format_dict["elapsed"] > 0  # vLLM divides by it, even at once after the start


PBAR_USE = re.compile(r"\bpbar\.(\w+)")


def vllm_source(relative: str) -> str:
    spec = importlib.util.find_spec("vllm")  # finds vLLM without importing it (slow)
    if spec is None or not spec.origin:
        pytest.skip("vLLM is not installed")
    return (Path(spec.origin).parent / relative).read_text()


@pytest.mark.parametrize("relative", ["entrypoints/common/offline.py", "entrypoints/pooling/offline.py"])
def test_vllm_uses_no_more_of_the_bar_than_engine_bar_has(relative):
    """Fails when a vLLM upgrade changes how it drives use_tqdm: then update EngineBar and the replay above."""
    source = vllm_source(relative)
    used = set(PBAR_USE.findall(source))
    assert used and used <= {"format_dict", "postfix", "update", "n", "refresh", "close"}, used
    assert all(hasattr(EngineBar(progress()[0]), name) for name in used)
    assert "tqdm_func = use_tqdm if callable(use_tqdm) else tqdm" in source
    if "common" in relative:
        assert re.search(r"maybe_tqdm\(\s*seq_prompts,\s*use_tqdm=use_tqdm,\s*desc=\"Rendering prompts\",\s*\)", source)
        assert 'pbar.format_dict["elapsed"]' in source and "est. speed input: {in_spd:.2f} toks/s" in source


def test_terminal_shows_only_evalkit_lines_and_overwrites_progress_on_a_tty():
    stream = io.StringIO()
    terminal = Terminal(stream, tty=True)
    for line in ["INFO 05-01 12:00:00 [llm.py:340] loading\n",
                 "evalkit: progress loglikelihood 10/160 requests, 1,830 tok/s, ETA 1:04\n",
                 "(EngineCore pid=7) INFO warming up\n",
                 "evalkit: progress loglikelihood 20/160 requests, ETA 0:59\n",
                 "evalkit: done loglikelihood 160/160 requests in 12.3 s, 1,830 tok/s\n"]:
        terminal.show(line)
    terminal.end()
    first = "evalkit: progress loglikelihood 10/160 requests, 1,830 tok/s, ETA 1:04"
    second = "evalkit: progress loglikelihood 20/160 requests, ETA 0:59"
    assert stream.getvalue() == ("\r" + first + "\r" + second.ljust(len(first)) + "\n"
                                 "evalkit: done loglikelihood 160/160 requests in 12.3 s, 1,830 tok/s\n")
    terminal.show("evalkit: progress generate_until 1/2 requests, ETA 0:01\n")
    terminal.end()
    terminal.end()
    assert stream.getvalue().endswith("\n\revalkit: progress generate_until 1/2 requests, ETA 0:01\n")


def test_terminal_elsewhere_shows_one_progress_line_per_label_every_30_s():
    clock, stream = Clock(), io.StringIO()
    terminal = Terminal(stream, tty=False, every=30.0, clock=clock)
    shown = []
    for at, line in [(0, "evalkit: progress loglikelihood 1/9 requests, ETA 0:08"),
                     (10, "evalkit: progress loglikelihood 2/9 requests, ETA 0:07"),
                     (10, "evalkit: progress generate_until 1/3 requests, ETA 0:02"),
                     (20, "vLLM says something"),
                     (29.9, "evalkit: progress loglikelihood 3/9 requests, ETA 0:06"),
                     (30, "evalkit: progress loglikelihood 4/9 requests, ETA 0:05"),
                     (31, "evalkit: done loglikelihood 9/9 requests in 31.0 s"),
                     (32, "evalkit: done generate_until 3/3 requests in 32.0 s")]:
        clock.now = 100.0 + at
        terminal.show(line + "\n")
        shown.append(line)
    assert lines(stream) == [shown[0], shown[2], shown[5], shown[6], shown[7]]
