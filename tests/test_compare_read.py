"""How compare reads a run's samples files (evalkit/compare/runs.py): each line as the stdlib json reads it, also
where orjson, which reads them, would refuse it or read it otherwise (NaN, infinities, integers past 64 bits, a
lone surrogate); lines split at newlines only (JSON Lines), so a U+2028 in an output is text, not a line break;
damaged lines refused as before; of each sample only what compare reads is held, and the reports made from those
records are the reports made from the whole lines.
Run: pytest tests/test_compare_read.py
"""

import json
import tracemalloc

import pytest

from evalkit.compare import cli
from evalkit.compare import runs as on_disk
from evalkit.run import sample_index
from evalkit.untrusted import printable
from tests.test_compare import fake_run, task_run
from tests.fake_engine import FakeEngine

BIG = 2**70  # past 64 bits: orjson would read it as a float


def line(doc_id, **fields):
    return {"doc_id": doc_id, "filter": "none", "metrics": ["acc"], "acc": 1, "doc_hash": f"d{doc_id}",
            "prompt_hash": f"p{doc_id}", "target_hash": f"t{doc_id}", **fields}


TRICKY = [  # the text of each line, as a file may hold it
    json.dumps(line(0, doc={"x": float("nan")}, extra=[float("inf"), float("-inf")])),  # NaN, Infinity
    json.dumps(line(BIG, acc=BIG)),  # an integer past 64 bits, as doc_id and as a metric's value
    json.dumps(line(2, acc=-BIG, output_tokens=9223372036854775807, extra=[-9223372036854775809])),  # about 2**63
    json.dumps(line(3, acc=0.1234567890123456789, extra=[1e-400, 5e-324, 1.7976931348623157e308])),
    # 1e400: inf
    json.dumps(line(4, raw_output="a\u2028b\u2029c\x85d"), ensure_ascii=False)[:-1] + ', "big_float": 1e400}',
    json.dumps(line(5, raw_output="\ud800 lone surrogate")),  # an escaped lone surrogate
    json.dumps(line(6, raw_output="é ☃ 😀"), ensure_ascii=False) + "\r",  # raw UTF-8, a CRLF line end
    "",  # blank lines are skipped
    "   \t",
    "\u3000",  # as is a line of Unicode white space
    '{"doc_id": 7, "filter": "none", "metrics": ["acc"], "acc": 1, "acc": 0}',  # a key twice: the last counts
    json.dumps(line(8, prompt="Q: 12345678901234567890 apples?", target="1234567890123456789012")),  # long digits
]


def stdlib_read(text):
    """What compare read of these lines before orjson: each non-blank line (str.strip) through json.loads."""
    return {(s["doc_id"], printable(str(s.get("filter", "none")))): on_disk.held(s, {})
            for s in map(json.loads, filter(str.strip, text.split("\n")))}


def test_each_line_is_read_as_the_stdlib_json_reads_it(tmp_path):
    file = tmp_path / "samples_t.jsonl"
    text = "\n".join(TRICKY) + "\n"
    file.write_text(text, encoding="utf-8")
    read = on_disk.read_samples(file, "t")
    assert repr(read) == repr(stdlib_read(text))  # repr: NaN, the integers' types and digits, the floats' bits
    assert type(read[(BIG, "none")]["acc"]) is int and read[(BIG, "none")]["acc"] == BIG
    assert read[(4, "none")]["raw_output"] == "a\u2028b\u2029c\x85d"  # a line break to str.splitlines, not here


def test_a_u2028_in_an_output_is_text_not_a_line_break(tmp_path):
    """evalkit writes samples with ensure_ascii=False: a generation holding U+2028 is written raw. Read with
    str.splitlines, its line was cut in two and the run refused as damaged."""
    file = tmp_path / "samples_t.jsonl"
    file.write_text(json.dumps(line(0, raw_output="one\u2028two"), ensure_ascii=False) + "\n", encoding="utf-8")
    assert on_disk.read_samples(file, "t")[(0, "none")]["raw_output"] == "one\u2028two"


