"""Async online draft learning: the draft trains on ranks of its own while rollout and the policy go
on. In a torchrun world they are the reserved draft slice (`parallel.draft_ranks`, the world's last
ranks); in a single-process run, one process spawned for it.

Every rollout engine (one per data-parallel replica) sends its rollouts' captured states to the
draft ranks (in turn, when the slice has several); they buffer them, train continuously (one draft,
data-parallel) and publish versioned weights to every engine, which swaps drafts between decode
steps only, never inside a verify step. Rank 0's engine
(the main one) also sends, after each weight push, the policy's embedding and LM head (the draft
trains against the policy the engines verify with) and asks for checkpoints. All messages go over
a `distributed.Channel` (gloo point-to-point over the launch's store), beside the trainer's groups.

Messages to the draft rank (tag STATES; one receiver thread per engine): a header [kind, n, tokens,
policy_version], then the payload. Kinds: states (lengths, hidden states, tokens, masks), target
(embedding, head), save and load (a directory name), hello (the main engine: every engine's rank),
stop (each engine, at its end). Draft rank -> engines: weights (tag WEIGHTS) as one flat tensor led by
[version, policy_version, loss, top1, fresh loss, fresh top1, states/s], and to the main engine save/load
acknowledgements (tag ACK). A dead draft rank ends the run: the next message to it fails, and so
does a poll once its connection is gone.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from transformers import LlamaConfig

from fastgrpo.protocols import Engine
from fastgrpo.config import Config, DraftConfig
from fastgrpo.device import resolve
from fastgrpo.distributed import Channel, free_port
from fastgrpo.draft_learning.online import OnlineDraftLearner, training_rows
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.draft import TargetTensors
from fastgrpo.types import Completion

log = logging.getLogger(__name__)
STATES, WEIGHTS, ACK = 1, 2, 3  # message tags
KIND_STATES, KIND_SAVE, KIND_LOAD, KIND_TARGET, KIND_STOP, KIND_HELLO = 1, 2, 3, 4, 0, 5
# version, policy_version, loss, top1, loss and top1 on the newest rollout before training, states
# trained per second; ahead of the weights
META = 7


def _flat(named: Iterable[tuple[str, Tensor]]) -> Tensor:
    """The weights in one fp32 host tensor: the channel carries host memory."""
    return torch.cat([t.detach().float().cpu().reshape(-1) for _, t in named])


def _unflat(flat: Tensor, like: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    offset = 0
    for name, t in like.items():
        yield name, flat[offset: offset + t.numel()].view_as(t)
        offset += t.numel()


class _Publisher:
    """The draft rank's stand-in for the engines: `update_draft` sends the weights to every engine."""

    def __init__(self, channel: Channel, engine_ranks: list[int], learner_ref: list[OnlineDraftLearner]):
        self.channel, self.engine_ranks, self.learner_ref = channel, engine_ranks, learner_ref

    def update_draft(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        learner = self.learner_ref[0]
        m = learner.last_metrics
        meta = torch.tensor([float(version), float(learner.policy_version), m.get("draft_loss", math.nan),
                             m.get("draft_top1", math.nan), learner.fresh.get("draft_loss_fresh", math.nan),
                             learner.fresh.get("draft_top1_fresh", math.nan), m.get("draft_states_per_s", math.nan)])
        message = torch.cat([meta, _flat(named_tensors)])
        for rank in self.engine_ranks:
            self.channel.send(message, rank, WEIGHTS)


def _receive_messages(channel: Channel, src: int, inbox: queue.Queue, target_cfg: LlamaConfig) -> None:
    """Draft rank, one receiver thread per engine: blocking receives (gloo's irecv cannot be polled),
    one message at a time into the queue, so that training never waits for the network."""
    try:
        while True:
            header = torch.zeros(4, dtype=torch.long)
            channel.recv(header, src, STATES)
            kind, n, tokens, policy_version = header.tolist()
            if kind == KIND_STOP:
                inbox.put(("stop", src))
                return
            if kind == KIND_HELLO:
                ranks = torch.zeros(n, dtype=torch.long)
                channel.recv(ranks, src, STATES)
                inbox.put(("hello", ranks.tolist()))
                continue
            if kind == KIND_TARGET:
                embed, head = (torch.zeros(target_cfg.vocab_size, target_cfg.hidden_size) for _ in range(2))
                channel.recv(embed, src, STATES)
                channel.recv(head, src, STATES)
                inbox.put(("target", embed, head))
                continue
            if kind in (KIND_SAVE, KIND_LOAD):
                name = torch.zeros(n, dtype=torch.uint8)
                channel.recv(name, src, STATES)
                inbox.put(("save" if kind == KIND_SAVE else "load", bytes(name.tolist()).decode()))
                continue
            payload = (torch.zeros(n, dtype=torch.long), torch.zeros(tokens, target_cfg.hidden_size),
                       torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.uint8))
            for t in payload:
                channel.recv(t, src, STATES)
            inbox.put(("states", policy_version, *payload))
    except Exception as e:  # an engine's rank died: the draft rank ends with it
        inbox.put(("failed", src, e))


