"""A samples file's index: of each line, what compare reads (held), written beside the file when the run writes it
(``samples_<task>_<date>.index.msgpack``, named in results.json under ``evalkit.files.sample_index``) and bound to
the file's bytes by their size and SHA-256.

compare reads an index instead of parsing the samples file's JSON only when the file is the one it was made from
(same name, size and SHA-256, hashed on a second thread while the index is decoded); an index that is missing,
damaged, of another format or of other bytes is passed over and the samples file read as ever. An index is
therefore never needed and never changes what compare reads: it holds exactly what compare's reading of each
line holds (held, on line_value, the line as the stdlib json reads it), and none is written for a file whose lines
msgpack cannot carry exactly (an integer past 64 bits, a lone surrogate) or that compare would refuse. MessagePack
(msgspec): its decoder builds no object for what it is not asked for and has no code execution in its format,
unlike pickle. Beside the lines, in columns: each line's LOGPROBS (a key MessagePack's maps of texts cannot hold),
and the objects held shares among lines (a multiple-choice task's choices, the lists of metrics), each held once
and put back in its lines as one object: fewer objects to decode, and the same sharing as held's.
"""

from __future__ import annotations

import collections
import hashlib
import mmap
import operator
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import orjson

from evalkit.untrusted import TooLarge, file_limit, json_data, open_regular, too_large

FORMAT = "evalkit sample index 2"  # changed whenever held() keeps something else: an older index is passed over

# What compare, its pages and --locate never read of a sample line: lm-eval's copy of the document, its filtered
# responses and evalkit's per-metric copy of the scores; of the request arguments only each choice's continuation
# (arg_1), none of a generation's; of the request records the first and the generations', each cut to what --locate
# and the first divergence read. Most of a line's size, and most of what its Python objects would cost (several
# times the line), goes with them.
DROPPED = ("doc", "filtered_resps", "scores")
REQUEST_FIELDS = ("kind", "output_ids", "prompt_tokens", "truncated_tokens")
# Of lm-eval's responses (resps), compare reads only each choice's log-likelihood: held keeps them read as numbers
# under this key, which no JSON line can hold (a JSON object's keys are texts), and drops resps (choice_logprobs).
LOGPROBS = ("evalkit", "choice_logprobs")


def held(sample: dict[str, Any], seen: dict[Any, Any]) -> dict[str, Any]:
    """What compare holds of a sample line, cut in place: the line less DROPPED, its arguments and requests cut to
    what is read (a key its own metrics name is kept whole, whatever its name). seen: what the lines of a file
    share, held once (equal metrics lists, equal arguments: a multiple-choice task's choices are often the same).
    Held again, a held line is the same."""
    named = shared_metrics(sample, seen)
    if LOGPROBS not in sample:
        sample[LOGPROBS] = _logprobs(sample.get("resps") if "resps" in named else sample.pop("resps", None))
    for key in DROPPED:
        if key in sample and key not in named:
            del sample[key]
    arguments = sample.get("arguments")
    if isinstance(arguments, dict) and "arguments" not in named:
        if sample.get("raw_output") is None:
            sample["arguments"] = _arguments(arguments, seen)
        else:  # a generation's: the page shows its output, never a choice's continuation
            del sample["arguments"]
    requests = sample.get("requests")
    if isinstance(requests, list) and "requests" not in named:
        sample["requests"] = [{k: r[k] for k in REQUEST_FIELDS if k in r} if isinstance(r, dict) else r
                              for i, r in enumerate(requests)
                              if i == 0 or not isinstance(r, dict) or r.get("kind") == "generate_until"]
    return sample


def choice_logprobs(sample: dict[str, Any]) -> list[float] | None:
    """Each choice's log-likelihood lm-eval recorded in a sample's resps (resps[i][0][0] of each choice, read as a
    float; [] where resps is empty or absent), as held keeps it; None where resps is not that (a generation's text,
    damage). A sample not held (one built in memory) is read from its resps."""
    return sample[LOGPROBS] if LOGPROBS in sample else _logprobs(sample.get("resps"))


def each_choice_logprobs(samples: list[dict[str, Any]]) -> list[list[float] | None]:
    """choice_logprobs of each sample, read at once (in C) where every one is held."""
    try:
        return list(map(_HELD_LOGPROBS, samples))
    except KeyError:
        return list(map(choice_logprobs, samples))


_HELD_LOGPROBS = operator.itemgetter(LOGPROBS)