@pytest.mark.parametrize("content, message", [
    (b'{"doc_id": 0}\n{"doc_id": 1, "acc": \xff}\n', None),  # not UTF-8: the position counted in the file
    (b'{"doc_id": 0}\n{"doc_id": 1,, }\n', "line 2: not JSON (Expecting property name enclosed in double quotes at "
     "line 1, column 14)"),
    (b'\xef\xbb\xbf{"doc_id": 0}\n', "line 1: not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) at line 1, "
     "column 1)"),
    (b'{"doc_id": 0}\n' + b'[' * 100_000 + b']' * 100_000 + b'\n', "line 2: nested too deeply"),
    (b'{"doc_id": 1' + b'0' * 5000 + b'}\n', "line 1: a number too long"),
    (b'{"doc_id": 1.0}\n', "line 1: a sample without an integer doc_id"),
    (b'{"doc_id": 18446744073709551616.5}\n', "line 1: a sample without an integer doc_id"),
])
def test_a_damaged_line_is_refused_as_before(tmp_path, content, message):
    file = tmp_path / "samples_t.jsonl"
    file.write_bytes(content)
    if message is None:
        try:
            content.decode("utf-8")
        except UnicodeDecodeError as error:
            message = f": cannot be read ({error})"  # what reading the whole file said
    with pytest.raises(on_disk.CompareError) as refused:
        on_disk.read_samples(file, "t")
    assert str(refused.value).startswith(f"{file}") and message in str(refused.value), refused.value


def test_only_what_compare_reads_is_held(tmp_path):
    """The document, the filtered responses, the scores' copy, the prompt in each choice's arguments (a
    generation's arguments whole), the request records but the first and the generations', and their other fields
    are not held; the responses are held as each choice's log-likelihood, a number; a line's own metric named like
    one of them is kept whole."""
    full = line(0, doc={"question": "q" * 1000}, filtered_resps=["x"], scores={"acc": 1}, resps=[[["-1.5", "False"]]],
                arguments={"gen_args_0": {"arg_0": "p" * 1000, "arg_1": " yes"}},
                requests=[{"kind": "loglikelihood", "prompt_tokens": 9, "output_tokens": 0, "output_ids": None,
                           "truncated_tokens": 0, "extra": {"continuation_tokens": 1}}], prompt="p" * 1000)
    named = {**line(1, metrics=["scores"]), "scores": [1, 2]}
    record = {"prompt_tokens": 9, "output_tokens": 2, "output_ids": [5, 6], "truncated_tokens": 0, "clamped": False}
    generation = line(2, raw_output=" Thirteen", resps=[[" Thirteen"]],
                      arguments={"gen_args_0": {"arg_0": "p" * 1000, "arg_1": {"until": ["\n"]}}},
                      requests=[{"kind": "loglikelihood", **record}, {"kind": "loglikelihood", **record},
                                {"kind": "generate_until", **record}])
    file = tmp_path / "samples_t.jsonl"
    file.write_text("".join(json.dumps(s) + "\n" for s in (full, named, generation)))
    read = on_disk.read_samples(file, "t")
    dropped = ("doc", "filtered_resps", "scores", "resps")
    assert read[(0, "none")] == {**{k: v for k, v in full.items() if k not in dropped},
                                 sample_index.LOGPROBS: [-1.5], "arguments": {"gen_args_0": {"arg_1": " yes"}},
                                 "requests": [{"kind": "loglikelihood", "prompt_tokens": 9, "output_ids": None,
                                               "truncated_tokens": 0}]}
    assert read[(1, "none")]["scores"] == [1, 2]
    assert sample_index.choice_logprobs(read[(0, "none")]) == [-1.5]
    assert sample_index.choice_logprobs(read[(2, "none")]) is None  # resps: the generation's text, not a number
    kept_whole = {**line(3, metrics=["resps"]), "resps": [[["-2.5", "False"]]]}
    other = tmp_path / "samples_u.jsonl"
    other.write_text(json.dumps(kept_whole) + "\n")
    named_resps = on_disk.read_samples(other, "u")[(3, "none")]
    assert named_resps["resps"] == kept_whole["resps"] and sample_index.choice_logprobs(named_resps) == [-2.5]
    kept = {k: v for k, v in record.items() if k in ("prompt_tokens", "output_ids", "truncated_tokens")}
    assert "arguments" not in read[(2, "none")]  # the page shows a generation's output, not its arguments
    assert read[(2, "none")]["requests"] == [{"kind": "loglikelihood", **kept}, {"kind": "generate_until", **kept}]


