"""Async online draft learning: the draft trains in its own process, on a reserved rank (on a cluster,
a reserved data-parallel slice), while rollout and the policy go on.

Rank 0 (trainer and engines) sends each rollout's captured states; the draft rank buffers them,
trains continuously and publishes versioned weights. Rank 0 keeps a receive posted for weights; the
engine polls it between decode steps and swaps drafts only there, never inside a verify step. Both
directions are torch.distributed point-to-point messages (gloo here, NCCL on GPUs).

Messages (rank 0 -> draft rank, tag STATES): a header [kind, sequences, tokens, policy_version],
then lengths, hidden states, tokens and masks. Kinds: states, target (the policy's embedding and LM
head after each weight push: the draft trains against the policy the engines verify with), save
and load (the payload is a directory name), stop. Draft rank -> rank 0: weights (tag WEIGHTS) as one flat tensor led by
[version, policy_version, loss, top1], and save/load acknowledgements (tag ACK).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from transformers import LlamaConfig

from fastgrpo.backends.protocols import Engine
from fastgrpo.types import Completion
from fastgrpo.config import DraftConfig
from fastgrpo.distributed import free_port
from fastgrpo.draft_learning.online import OnlineDraftLearner, training_rows
from fastgrpo.speculation.draft import DraftHead, TargetTensors

log = logging.getLogger(__name__)
STATES, WEIGHTS, ACK = 1, 2, 3  # message tags
KIND_STATES, KIND_SAVE, KIND_LOAD, KIND_TARGET, KIND_STOP = 1, 2, 3, 4, 0
META = 6  # version, policy_version, loss, top1, loss and top1 on the newest rollout before training, ahead of the weights


def _flat(named: Iterable[tuple[str, Tensor]]) -> Tensor:
    return torch.cat([t.detach().float().reshape(-1) for _, t in named])


def _unflat(flat: Tensor, like: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    offset = 0
    for name, t in like.items():
        yield name, flat[offset: offset + t.numel()].view_as(t)
        offset += t.numel()


class _Publisher:
    """The draft rank's stand-in for an engine: `update_draft` sends the weights to rank 0."""

    def __init__(self, learner_ref: list[OnlineDraftLearner]):
        self.learner_ref = learner_ref

    def update_draft(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        learner = self.learner_ref[0]
        m = learner.last_metrics
        meta = torch.tensor([float(version), float(learner.policy_version), m.get("draft_loss", math.nan),
                             m.get("draft_top1", math.nan), learner.fresh.get("draft_loss_fresh", math.nan),
                             learner.fresh.get("draft_top1_fresh", math.nan)])
        dist.send(torch.cat([meta, _flat(named_tensors)]), dst=0, tag=WEIGHTS)


def _receive_messages(inbox: queue.Queue, target_cfg: LlamaConfig) -> None:
    """Draft rank, receiver thread: blocking receives (gloo's irecv cannot be polled), one message
    at a time into the queue, so that training never waits for the network."""
    while True:
        header = torch.zeros(4, dtype=torch.long)
        dist.recv(header, src=0, tag=STATES)
        kind, n, tokens, policy_version = header.tolist()
        if kind == KIND_STOP:
            inbox.put(("stop",))
            return
        if kind == KIND_TARGET:
            embed, head = (torch.zeros(target_cfg.vocab_size, target_cfg.hidden_size) for _ in range(2))
            dist.recv(embed, src=0, tag=STATES)
            dist.recv(head, src=0, tag=STATES)
            inbox.put(("target", embed, head))
            continue
        if kind in (KIND_SAVE, KIND_LOAD):
            name = torch.zeros(n, dtype=torch.uint8)
            dist.recv(name, src=0, tag=STATES)
            inbox.put(("save" if kind == KIND_SAVE else "load", bytes(name.tolist()).decode()))
            continue
        payload = (torch.zeros(n, dtype=torch.long), torch.zeros(tokens, target_cfg.hidden_size),
                   torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.uint8))
        for t in payload:
            dist.recv(t, src=0, tag=STATES)
        inbox.put(("states", policy_version, *payload))


