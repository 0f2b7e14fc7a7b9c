"""Online draft learning: the draft keeps up with the policy on the target states that rollout
computed anyway (docs/speculation.md).

`sync` mode, as FastGRPO runs it: after each rollout the accepted-path states of every completion go
into a bounded buffer, the draft trains for a small time budget, and the engines get the new
version before the next rollout (between generate() calls, never inside a verify step).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from fastgrpo.protocols import Engine
from fastgrpo.types import Completion
from fastgrpo.config import DraftConfig
from fastgrpo.draft_learning.trainer import DraftTrainer, evaluate_draft
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.draft import TargetTensors


def training_rows(prompts: list[list[int]], completions: list[Completion]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(states, tokens, mask) per completion from its captured states; prompt positions are kept as
    context but not learned from (the draft never drafts inside a prompt). The states are kept in
    fp32 in host memory whatever the engine computed them in: the draft learner trains there in fp32."""
    rows = []
    for prompt, c in zip(prompts, completions):
        if c.hidden is None:
            raise ValueError("completion carries no hidden states: turn on the engine's capture")
        tokens = torch.tensor(prompt + c.token_ids, device="cpu")[: c.hidden.shape[0]]
        if tokens.shape[0] >= 2:
            learned = torch.arange(tokens.shape[0], device="cpu") >= len(prompt) - 1  # from the state predicting token 1
            rows.append((c.hidden.float().cpu(), tokens, learned))
    return rows