def draft_rank_main(channel: Channel, main_rank: int, target_cfg: LlamaConfig, draft_state: dict[str, Tensor],
                    cfg: DraftConfig, seed: int, shard: int = 0, shards: int = 1, device: str = "cpu") -> None:
    """A draft rank on `device`: receive states from every engine, train, publish to its own engines (engine i is
    draft rank i % shards's); until every engine said stop. The main engine tells the slice's first
    rank which ranks the engines are; the policy's embedding and head come with its first weight
    push, before any states. With several draft ranks (`shards`, the default process group) each
    engine deals its states messages to them in turn, and every decision is taken together each
    round: what the main engine asked of the first rank (a new target, a save, a load), whether every
    engine has stopped, whether to train (data-parallel: see DraftTrainer)."""
    torch.set_num_threads(1)
    draft = DraftHead(target_cfg)
    draft.load_state_dict(draft_state)
    inbox: queue.Queue = queue.Queue()
    leader = shard == 0
    engine_ranks: list[int] = []
    if leader:
        threading.Thread(target=_receive_messages, args=(channel, main_rank, inbox, target_cfg), daemon=True).start()
        message = inbox.get()
        if message[0] != "hello":
            raise RuntimeError(f"the draft rank expected the engines' ranks first, got {message[0]!r}")
        engine_ranks = message[1]
    if shards > 1:
        box = [engine_ranks]
        dist.broadcast_object_list(box, src=0)
        engine_ranks = box[0]
    for rank in engine_ranks:
        if not (leader and rank == main_rank):
            threading.Thread(target=_receive_messages, args=(channel, rank, inbox, target_cfg), daemon=True).start()
    mine = engine_ranks[shard::shards]  # the engines it publishes to
    ref: list[OnlineDraftLearner] = []
    learner = OnlineDraftLearner(draft, cfg, [_Publisher(channel, mine, ref)], seed=seed,  # type: ignore[list-item]
                                 shard=shard, shards=shards, device=device)
    ref.append(learner)
    running, bound, ready = set(engine_ranks), False, False  # bound: it has the policy's embedding and head to train against
    held: list = []  # states that came before any target: the draft cannot score them yet
    while True:
        requests = []  # the main engine's (a target, a save, a load): at most one a round, in its order
        for message in _drain(inbox, wait=not ready, timeout=None if shards == 1 else 0.05):
            if message[0] == "failed":
                raise RuntimeError(f"the draft rank lost engine rank {message[1]}") from message[2]
            if message[0] == "stop":
                running.discard(message[1])
            elif message[0] in REQUESTS:
                requests.append(message)
            else:
                held.append(message)
            if bound:
                _buffer(learner, held)
        if shards > 1:  # the first rank's requests reach every rank; the rounds stay in step
            mine_now = [[r[:1] if r[0] == "target" else r for r in requests], len(running), bool(learner.trainer.buffer)]
            every: list = [None] * shards
            dist.all_gather_object(every, mine_now)
            if not leader:  # the tensors of a target follow by broadcast
                requests = every[0][0]
            still_running = sum(e[1] for e in every)
            buffered = any(e[2] for e in every)
        else:
            still_running, buffered = len(running), bool(learner.trainer.buffer)
        for request in requests:
            if request[0] == "target":
                embed, head = request[1:] if leader else (torch.zeros(target_cfg.vocab_size, target_cfg.hidden_size)
                                                          for _ in range(2))
                if shards > 1:
                    dist.broadcast(embed, src=0)
                    dist.broadcast(head, src=0)
                draft.bind_target(embed, head)
                bound = True
                _buffer(learner, held)
            else:  # a save, or a load (which also publishes the restored version)
                (learner.save if request[0] == "save" else learner.load)(Path(request[1]))
                if shards > 1:
                    dist.barrier()
                if leader:
                    channel.send(torch.ones(1), main_rank, ACK)
        if not still_running:
            break
        ready = buffered and bound
        if ready:
            # a round of training publishes a version (or rejects a non-finite update); short rounds keep
            # the engines' drafts fresh and the messages (a stop, a save) answered within seconds
            learner.train(budget_s=cfg.async_publish_s)
    goodbye = torch.full((META + sum(t.numel() for t in draft_state.values()),), -1.0)
    for rank in mine:
        try:
            channel.send(goodbye, rank, WEIGHTS)
        except Exception as e:  # that engine is done and gone: nothing is lost
            log.warning("the engine of rank %d left before the draft rank's goodbye: %s", rank, e)