def draft_rank_main(init_method: str, target_cfg: LlamaConfig, draft_state: dict[str, Tensor], cfg: DraftConfig,
                    seed: int) -> None:
    """The draft rank: receive states, train, publish; until told to stop. The policy's embedding and
    head come with the first weight push, before any states."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2)
    draft = DraftHead(target_cfg)
    draft.load_state_dict(draft_state)
    ref: list[OnlineDraftLearner] = []
    learner = OnlineDraftLearner(draft, cfg, [_Publisher(ref)], seed=seed)  # type: ignore[list-item]
    ref.append(learner)
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_receive_messages, args=(inbox, target_cfg), daemon=True).start()
    while True:
        try:
            message = inbox.get(block=not learner.trainer.buffer)  # with states to learn from, never wait
        except queue.Empty:
            learner.train(budget_s=math.inf)  # publishes a new version, or rejects a non-finite update
            continue
        if message[0] == "stop":
            break
        if message[0] == "target":
            draft.bind_target(message[1], message[2])
            continue
        if message[0] in ("save", "load"):  # a load also publishes the restored version
            (learner.save if message[0] == "save" else learner.load)(Path(message[1]))
            dist.send(torch.ones(1), dst=0, tag=ACK)
            continue
        _, policy_version, lengths, states, ids, mask = message
        sizes = lengths.tolist()
        learner.buffer([(h, t, m.bool()) for h, t, m in zip(states.split(sizes), ids.split(sizes), mask.split(sizes))],
                       policy_version)
    dist.send(torch.full((META + sum(t.numel() for t in draft_state.values()),), -1.0), dst=0, tag=WEIGHTS)  # goodbye
    dist.destroy_process_group()


class AsyncDraftClient:
    """Rank 0's side: ships captured states, polls for published drafts, asks for checkpoints."""

    def __init__(self, draft: DraftHead, cfg: DraftConfig, engines: list[Engine], seed: int = 0):
        self.engines = engines
        self.shapes = {k: v.clone() for k, v in draft.state_dict().items()}
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.process = mp.get_context("spawn").Process(target=draft_rank_main, daemon=True, args=(
            init_method, draft.cfg, self.shapes, cfg, seed))
        self.process.start()
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2)
        self.version = 0
        self.policy_version = 0
        self.target = TargetTensors(tied=bool(draft.cfg.tie_word_embeddings))
        self.loss = self.top1 = self.loss_fresh = self.top1_fresh = math.nan
        self._latest: Tensor | None = None
        self._lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive_weights, daemon=True)
        self._receiver.start()

    def _receive_weights(self) -> None:
        size = META + sum(t.numel() for t in self.shapes.values())
        while True:
            message = torch.zeros(size)
            dist.recv(message, src=1, tag=WEIGHTS)
            if message[0] < 0:  # the draft rank said goodbye
                return
            with self._lock:
                self._latest = message

    def poll(self) -> tuple[Iterator[tuple[str, Tensor]], int] | None:
        """The newest published draft, if one arrived since the last poll (never blocks)."""
        with self._lock:
            message, self._latest = self._latest, None
        if message is None:
            return None
        version, policy_version, self.loss, self.top1, self.loss_fresh, self.top1_fresh = message[:META].tolist()
        self.version, self.policy_version = int(version), int(policy_version)
        return _unflat(message[META:], self.shapes), self.version

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """Nothing to do: the draft binds the policy's embedding and head as soon as both arrived."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, complete: bool = True) -> None:
        """A weight push: send the new policy's embedding and LM head to the draft rank, ahead of the
        states of the rollouts that policy will sample."""
        if (target := self.target.collect(named_tensors, version)) is not None:
            dist.send(torch.tensor([KIND_TARGET, 0, 0, version]), dst=1, tag=STATES)
            for t in target:
                dist.send(t.float().contiguous(), dst=1, tag=STATES)

    def observe(self, prompts: list[list[int]], completions: list[Completion], policy_version: int) -> int:
        """Send the completions' captured states to the draft rank; returns the tokens sent."""
        rows = training_rows(prompts, completions)
        if not rows:
            return 0
        lengths = torch.tensor([t.shape[0] for _, t, _ in rows])
        header = torch.tensor([KIND_STATES, len(rows), int(lengths.sum()), policy_version])
        for t in (header, lengths, torch.cat([h for h, _, _ in rows]), torch.cat([t for _, t, _ in rows]),
                  torch.cat([m for _, _, m in rows]).to(torch.uint8)):
            dist.send(t, dst=1, tag=STATES)
        return int(lengths.sum())

    def learn(self, prompts: list[list[int]], completions: list[Completion], policy_version: int,
              budget_s: float) -> dict[str, float]:
        """Ship the rollout's states; the draft trains on its own rank, so the step spends only the
        sending (`budget_s` does not apply)."""
        t0 = time.perf_counter()
        self.observe(prompts, completions, policy_version)
        return self.metrics(policy_version + 1) | {"draft_train_s": time.perf_counter() - t0}

    def save(self, directory: Path) -> None:
        """The draft rank writes its learner state (weights, optimizer, buffer) into `directory`."""
        self._request(KIND_SAVE, directory)

    def load(self, directory: Path) -> None:
        """The draft rank restores its learner state from `directory` and publishes that version."""
        self._request(KIND_LOAD, directory)

    def _request(self, kind: int, directory: Path) -> None:
        name = torch.tensor(list(str(directory.resolve()).encode()), dtype=torch.uint8)
        dist.send(torch.tensor([kind, name.numel(), 0, 0]), dst=1, tag=STATES)
        dist.send(name, dst=1, tag=STATES)
        dist.recv(torch.zeros(1), src=1, tag=ACK)

    def metrics(self, policy_version: int) -> dict[str, float]:
        return {"draft_version": float(self.version), "draft_lag": float(policy_version - self.policy_version),
                "draft_loss": self.loss, "draft_top1": self.top1, "draft_loss_fresh": self.loss_fresh,
                "draft_top1_fresh": self.top1_fresh}

    def close(self) -> None:
        if not self.process.is_alive():
            return
        dist.send(torch.tensor([KIND_STOP, 0, 0, 0]), dst=1, tag=STATES)
        self._receiver.join(timeout=60)
        self.process.join(timeout=60)
        dist.destroy_process_group()
        if self.process.is_alive():
            self.process.kill()