def _logprobs(resps: Any) -> list[float] | None:
    try:
        return list(map(float, map(_FIRST, map(_FIRST, resps or []))))  # [float(r[0][0]) for r in resps], in C
    except (TypeError, ValueError, IndexError, KeyError, OverflowError):  # OverflowError: an integer past 1e308
        return None


_FIRST = operator.itemgetter(0)


def shared_metrics(sample: dict[str, Any], seen: dict[Any, Any]) -> set[str] | tuple[()]:
    """The metrics a sample line names, its list of them held once per file in seen (the pairing walks each
    distinct list once); none where it names none or its list is not of names (left as it is)."""
    metrics = sample.get("metrics")
    named = set(metrics) if isinstance(metrics, list) and all(isinstance(m, str) for m in metrics) else ()
    if named:
        sample["metrics"] = seen.setdefault(("metrics", *metrics), metrics)
    return named


def _arguments(arguments: dict[str, Any], seen: dict[Any, Any]) -> dict[str, Any]:
    """lm-eval's request arguments less all but each one's arg_1 (a choice's continuation); held once per file
    where they are the same texts under the same names."""
    for args in arguments.values():
        if isinstance(args, dict) and (len(args) != 1 or "arg_1" not in args):
            for key in [k for k in args if k != "arg_1"]:
                del args[key]
    choices = [args.get("arg_1") if isinstance(args, dict) and len(args) == 1 else None for args in arguments.values()]
    if not all(isinstance(choice, str) for choice in choices):  # not texts (a generation's settings): not shared
        return arguments
    return seen.setdefault(("arguments", *arguments, *choices), arguments)


# A JSON number of 19 digits or more starts after one of :[, whitespace or -: such a line may hold an integer past
# 64 bits, which orjson reads as a float and the stdlib json exactly. Each line is mapped through TOKENS (digits to 0,
# those starters to !, the rest to x) and searched for LONG_NUMBER: a quick test of the whole line at C speed.
TOKENS = bytes(48 if 48 <= c < 58 else 33 if chr(c) in ":[, \t\r\n-" else 120 for c in range(256))
LONG_NUMBER = b"!" + b"0" * 19


def _long_number(line: bytes) -> bool:
    """Whether line may hold a number token of 19 digits or more (text that looks like one counts too)."""
    mapped = line.translate(TOKENS)
    return LONG_NUMBER in mapped or mapped.startswith(LONG_NUMBER[1:])


def _quick(line: bytes) -> Any:
    """orjson's reading of a line, or None where the stdlib json must read it: orjson refuses it (NaN, a lone
    surrogate, damage) or may read it otherwise (an integer past 64 bits), or it is JSON's null."""
    try:
        return None if _long_number(line) else orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


BLANK = object()  # line_value's answer for a line of white space, which a samples file may hold between lines


def line_value(line: bytes) -> Any:
    """The JSON value of one line of a samples file as compare reads it, and as the stdlib json reads it: orjson's
    where it reads the line as the stdlib does, else untrusted.json_data's of the line as UTF-8; BLANK where the
    line is white space (Unicode's too). UnicodeDecodeError, json.JSONDecodeError or another ValueError (untrusted.
    json_data's) where it is none of these."""
    value = _quick(line)
    if value is not None:
        return value
    text = line.decode("utf-8")
    return json_data(text) if text.strip() else BLANK