class OnlineDraftLearner:
    """`shard`, `shards`: this learner is rank `shard` of a data-parallel draft slice of `shards` ranks
    (the default process group), each buffering the states of its own engines and publishing to them.
    `device`: where the draft trains, in fp32 (its buffer stays in host memory)."""

    def __init__(self, draft: DraftHead, cfg: DraftConfig, engines: list[Engine], seed: int = 0,
                 shard: int = 0, shards: int = 1, device: torch.device | str = "cpu"):
        self.draft = draft.to(device)  # before its optimiser exists: Adam's state is made beside the weights
        self.cfg = cfg
        self.engines = engines
        self.shard, self.shards = shard, shards
        self.trainer = DraftTrainer(draft, lr=cfg.online_lr, max_tokens=cfg.online_buffer_tokens,
                                    batch_size=cfg.batch_size, seed=seed + shard, data_parallel=shards > 1,
                                    unroll=cfg.unroll)
        self.version = 0  # published draft versions; 0 is the warm start
        self.policy_version = 0  # the policy version whose rollout states the draft last trained on
        self.rejected = 0
        self.last_metrics: dict[str, float] = {}
        self.fresh: dict[str, float] = {}  # the published draft scored on the newest rollout, before training on it
        self.target = TargetTensors(tied=bool(draft.cfg.tie_word_embeddings))

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """Nothing to do: the draft binds the policy's embedding and head as soon as both arrived."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, complete: bool = True) -> None:
        """A weight push: the draft trains against the new policy's embedding and LM head (its own
        are the policy's), the ones the engines verify with; the other tensors pass by."""
        if (target := self.target.collect(named_tensors, version)) is not None:
            self.draft.bind_target(*target)

    def observe(self, prompts: list[list[int]], completions: list[Completion], policy_version: int) -> int:
        """Buffer each completion's captured states. Returns the tokens added."""
        return self.buffer(training_rows(prompts, completions), policy_version)

    def buffer(self, rows: list[tuple[Tensor, Tensor, Tensor]], policy_version: int) -> int:
        """Buffer (states, tokens, mask) rows of one rollout, after scoring the draft on a spread of
        them (how well it kept up with the policy that sampled them). Returns the tokens added."""
        if rows:
            sample = rows[:: max(1, len(rows) // self.cfg.batch_size)][: self.cfg.batch_size]
            self.fresh = {f"{k}_fresh": v for k, v in evaluate_draft(self.draft, sample).items()
                          if k in ("draft_loss", "draft_top1")}
        for hidden, tokens, mask in rows:
            self.trainer.add(hidden, tokens, mask)
        self.policy_version = policy_version
        return sum(t.shape[0] for _, t, _ in rows)

    def learn(self, prompts: list[list[int]], completions: list[Completion], policy_version: int,
              budget_s: float) -> dict[str, float]:
        """After a rollout of `policy_version`: buffer its states and train within `budget_s` (which
        covers buffering and publishing too). Lag is reported against the next policy version."""
        t0 = time.perf_counter()
        self.observe(prompts, completions, policy_version)
        metrics = self.train(budget_s - (time.perf_counter() - t0))
        return metrics | {"draft_lag": float(self.lag(policy_version + 1)), "draft_train_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Nothing to release: the sync learner lives in the training process."""

    def train(self, budget_s: float) -> dict[str, float]:
        """Train within the budget; publish the new version, or reject it if any weight went non-finite."""
        before = {k: v.clone() for k, v in self.draft.state_dict().items()}
        opt_before = copy.deepcopy(self.trainer.optimizer.state_dict())
        metrics = self.trainer.train(self.cfg.sync_max_steps, budget_s)
        self.last_metrics = metrics
        if not all(torch.isfinite(p).all() for p in self.draft.parameters()):
            self.draft.load_state_dict(before)
            self.trainer.optimizer.load_state_dict(opt_before)
            self.rejected += 1
            return metrics | self._metrics() | {"draft_rejected": 1.0}
        if metrics["draft_steps"] > 0:
            self.version += 1
            for engine in self.engines:
                engine.update_draft(self.trainer.export(), self.version)
        return metrics | self._metrics() | {"draft_rejected": 0.0}

    def _metrics(self) -> dict[str, float]:
        return self.fresh | {"draft_version": float(self.version), "draft_rejected_total": float(self.rejected),
                             "draft_buffer_tokens": float(self.trainer.buffered_tokens)}

    def lag(self, policy_version: int) -> int:
        """Policy updates the draft has not seen states of."""
        return policy_version - self.policy_version

    # -- checkpoint: weights, optimizer, versions (shard 0, the slice's drafts being identical);
    # each shard's buffer and sampling state ------------------------------------------------
    def _shard_files(self, directory: Path) -> tuple[Path, Path]:
        suffix = f".shard{self.shard}" if self.shard else ""
        return directory / f"draft_buffer{suffix}.safetensors", directory / f"draft_sampler{suffix}.pt"

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if self.shard == 0:
            self.draft.save(directory, extra={"version": self.version})
            torch.save({"optimizer": self.trainer.optimizer.state_dict(), "version": self.version,
                        "policy_version": self.policy_version, "rejected": self.rejected, "steps": self.trainer.steps,
                        "shards": self.shards}, directory / "draft_trainer.pt")
        buffer = list(self.trainer.buffer)
        buffer_file, sampler_file = self._shard_files(directory)
        torch.save({"rng": self.trainer.rng.getstate(), "buffer_lengths": [h.shape[0] for h, _, _ in buffer]},
                   sampler_file)
        if buffer:
            save_file({"hidden": torch.cat([h for h, _, _ in buffer]), "tokens": torch.cat([t for _, t, _ in buffer]),
                       "mask": torch.cat([m for _, _, m in buffer])}, str(buffer_file))

    def load(self, directory: Path) -> None:
        """Every shard loads the weights and optimizer, and its own buffer: at another slice size a
        shard that had none starts empty, and the buffers of shards gone are dropped."""
        self.draft.load_named(DraftHead.load(directory, self.draft.cfg).state_dict().items())
        state = torch.load(directory / "draft_trainer.pt", weights_only=False)
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.version, self.policy_version = state["version"], state["policy_version"]
        self.rejected, self.trainer.steps = state["rejected"], state["steps"]
        self.trainer.buffer.clear()
        self.trainer.buffered_tokens = 0
        buffer_file, sampler_file = self._shard_files(directory)
        sampler = torch.load(sampler_file, weights_only=False) if sampler_file.exists() else None
        if sampler is None and self.shard == 0 and "rng" in state:  # written before the slice had shards
            sampler = state
        if sampler is not None:
            self.trainer.rng.setstate(sampler["rng"])
            if sampler["buffer_lengths"]:
                saved = load_file(str(buffer_file))
                for h, t, m in zip(*(saved[k].split(sampler["buffer_lengths"]) for k in ("hidden", "tokens", "mask"))):
                    self.trainer.add(h, t, m)
        for engine in self.engines:
            engine.update_draft(self.trainer.export(), self.version)