REQUESTS = ("target", "save", "load")


def _drain(inbox: queue.Queue, wait: bool, timeout: float | None) -> list:
    """The messages waiting, up to and including the first request (what follows it waits for the
    next round, after the request is carried out); with `wait`, the first one waited for (up to
    `timeout`)."""
    messages = []
    try:
        messages.append(inbox.get(block=wait, timeout=timeout if wait else None))
        while messages[-1][0] not in REQUESTS:
            messages.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return messages


def _buffer(learner: OnlineDraftLearner, held: list) -> None:
    """Buffers the held states messages (and empties `held`)."""
    for _, policy_version, lengths, states, ids, mask in held:
        sizes = lengths.tolist()
        learner.buffer([(h, t, m.bool()) for h, t, m in zip(states.split(sizes), ids.split(sizes), mask.split(sizes))],
                       policy_version)
    held.clear()


def _spawned_draft_rank(host: str, port: int, target_cfg: LlamaConfig, draft_state: dict[str, Tensor],
                        cfg: DraftConfig, seed: int, device: str) -> None:
    """The draft rank of a single-process run: rank 1 of a channel of two with the training process."""
    channel = Channel(dist.TCPStore(host, port, 2, is_master=False), 1, 2)
    draft_rank_main(channel, 0, target_cfg, draft_state, cfg, seed, device=device)


def serve_draft_slice(cfg: Config, channel: Channel) -> None:
    """A rank of the reserved draft slice of a torchrun world: the draft from `draft.path`, trained
    on the states every engine sends, until the run ends. SIGTERM is the policy ranks' to act on: they
    checkpoint (this rank saves the draft when asked) and then tell it to stop."""
    from transformers import AutoConfig

    from fastgrpo.paths import draft_dir

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target_cfg = AutoConfig.from_pretrained(cfg.model.path)
    draft = DraftHead.load(draft_dir(cfg), target_cfg, cfg.model.max_context)
    device = resolve(cfg).device
    if device.type == "cuda":  # the slice's ranks hold GPUs of their own, as the policy's do
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    draft_rank_main(channel, 0, target_cfg, {k: v.clone() for k, v in draft.state_dict().items()}, cfg.draft, cfg.seed,
                    shard=dist.get_rank(), shards=dist.get_world_size(), device=str(device))


