"""Where fastgrpo's artifacts lie on disk, and how a command tells one is there: the one place their names
and places are spelled ([checkpoints.md](../docs/checkpoints.md)).

- A policy is a Hugging Face checkpoint directory: it is there when its `config.json` is (`model.path`,
  which `fastgrpo sft` builds; a training checkpoint's `policy/`).
- The draft head is `draft.safetensors` (and `draft_config.json`) in `draft.path`, else next to the
  policy in `model.path` (`fastgrpo draft-pretrain` writes it there).
- A training checkpoint (`step_N/`) holds the Hugging Face policy in `policy/` (the trainer's weights,
  rank 0's tokenizer) and the draft learner's state in `draft/`.

Only names and places: nothing here reads a file, so every side (commands, setup, trainers, engines,
conversion, benchmarks) imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastgrpo.config import Config

HF_CONFIG = "config.json"  # a Hugging Face checkpoint's config: the file that says a policy is there
DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_CONFIG = "draft_config.json"
CHECKPOINT_POLICY = "policy"  # in a training checkpoint: the Hugging Face policy
CHECKPOINT_DRAFT = "draft"  # in a training checkpoint: the draft learner's state


def hf_config(path: str | Path) -> Path:
    """The `config.json` of the checkpoint directory `path`; `path` itself if it names a file."""
    path = Path(path)
    return path / HF_CONFIG if path.is_dir() else path


def is_policy(directory: str | Path) -> bool:
    """A Hugging Face policy is at `directory` (its config.json is)."""
    return (Path(directory) / HF_CONFIG).is_file()


def draft_dir(cfg: Config) -> Path:
    """Where the run's draft head is: `draft.path`, else next to the policy (`model.path`)."""
    return Path(cfg.draft.path or cfg.model.path)


def draft_weights(directory: str | Path) -> Path:
    """The draft head's weights file in `directory`."""
    return Path(directory) / DRAFT_WEIGHTS


def has_draft(directory: str | Path) -> bool:
    """A draft head is in `directory` (its weights file is)."""
    return draft_weights(directory).is_file()


def checkpoint_policy(checkpoint: str | Path) -> Path:
    """A training checkpoint's Hugging Face policy directory."""
    return Path(checkpoint) / CHECKPOINT_POLICY


def checkpoint_draft(checkpoint: str | Path) -> Path:
    """A training checkpoint's draft-learner state directory."""
    return Path(checkpoint) / CHECKPOINT_DRAFT


def policy_in(path: str | Path) -> Path:
    """The policy `path` names: a training checkpoint's `policy/` when it holds one, else `path` itself
    (a policy directory)."""
    path = Path(path)
    return checkpoint_policy(path) if is_policy(checkpoint_policy(path)) else path
