"""The divergence record of a run, task by task, from the harness's request records (pure: results.py writes it).

Each record's traces (evalkit/harness/divergence_traces.py) become :class:`~evalkit.run.divergence_record.Row`s,
one per traced request: lm-eval's document and request number, the kind, the positions scored, and the ids read
apart at them where the run was given a reference (``TokenTrace.given``). ``divergence_record.build`` then checks
every row against its request as it makes the columns.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from evalkit.contracts import RequestRecord
from evalkit.run.divergence_record import Positions, Row, build


def task_rows(records: dict[tuple[str, int], list[RequestRecord]]) -> dict[str, list[Row]]:
    """task -> the rows of its traced requests, by document and then in request order."""
    rows: dict[str, list[Row]] = defaultdict(list)
    for (task, doc_id), recs in sorted(records.items(), key=lambda item: (item[0][0], item[0][1])):
        for record in recs:
            for number, request, trace in record.traced:
                rows[task].append(Row(
                    doc_id=doc_id, request=number, kind=record.kind, start=max(request.start, 1),
                    ids=request.ids, text_logprobs=trace.logprobs, top=trace.top, given=trace.given))
    return dict(rows)


def task_positions(records: dict[tuple[str, int], list[RequestRecord]], top_k: int) -> dict[str, Positions]:
    """task -> its columns, for each task with at least one traced position."""
    return {task: build(rows, top_k) for task, rows in task_rows(records).items()
            if any(len(row.ids) > row.start for row in rows)}


def section(summary: dict[str, Any] | None, built: dict[str, Positions],
            sizes: dict[str, int]) -> dict[str, Any]:
    """results.json's ``evalkit.divergence``: the harness's summary of its traces (top_k, what was recorded per
    kind, requests and positions traced, what was not recorded, the largest |Σ trace − score| per kind) with,
    per task, the positions and documents written and the file's bytes per position."""
    if not summary or not summary.get("top_k"):
        return summary or {"top_k": 0, "recorded": "nothing: divergence_top_k=0"}
    return {**summary,
            "positions": {task: len(p) for task, p in built.items()},
            "documents": {task: len(set(p.doc_id.tolist())) for task, p in built.items()},
            "bytes_per_position": {task: round(sizes[task] / len(p), 1) for task, p in built.items() if len(p)}}
