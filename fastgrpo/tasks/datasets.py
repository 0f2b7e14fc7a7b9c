"""Real datasets (GSM8K-style) in JSONL or Parquet: rows with a `prompt` and an `answer`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastgrpo.tasks.problems import Problem

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset that cannot be used; the message says which file and why."""


@dataclass
class LoadReport:
    path: str
    rows: int
    used: int
    malformed: int


def _problem(row: Any) -> Problem | None:
    if not isinstance(row, dict):
        return None
    prompt, answer = row.get("prompt"), row.get("answer")
    if not isinstance(prompt, str) or not prompt.strip() or answer is None or isinstance(answer, (dict, list, bool)):
        return None
    answer = str(answer)
    if "####" in answer:  # GSM8K: worked solution, then '#### 42'
        answer = answer.rsplit("####", 1)[1]
    answer = answer.strip()
    return Problem(prompt, answer) if answer else None


def _rows(path: Path) -> list[Any]:
    if path.suffix == ".jsonl":
        rows: list[Any] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    rows.append(None)
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")


def load_problems(path: str | Path) -> tuple[list[Problem], LoadReport]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    rows = _rows(path)
    problems = [p for p in map(_problem, rows) if p is not None]
    report = LoadReport(str(path), len(rows), len(problems), len(rows) - len(problems))
    if report.malformed:
        log.warning("%s: skipped %d malformed rows of %d (need a string 'prompt' and an 'answer')",
                    path, report.malformed, report.rows)
    if not problems:
        raise DatasetError(f"{path}: no usable rows found ({report.rows} rows, {report.malformed} malformed)")
    return problems, report
