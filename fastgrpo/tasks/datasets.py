"""Datasets as people have them: a row's prompt and gold answer, from local files in the common layouts.

Files: JSON lines (`.jsonl`, or `.json` holding JSON lines or one array of rows), Parquet, Arrow (a
stream or a file, as Hugging Face datasets writes them), or a directory written by `datasets`'
`save_to_disk` (read with `datasets.load_from_disk`: the hub is never asked). One rule for every layout:

- **Where**: `task.prompt_key` and `task.answer_key`, dotted paths into nested fields
  (`reward_model.ground_truth`). Left empty, each is guessed from the rows: of PROMPT_KEYS and
  ANSWER_KEYS, the one present in the most rows (ties to the earlier), which covers GSM8K (`question`,
  `answer`), MATH (`problem`, `solution`), MATH-500 (`problem`, `answer`), veRL's parquet (`prompt` as chat
  messages, `reward_model.ground_truth`) and fastgrpo's own (`prompt`, `answer`). A guess is logged.
- **A prompt** is a non-empty string (written by `task.prompt_format`, fastgrpo.models.tokenizer.TextFormat)
  or a non-empty list of chat messages `{role, content}` (both strings), which go through the checkpoint's
  chat template as they are.
- **An answer** is a string or a number. Text after the last `####` is GSM8K's final answer; a `\\boxed{}`
  in the text (a MATH solution) is reduced to the last boxed content, as the reward reduces a response
  (fastgrpo.tasks.rewards.extract_answer), so the gold and the response are compared alike. A field
  named `solution` is a worked solution: without `####` or `\\boxed{}` it names no answer, and the row
  is skipped rather than its whole text taken as the gold answer.

Rows that fail are skipped and counted (LoadReport); with none left the error names the file, the keys
expected, the first failing row's place (its line in a JSON-lines file, else its row, both from 1) and
the keys it has, which is what a user needs to set the keys or fix the file.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastgrpo.tasks.problems import Message, Problem, Prompt

log = logging.getLogger(__name__)

# what an unset task.prompt_key / task.answer_key looks for, in order of preference
PROMPT_KEYS = ("prompt", "question", "problem")
ANSWER_KEYS = ("answer", "ground_truth", "reward_model.ground_truth", "solution")
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
_PROMPT_RULE = "a non-empty string or a list of chat messages {role, content}"
_ANSWER_RULE = "a string or a number"


class DatasetError(ValueError):
    """A dataset that cannot be used; the message says which file and why."""


@dataclass
class LoadReport:
    """What loading one file found: rows read, used and skipped (malformed), the keys read and whether
    they were guessed, how many prompts are chat messages, and the first skipped row's description."""

    path: str
    rows: int
    used: int
    malformed: int
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    guessed: bool = False
    chat_prompts: int = 0
    first_bad: str = ""


@dataclass
class _Row:
    where: str  # "line 3" (JSON lines) or "row 3", counted from 1
    value: Any  # the parsed row; _UNPARSED where the line is not JSON


_UNPARSED = object()
_MISSING = object()


class _Why(str):
    """Why a field's value is no prompt or answer (a plain str is the prompt or answer itself)."""


def _read_json(path: Path) -> list[_Row]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON ({e})") from e
        return [_Row(f"row {i}", r) for i, r in enumerate(rows, 1)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(_Row(f"line {n}", json.loads(line)))
            except json.JSONDecodeError:
                out.append(_Row(f"line {n}", _UNPARSED))
    return out


def _read_arrow(path: Path) -> list[dict[str, Any]]:
    """An Arrow IPC stream (what `datasets` writes) or an Arrow IPC file."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all().to_pylist()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all().to_pylist()


def _read_saved(path: Path) -> list[dict[str, Any]]:
    """A directory of `datasets.Dataset.save_to_disk`; a DatasetDict's root names its splits instead."""
    splits = path / "dataset_dict.json"
    if splits.is_file():
        names = json.loads(splits.read_text()).get("splits", [])
        raise DatasetError(f"{path}: a DatasetDict with splits {', '.join(names)}; point task.source (and "
                           f"task.eval_source) at one split's directory, e.g. {path / (names or ['train'])[0]}")
    if not (path / "state.json").is_file():
        raise DatasetError(f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json); "
                           f"give a {' / '.join(SUFFIXES)} file or such a directory")
    import datasets

    return datasets.load_from_disk(str(path)).with_format(None).to_list()