class _Bound(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    size: int
    sha256: str


class _Index(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    samples: _Bound
    lines: list[dict[str, Any]]  # held lines in order, less LOGPROBS; a shared object (below) left as None
    logprobs: list[list[float] | None]  # each line's LOGPROBS
    arguments: list[dict[str, Any]]  # the arguments objects lines share (held's seen), each once
    arguments_of: list[int]  # each line's: its place in arguments, or -1 where the line holds its own
    metrics: list[list[Any]]  # the same of the lists of metrics
    metrics_of: list[int]


_DECODER = msgspec.msgpack.Decoder(_Index)


def write(samples: Path, index: Path) -> bool:
    """Write samples' index to index (this process wrote both files); False, and nothing written, where no index
    can hold exactly what compare would read of it (module docstring)."""
    digest, lines, seen, size = hashlib.sha256(), [], {}, 0
    with open(samples, "rb") as f:
        for line in f:  # split at newlines only, as compare splits them (JSON Lines)
            digest.update(line)
            size += len(line)
            try:
                sample = line_value(line)
            except ValueError:  # UnicodeDecodeError and JSONDecodeError too: compare refuses the file
                return False
            if sample is BLANK:
                continue
            if not isinstance(sample, dict) or not isinstance(sample.get("doc_id"), int):
                return False
            lines.append(held(sample, seen))
    bound = _Bound(name=samples.name, size=size, sha256=digest.hexdigest())
    logprobs = [sample.pop(LOGPROBS) for sample in lines]
    (arguments, arguments_of), (metrics, metrics_of) = (_held_once(lines, key, seen) for key in ("arguments",
                                                                                                  "metrics"))
    try:
        data = msgspec.msgpack.encode(_Index(format=FORMAT, samples=bound, lines=lines, logprobs=logprobs,
                                             arguments=arguments, arguments_of=arguments_of, metrics=metrics,
                                             metrics_of=metrics_of))
    except (OverflowError, TypeError, ValueError):  # an integer past 64 bits, a lone surrogate (a string's
        return False  # escaped half of a pair, which MessagePack's UTF-8 cannot hold): compare reads them exactly
    index.write_bytes(data)
    return True


def _held_once(lines: list[dict[str, Any]], key: str, seen: dict[Any, Any]) -> tuple[list[Any], list[int]]:
    """(objects, places): the objects held shares under key (seen) that several lines hold, each once, and each
    line's place among them (-1: the line holds its own); such a line's object is left as None, its place."""
    shared = {id(value): value for name, value in seen.items() if name[0] == key}
    counts = collections.Counter(id(sample.get(key)) for sample in lines)
    places = {found: place for place, found in enumerate(found for found in shared if counts[found] > 1)}
    column = [places.get(id(sample.get(key)), -1) for sample in lines]
    for sample, place in zip(lines, column):
        if place >= 0:
            sample[key] = None
    return [shared[found] for found in places], column


def read(samples: Path, index: Path) -> list[dict[str, Any]] | None:
    """The held lines of samples, in order, from its index; None where the index is not there, cannot be read, or
    was not made from these bytes (module docstring): the samples file is then to be read."""
    with ThreadPoolExecutor(1) as pool:
        digest = pool.submit(_sha256, samples)  # hashlib and the file's reads let go of the GIL meanwhile
        try:
            found = _decoded(index)
        except (OSError, TooLarge, msgspec.MsgspecError, ValueError, RecursionError):
            digest.cancel()
            return None
        bound = found.samples
        if found.format != FORMAT or bound.name != samples.name:
            return None
        lines = _whole(found)  # while the file is still being hashed: its lines are kept only if it matches
        if (bound.size, bound.sha256) != digest.result():
            return None
    return lines


def _whole(found: _Index) -> list[dict[str, Any]] | None:
    """found's lines as held holds them: each line's LOGPROBS and shared objects put back (in their places), in
    one pass over the lines; None where the columns do not fit the lines (a damaged index)."""
    lines, arguments, metrics = found.lines, found.arguments, found.metrics
    columns = (found.logprobs, found.arguments_of, found.metrics_of)
    if any(len(column) != len(lines) for column in columns) or lines and not (
            -1 <= min(found.arguments_of) <= max(found.arguments_of) < len(arguments)
            and -1 <= min(found.metrics_of) <= max(found.metrics_of) < len(metrics)):
        return None
    for sample, logprobs, argument, metric in zip(lines, *columns):
        if argument >= 0:
            if sample.get("arguments", 0) is not None:  # a shared object's place holds None
                return None
            sample["arguments"] = arguments[argument]
        if metric >= 0:
            if sample.get("metrics", 0) is not None:
                return None
            sample["metrics"] = metrics[metric]
        sample[LOGPROBS] = logprobs
    return lines


def _decoded(index: Path) -> _Index:
    """The index decoded from its mapped bytes (no copy of the file; what the decoder builds copies what it keeps);
    TooLarge above file_limit(), ValueError where it is empty (mmap's)."""
    with open_regular(index) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        if len(mapped) > (limit := file_limit()):  # the bytes mapped, which are those decoded
            raise too_large(index, len(mapped), limit)
        return _DECODER.decode(mapped)


def _sha256(path: Path) -> tuple[int, str] | None:
    """(size, SHA-256) of a regular file's bytes; None where it cannot be read. The file is mapped and hashed in
    one call, which holds no GIL: hashed a block at a time, each block would wait for the GIL until the index's
    decoding, one call that holds it throughout, were done."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return 0, hashlib.sha256().hexdigest()
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return len(mapped), hashlib.sha256(mapped).hexdigest()
    except (OSError, ValueError):  # ValueError: mmap's, for a file emptied meanwhile
        return None
