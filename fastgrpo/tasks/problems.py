from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

Message: TypeAlias = dict[str, str]  # a chat message: {"role": ..., "content": ...}
# a text prompt (written by task.prompt_format), or chat messages (through the chat template as they are)
Prompt: TypeAlias = str | list[Message]


@dataclass(frozen=True)
class Problem:
    prompt: Prompt
    answer: str
    solution: str | None = None  # worked solution (synthetic task only; used for SFT)