def test_a_samples_file_is_held_in_less_than_its_size(tmp_path):
    """Python objects of whole lines cost several times the file (3.7x for these multiple-choice lines, with the
    file's text besides); the records compare holds, and the reading itself (a line at a time), stay near the
    file's size (0.95x here; the bound leaves room for another Python's object sizes)."""
    lines = [line(i, doc={"question": f"Question {i}: " + "word " * 40, "choices": ["a", "b", "c", "d"]},
                  arguments={f"gen_args_{j}": {"arg_0": f"Question {i}: " + "word " * 40, "arg_1": f" {c}"}
                             for j, c in enumerate("abcd")},
                  resps=[[[str(-1.5 - j), "False"]] for j in range(4)],
                  filtered_resps=[[str(-1.5 - j), "False"] for j in range(4)], prompt=f"Question {i}: " + "word " * 40,
                  requests=[{"kind": "loglikelihood", "prompt_tokens": 24, "output_tokens": 0, "finish_reason": None,
                             "raw_output": None, "output_ids": None, "requested_max_tokens": None, "max_tokens": None,
                             "clamped": False, "truncated_tokens": 0, "extra": {"continuation_tokens": 1}}] * 4)
             for i in range(3000)]
    file = tmp_path / "samples_t.jsonl"
    file.write_text("".join(json.dumps(s) + "\n" for s in lines))
    tracemalloc.start()
    try:
        read = on_disk.read_samples(file, "t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(read) == 3000 and peak < 1.3 * file.stat().st_size, (peak, file.stat().st_size)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Runs of every kind of row: generations that flip (exact_match), log-likelihood choices, an undirected
    metric, perplexity, a group."""
    tmp = tmp_path_factory.mktemp("mixed")
    tasks = ["evalkit_cmp_undirected", "evalkit_cmp_rolling", "evalkit_cmp_group"]
    return {"ref": fake_run(tmp, "a", FakeEngine()), "broken": fake_run(tmp, "b", FakeEngine(reply=" 13")),
            "task_ref": task_run(tmp, "c", FakeEngine(), tasks), "task_cand": task_run(tmp, "d", FakeEngine(reply=" 7"),
                                                                                     tasks)}


@pytest.mark.parametrize("reference, candidate", [("ref", "broken"), ("task_ref", "task_cand")])
def test_the_reports_from_held_records_are_the_reports_from_whole_lines(mixed, tmp_path, monkeypatch, capsys,
                                                                         reference, candidate):
    """The whole output of compare (the terminal's table, the text report, the HTML page with the documents that
    changed) is the same whether each sample is held whole or as the records compare holds."""
    def outputs(name):
        code = cli.main([str(mixed[reference]), str(mixed[candidate]), "--output", str(tmp_path / name)])
        files = {p.name: p.read_text() for p in sorted((tmp_path / name).iterdir()) if p.suffix in (".md", ".html")}
        return code, capsys.readouterr().out.replace(str(tmp_path / name), "OUT"), files

    held = outputs("held")
    monkeypatch.setattr(on_disk, "held", lambda sample, seen: sample)
    whole = outputs("whole")
    assert held[2] and held[0] == whole[0] and held[1] == whole[1]
    assert {k: v.replace(str(tmp_path / "held"), "OUT") for k, v in held[2].items()} == \
        {k: v.replace(str(tmp_path / "whole"), "OUT") for k, v in whole[2].items()}
