"""A samples file's index (evalkit/run/sample_index.py): what a run writes beside each samples file, and compare
reads instead of the file's JSON only where it was made from those very bytes. Read from the index or from the
file, a run is the same to compare; an index that is stale, damaged, of another format, named outside the folder
or unable to hold a line exactly is passed over (or never written), and the file read as ever.
Run: pytest tests/test_sample_index.py
"""

import json

import pytest

from evalkit.compare import runs as on_disk
from evalkit.run import sample_index
from tests.fake_engine import FakeEngine
from tests.test_compare import fake_run
from tests.test_compare_read import BIG, TRICKY, line


def written(tmp_path, lines):
    """A samples file of lines and its index (sample_index.write's answer too)."""
    file, index = tmp_path / "samples_t.jsonl", tmp_path / "samples_t.index.msgpack"
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return file, index, sample_index.write(file, index)


EXACT = [text for text in TRICKY if str(BIG) not in text and "ud800" not in text]  # what msgpack carries exactly


def test_read_from_the_index_a_file_is_what_its_json_reads(tmp_path, monkeypatch):
    file, index, wrote = written(tmp_path, EXACT)
    assert wrote
    from_file = on_disk.read_samples(file, "t")
    monkeypatch.setattr(on_disk, "_lines", lambda *a: pytest.fail("the samples file was parsed"))
    from_index = on_disk.read_samples(file, "t", index)
    assert repr(from_index) == repr(from_file)  # repr: NaN, the integers' types and digits, the floats' bits
    assert from_index[(4, "none")]["raw_output"] == "a\u2028b\u2029c\x85d"


@pytest.mark.parametrize("kept", [str(BIG), "ud800"])
def test_no_index_for_an_integer_past_64_bits_or_a_lone_surrogate_and_the_file_is_read(tmp_path, kept):
    file, index, wrote = written(tmp_path, EXACT + [text for text in TRICKY if kept in text])
    assert not wrote and not index.exists()
    read = on_disk.read_samples(file, "t", index)
    assert read[(BIG, "none")]["acc"] == BIG if kept == str(BIG) else read[(5, "none")]["raw_output"][0] == "\ud800"


def test_no_index_for_a_file_compare_refuses(tmp_path):
    file, index, wrote = written(tmp_path, [json.dumps(line(0)), '{"doc_id": 1, "acc": ', json.dumps(line(2))])
    assert not wrote and not index.exists()
    with pytest.raises(on_disk.CompareError, match="line 2: not JSON"):
        on_disk.read_samples(file, "t", index)


def edited(file):
    """file with one document's score changed, its size the same."""
    text = file.read_text(encoding="utf-8")
    file.write_text(text.replace('"acc": 1,', '"acc": 0,', 1), encoding="utf-8")
    assert file.read_text(encoding="utf-8") != text


def truncated(index):
    index.write_bytes(index.read_bytes()[:-7])


def other_format(index):
    found = sample_index._DECODER.decode(index.read_bytes())
    found.format = "evalkit sample index 0"
    index.write_bytes(sample_index.msgspec.msgpack.encode(found))


def doubled(index):
    """An index whose recorded bytes are the file's but that holds a document twice (a damaged index)."""
    found = sample_index._DECODER.decode(index.read_bytes())
    for column in (found.lines, found.logprobs, found.arguments_of, found.metrics_of):
        column.append(column[0])
    index.write_bytes(sample_index.msgspec.msgpack.encode(found))


def misplaced(index):
    """An index whose recorded bytes are the file's but whose shared arguments point past their table."""
    found = sample_index._DECODER.decode(index.read_bytes())
    found.arguments_of[1] = len(found.arguments)
    found.lines[1]["arguments"] = None
    index.write_bytes(sample_index.msgspec.msgpack.encode(found))


@pytest.mark.parametrize("damage", ["samples edited", "index truncated", "index of another format",
                                    "index holds a document twice", "index's shared arguments misplaced",
                                    "index removed", "index is a folder"])
def test_an_index_not_made_from_these_bytes_is_passed_over(tmp_path, damage):
    file, index, _ = written(tmp_path, [json.dumps(line(i)) for i in range(5)])
    {"samples edited": lambda: edited(file), "index truncated": lambda: truncated(index),
     "index of another format": lambda: other_format(index), "index holds a document twice": lambda: doubled(index),
     "index's shared arguments misplaced": lambda: misplaced(index),
     "index removed": index.unlink, "index is a folder": lambda: (index.unlink(), index.mkdir())}[damage]()
    assert repr(on_disk.read_samples(file, "t", index)) == repr(on_disk.read_samples(file, "t"))
    if damage == "samples edited":
        assert on_disk.read_samples(file, "t", index)[(0, "none")]["acc"] == 0


def test_an_index_is_believed_when_bound_to_the_files_bytes(tmp_path):
    """What a bound index holds is what compare reads: it is the run's own record of its file (docs/security.md)."""
    file, index, _ = written(tmp_path, [json.dumps(line(i)) for i in range(3)])
    found = sample_index._DECODER.decode(index.read_bytes())
    found.lines[1]["acc"] = 0
    index.write_bytes(sample_index.msgspec.msgpack.encode(found))
    assert on_disk.read_samples(file, "t", index)[(1, "none")]["acc"] == 0
    assert on_disk.read_samples(file, "t")[(1, "none")]["acc"] == 1