class AsyncDraftClient:
    """An engine's side: ships its rollouts' captured states, polls for published drafts; the main
    one (rank 0's) also sends the policy's embedding and head and asks for checkpoints.

    Without a `channel`, the client spawns the draft rank itself (a single-process run); in a torchrun
    world the draft rank is the slice's, reached over the launch's channel."""

    def __init__(self, draft: DraftHead, cfg: DraftConfig, engines: list[Engine], seed: int = 0,
                 channel: Channel | None = None, draft_ranks: list[int] | None = None,
                 engine_ranks: list[int] | None = None, device: str = "cpu"):
        self.engines = engines
        self.shapes = {k: v.clone() for k, v in draft.state_dict().items()}
        self.process = None
        if channel is None:
            port = free_port()
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
            self.process = mp.get_context("spawn").Process(target=_spawned_draft_rank, daemon=True, args=(
                "127.0.0.1", port, draft.cfg, self.shapes, cfg, seed, device))
            self.process.start()
            channel = Channel(store, 0, 2)
        engine_ranks = engine_ranks or [channel.rank]
        index = engine_ranks.index(channel.rank)
        # states go to the slice's ranks in turn; weights come from its own, which the main engine (0)
        # also asks for checkpoints: the slice's first
        self.channel, self.draft_ranks = channel, draft_ranks or [1]
        self.draft_rank = self.draft_ranks[index % len(self.draft_ranks)]
        self._turn = index
        self.main = index == 0
        if self.main:
            self._send(KIND_HELLO, len(engine_ranks), 0, 0, torch.tensor(engine_ranks))
        self.version = 0
        self.policy_version = 0
        self.target = TargetTensors(tied=bool(draft.cfg.tie_word_embeddings))
        self.loss = self.top1 = self.loss_fresh = self.top1_fresh = self.states_per_s = math.nan
        self._latest: Tensor | None = None
        self._failure: Exception | None = None
        self._lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive_weights, daemon=True)
        self._receiver.start()

    def _send(self, kind: int, n: int, tokens: int, policy_version: int, *payload: Tensor, to: int | None = None) -> None:
        to = self.draft_rank if to is None else to
        self.channel.send(torch.tensor([kind, n, tokens, policy_version]), to, STATES)
        for t in payload:
            self.channel.send(t, to, STATES)

    def _receive_weights(self) -> None:
        size = META + sum(t.numel() for t in self.shapes.values())
        try:
            while True:
                message = torch.zeros(size)
                self.channel.recv(message, self.draft_rank, WEIGHTS)
                if message[0] < 0:  # the draft rank said goodbye
                    return
                with self._lock:
                    self._latest = message
        except Exception as e:
            self._failure = e

    def poll(self) -> tuple[Iterator[tuple[str, Tensor]], int] | None:
        """The newest published draft, if one arrived since the last poll (never blocks)."""
        if self._failure is not None:
            raise RuntimeError("the draft rank is gone") from self._failure
        with self._lock:
            message, self._latest = self._latest, None
        if message is None:
            return None
        (version, policy_version, self.loss, self.top1, self.loss_fresh, self.top1_fresh,
         self.states_per_s) = message[:META].tolist()
        self.version, self.policy_version = int(version), int(policy_version)
        return _unflat(message[META:], self.shapes), self.version

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """Nothing to do: the embedding and head went to the draft rank as soon as both arrived."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, complete: bool = True) -> None:
        """A weight push (the main engine's): send the new policy's embedding and LM head to the draft
        rank, ahead of the states of the rollouts that policy will sample."""
        if self.main and (target := self.target.collect(named_tensors, version)) is not None:
            self._send(KIND_TARGET, 0, 0, version, *(t.float() for t in target))

    def observe(self, prompts: list[list[int]], completions: list[Completion], policy_version: int) -> int:
        """Send the completions' captured states to the draft rank; returns the tokens sent."""
        rows = training_rows(prompts, completions)
        if not rows:
            return 0
        lengths = torch.tensor([t.shape[0] for _, t, _ in rows])
        to = self.draft_ranks[self._turn % len(self.draft_ranks)]
        self._turn += 1
        self._send(KIND_STATES, len(rows), int(lengths.sum()), policy_version, lengths,
                   torch.cat([h for h, _, _ in rows]), torch.cat([t for _, t, _ in rows]),
                   torch.cat([m for _, _, m in rows]).to(torch.uint8), to=to)
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
        if self.main:
            self._request(KIND_SAVE, directory)

    def load(self, directory: Path) -> None:
        """The draft rank restores its learner state from `directory` and publishes that version."""
        if self.main:
            self._request(KIND_LOAD, directory)

    def _request(self, kind: int, directory: Path) -> None:
        name = torch.tensor(list(str(directory.resolve()).encode()), dtype=torch.uint8)
        self._send(kind, name.numel(), 0, 0, name)
        self.channel.recv(torch.zeros(1), self.draft_rank, ACK)

    def metrics(self, policy_version: int) -> dict[str, float]:
        return {"draft_version": float(self.version), "draft_lag": float(policy_version - self.policy_version),
                "draft_loss": self.loss, "draft_top1": self.top1, "draft_loss_fresh": self.loss_fresh,
                "draft_top1_fresh": self.top1_fresh, "draft_states_per_s": self.states_per_s}

    def close(self) -> None:
        """This engine is done: the draft ranks end once every engine said so (and say goodbye)."""
        if self.process is not None and not self.process.is_alive():
            return
        if self._failure is None:
            for rank in self.draft_ranks:
                self._send(KIND_STOP, 0, 0, 0, to=rank)
            self._receiver.join(timeout=60)
            if self._receiver.is_alive():
                log.warning("the draft rank did not say goodbye within 60 s; this engine leaves without it")
        if self.process is not None:
            self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()