def _read_rows(path: str | Path) -> list[_Row]:
    """Every row of the dataset at `path`, each with its place in the file; a missing path or an unknown
    format is a DatasetError naming it."""
    path = Path(path)
    if path.is_dir():
        return [_Row(f"row {i}", r) for i, r in enumerate(_read_saved(path), 1)]
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix == ".arrow":
        rows = _read_arrow(path)
    else:
        raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; use {', '.join(SUFFIXES)} "
                           f"or a directory written by datasets' save_to_disk")
    return [_Row(f"row {i}", r) for i, r in enumerate(rows, 1)]


def _field(row: Any, key: str) -> Any:
    """The value at `key` in `row`: a top-level field of that exact name, else the dotted path through
    nested objects (`reward_model.ground_truth`); _MISSING where there is none."""
    if not isinstance(row, dict):
        return _MISSING
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _missing(row: dict[str, Any], key: str) -> str:
    """Why `key` is not in `row`; for a nested path, the keys found where it stops."""
    value, parts = row, key.split(".")
    for i, part in enumerate(parts):
        if i and not isinstance(value, dict):
            return f"no {key!r} ({'.'.join(parts[:i])!r} is {type(value).__name__}, not an object)"
        if part not in value:
            inner = f" ({'.'.join(parts[:i])!r} has keys {', '.join(map(repr, value)) or 'none'})" if i else ""
            return f"no {key!r}{inner}"
        value = value[part]
    return f"no {key!r}"


def _prompt(value: Any) -> Prompt | _Why:
    """The prompt, or why `value` is none. Messages keep their role and content (what a template reads)."""
    if isinstance(value, str):
        return value if value.strip() else _Why("is an empty string")
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        messages: list[Message] = []
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return _Why(f"is a list, but not of chat messages {{role, content}} (found {str(m)[:80]})")
            messages.append({"role": m["role"], "content": m["content"]})
        return messages if messages else _Why("is an empty list")
    return _Why(f"is {type(value).__name__}, not {_PROMPT_RULE}")


def _answer(value: Any, worked: bool) -> str:
    """The gold answer, or (a _Why) why `value` is none. See the module's docstring."""
    from fastgrpo.tasks.rewards import extract_answer

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return _Why(f"is {type(value).__name__}, not {_ANSWER_RULE}")
    if isinstance(value, float) and not math.isfinite(value):
        return _Why(f"is {value}, not a finite number")
    text = str(value)
    if "####" in text:  # GSM8K: worked solution, then '#### 42'
        text = text.rsplit("####", 1)[1]
    elif "\\boxed" in text:  # MATH: a worked solution whose answer is boxed
        boxed = extract_answer(text)
        if boxed is None:
            return _Why("has a \\boxed{ that does not close")
        text = boxed
    elif worked:
        return _Why("is a worked solution with no \\boxed{} or #### answer in it")
    return text.strip() or _Why("is empty")


def _choose(rows: list[_Row], configured: str, candidates: tuple[str, ...]) -> str | None:
    """`configured`, or the candidate present in the most rows (ties to the earlier); None if none is."""
    if configured:
        return configured
    counts = [sum(_field(r.value, key) is not _MISSING for r in rows) for key in candidates]
    best = max(range(len(candidates)), key=lambda i: (counts[i], -i))
    return candidates[best] if counts[best] else None


def _keys_of(row: _Row) -> str:
    if row.value is _UNPARSED:
        return "not valid JSON"
    if not isinstance(row.value, dict):
        return f"{type(row.value).__name__}, not an object"
    return f"keys {', '.join(map(repr, row.value)) or 'none'}"


