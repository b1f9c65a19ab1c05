"""The reference run a candidate reads its divergence record against (``divergence_reference=RUN``).

Where an engine gives only its top-k, compare's bound sees the tokens known on both sides: a token in the
reference's top-k but not in the candidate's falls into the rest bucket, and the bound loses what it carries
(docs/divergence.md). A candidate run given the reference folder looks up, at each position it traces, the
reference's top ids recorded at the same context (by the context key of evalkit/run/divergence_record.py: the
context's token ids, never the document and position), and the harness reads the ones its own top-k left out
(``Engine.read_ids``). The ids are the reference's best first; a context the reference did not record (a
generation after the two outputs part, a document only one run has) asks nothing.

The folder is read before the engine starts, and every fault is one line naming it (a ConfigError): the
folder may come from another machine, so a file it names is read only inside it and within
untrusted.file_limit().
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalkit.config import ConfigError
from evalkit.contracts import ScoreRequest
from evalkit.run import divergence_record
from evalkit.untrusted import OutsideFolder, TooLarge, inside, json_data, printable, read_bounded


@dataclass(frozen=True)
class Reference:
    """A reference run's top ids by context key, and what names it in the candidate's results.json."""

    run: str  # "<model folder>/<run folder>", as compare names a run
    run_id: str  # the reference's evalkit.run_id: compare uses the ids read only against this run
    k: int  # the top-k the reference recorded
    top: dict[int, tuple[int, ...]]  # context key -> the reference's top ids there, best first

    def ids(self, request: ScoreRequest) -> list[tuple[int, ...] | None]:
        """Per scored position of request (ids[max(start, 1):]), the reference's top ids after that context, or
        None where the reference recorded no such context."""
        return [self.top.get(key) for key in divergence_record.context_keys(request.ids, max(request.start, 1))]

    def describe(self) -> dict[str, Any]:
        return {"run": self.run, "run_id": self.run_id, "top_k": self.k, "contexts": len(self.top)}


def _results(folder: Path) -> dict[str, Any]:
    where = folder / "results.json"
    try:
        return json_data(read_bounded(inside(folder, "results.json")).decode("utf-8"))
    except OutsideFolder as error:
        raise ConfigError(f"divergence_reference={folder}: {error}; a run folder holds its own "
                          "results") from None
    except FileNotFoundError:
        raise ConfigError(f"divergence_reference={folder}: no results.json there; name a run folder "
                          "(result/<model>/<run id>)") from None
    except TooLarge as error:
        raise ConfigError(f"divergence_reference={folder}: {error}") from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError and json's errors are ValueErrors
        raise ConfigError(f"divergence_reference={folder}: its results.json cannot be read ({error})") from None


def load(path: str) -> Reference:
    """The reference run at path (a run folder): its top ids by context, over all its tasks."""
    folder = Path(path).expanduser()
    section = _results(folder).get("evalkit") or {}
    names = (section.get("files") or {}).get("divergence")
    run_id = section.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError(f"divergence_reference={folder}: its results.json has no evalkit.run_id (not a run of "
                          "evalkit's, or a damaged one)")
    if not isinstance(names, dict) or not names:
        raise ConfigError(f"divergence_reference={folder}: the run recorded no divergence (divergence_top_k=0); "
                          "rerun it with divergence_top_k=20")
    top: dict[int, tuple[int, ...]] = {}
    ks = []
    for task, name in sorted(names.items()):
        try:
            rows = divergence_record.read(inside(folder, name))
        except OutsideFolder as error:
            raise ConfigError(f"divergence_reference={folder}: task {printable(task)}'s divergence file {error}; "
                              "a run folder names only its own files") from None
        except ValueError as error:
            raise ConfigError(f"divergence_reference: task {printable(task)}: {error}") from None
        ks.append(rows.k)
        for key, ids in zip(rows.context.tolist(), rows.top_ids.tolist()):
            top.setdefault(key, tuple(t for t in ids if t != divergence_record.PAD))
    return Reference(run=f"{folder.resolve().parent.name}/{folder.resolve().name}", run_id=run_id,
                     k=min(ks), top=top)