def test_a_bound_index_of_odd_values_is_read_as_a_file_of_them_would_be(tmp_path):
    file, index, _ = written(tmp_path, [json.dumps(line(i)) for i in range(3)])
    found = sample_index._DECODER.decode(index.read_bytes())
    found.lines[0]["metrics"], found.lines[1]["metrics"] = [{"not": "a name"}], "acc"
    found.metrics_of[:2] = [-1, -1]  # the lines' own, not the shared list of names
    index.write_bytes(sample_index.msgspec.msgpack.encode(found))
    read = on_disk.read_samples(file, "t", index)
    assert read[(0, "none")]["metrics"] == [{"not": "a name"}] and read[(1, "none")]["metrics"] == "acc"


def test_choices_shared_by_documents_are_held_once_and_read_back_shared(tmp_path, monkeypatch):
    """A multiple-choice task whose documents offer the same choices (" A" to " D") holds them once in the index,
    and compare reads them back as one object, as from the file (so too each document's list of metrics); each
    choice's log-likelihood is a number."""
    def choices(i, texts):
        return line(i, arguments={f"gen_args_{j}": {"arg_0": f"Question {i}", "arg_1": t} for j, t in enumerate(texts)},
                    resps=[[[str(-1.0 - j - i / 8), "False"]] for j in range(len(texts))], raw_output=None)
    letters, others = [" A", " B", " C", " D"], [["x", "y"], ["u", "v"]]
    lines = [choices(i, letters) for i in range(4)] + [choices(4 + i, texts) for i, texts in enumerate(others)]
    file, index, wrote = written(tmp_path, [json.dumps(sample) for sample in lines])
    found = sample_index._DECODER.decode(index.read_bytes())
    assert wrote and found.arguments == [{f"gen_args_{j}": {"arg_1": t} for j, t in enumerate(letters)}]
    assert found.arguments_of == [0, 0, 0, 0, -1, -1] and found.logprobs[5] == [-1.625, -2.625]
    assert found.metrics == [["acc"]] and found.metrics_of == [0] * 6 and found.lines[0]["metrics"] is None
    from_file = on_disk.read_samples(file, "t")
    monkeypatch.setattr(on_disk, "_lines", lambda *a: pytest.fail("the samples file was parsed"))
    from_index = on_disk.read_samples(file, "t", index)
    assert repr(from_index) == repr(from_file)
    for read in (from_file, from_index):
        assert all(read[(i, "none")]["arguments"] is read[(0, "none")]["arguments"] for i in range(4))
        assert all(read[(i, "none")]["metrics"] is read[(0, "none")]["metrics"] for i in range(6))
        assert sample_index.choice_logprobs(read[(5, "none")]) == [-1.625, -2.625]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return fake_run(tmp_path_factory.mktemp("indexed"), "a", FakeEngine())


def test_a_run_names_an_index_per_samples_file_and_compare_reads_the_same_run_with_or_without(run, tmp_path,
                                                                                             monkeypatch):
    files = json.loads((run / "results.json").read_text())["evalkit"]["files"]
    assert set(files["sample_index"]) == set(files["samples"]) and files["sample_index"]
    for task, name in files["sample_index"].items():
        assert name == files["samples"][task].removesuffix(".jsonl") + ".index.msgpack" and (run / name).is_file()
    without = on_disk.load_run(run)
    monkeypatch.setattr(on_disk, "_lines", lambda *a: pytest.fail("a samples file was parsed"))
    indexed = on_disk.load_run(run)
    assert repr(indexed.samples) == repr(without.samples) and indexed.results == without.results


def test_an_index_named_outside_the_run_folder_is_passed_over(run, tmp_path):
    copy = tmp_path / "m" / "copy"
    copy.mkdir(parents=True)
    results = json.loads((run / "results.json").read_text())
    for name in results["evalkit"]["files"]["samples"].values():
        (copy / name).write_bytes((run / name).read_bytes())
    elsewhere = tmp_path / "elsewhere.index.msgpack"
    task, name = next(iter(results["evalkit"]["files"]["sample_index"].items()))
    elsewhere.write_bytes((run / name).read_bytes())
    results["evalkit"]["files"]["sample_index"] = {task: str(elsewhere)}  # absolute: outside
    (copy / "results.json").write_text(json.dumps(results))
    assert repr(on_disk.load_run(copy).samples) == repr(on_disk.load_run(run).samples)


def test_an_index_above_the_file_limit_is_passed_over_undecoded(tmp_path, monkeypatch):
    file, index, _ = written(tmp_path, [json.dumps(line(i)) for i in range(3)])
    monkeypatch.setenv("EVALKIT_FILE_LIMIT_GIB", str(index.stat().st_size / 2**30 / 2))
    monkeypatch.setattr(sample_index, "_DECODER", None)  # decoding it would fail otherwise
    assert sample_index.read(file, index) is None
    monkeypatch.setenv("EVALKIT_FILE_LIMIT_GIB", str(index.stat().st_size / 2**30))
    with pytest.raises(AttributeError):
        sample_index.read(file, index)  # at the limit it is decoded