def _sample(rows: list[_Row]) -> _Row:
    return next((r for r in rows if isinstance(r.value, dict)), rows[0])


def _problem(row: _Row, prompt_key: str, answer_key: str) -> Problem | str:
    """The row's problem, or why it has none: its place, its keys, what is wrong."""
    if not isinstance(row.value, dict):
        return f"{row.where} ({_keys_of(row)})"
    reasons = []
    raw_prompt, raw_answer = _field(row.value, prompt_key), _field(row.value, answer_key)
    prompt = _prompt(raw_prompt) if raw_prompt is not _MISSING else None
    answer = (_answer(raw_answer, answer_key.rsplit(".", 1)[-1] == "solution")
              if raw_answer is not _MISSING else None)
    if prompt is None:
        reasons.append(_missing(row.value, prompt_key))
    elif isinstance(prompt, _Why):
        reasons.append(f"{prompt_key!r} {prompt}")
    if answer is None:
        reasons.append(_missing(row.value, answer_key))
    elif isinstance(answer, _Why):
        reasons.append(f"{answer_key!r} {answer}")
    if reasons:
        return f"{row.where} ({_keys_of(row)}): {'; '.join(reasons)}"
    return Problem(prompt, answer)  # type: ignore[arg-type]


def _expected(prompt_key: str | None, answer_key: str | None) -> str:
    p = repr(prompt_key) if prompt_key else f"one of {', '.join(map(repr, PROMPT_KEYS))}"
    a = repr(answer_key) if answer_key else f"one of {', '.join(map(repr, ANSWER_KEYS))}"
    return (f"each row needs a prompt at {p} ({_PROMPT_RULE}) and an answer at {a} ({_ANSWER_RULE}); "
            f"task.prompt_key / task.answer_key name other fields (dotted paths for nested ones, "
            f"e.g. reward_model.ground_truth)")


def load_problems(path: str | Path, prompt_key: str = "", answer_key: str = "") -> tuple[list[Problem], LoadReport]:
    """The problems of the dataset at `path` (see the module's docstring for the rule) and what loading
    found; rows that fail are skipped, counted and the first of them described in a warning. A missing
    path, an unknown format, no prompt or answer field in any row, or no usable row is a DatasetError
    naming the file, the keys expected, and the first failing row's place and keys."""
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    p_key, a_key = _choose(rows, prompt_key, PROMPT_KEYS), _choose(rows, answer_key, ANSWER_KEYS)
    if p_key is None or a_key is None:
        sample = _sample(rows)
        raise DatasetError(f"{path}: no row has a {'prompt' if p_key is None else 'answer'} field: "
                           f"{_expected(p_key, a_key)}. The first row, {sample.where}, has {_keys_of(sample)}")
    guessed = not (prompt_key and answer_key)
    if guessed:  # said, so that a wrong guess shows
        log.warning("%s: prompts from %r%s, answers from %r%s (task.prompt_key / task.answer_key choose)", path,
                    p_key, "" if prompt_key else " (guessed)", a_key, "" if answer_key else " (guessed)")
    problems: list[Problem] = []
    first_bad = ""
    for row in rows:
        got = _problem(row, p_key, a_key)
        if isinstance(got, Problem):
            problems.append(got)
        elif not first_bad:
            first_bad = got
    report = LoadReport(str(path), len(rows), len(problems), len(rows) - len(problems), p_key, a_key, guessed,
                        sum(not isinstance(p.prompt, str) for p in problems), first_bad)
    if not problems:
        raise DatasetError(f"{path}: no usable rows found ({report.rows} rows, {report.malformed} malformed): "
                           f"{_expected(p_key, a_key)}. The first skipped: {first_bad}")
    if report.malformed:
        log.warning("%s: skipped %d malformed rows of %d; the first: %s", path, report.malformed, report.rows,
                    first_bad)
    return problems, report
