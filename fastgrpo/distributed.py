"""The torch.distributed world of a run: what the training loop needs of the world torchrun launches.

`init_world`, `World`, `Channel`, `StopRequest`: the policy ranks' and the draft slice's process groups,
which rank leads which engine, the rollout exchange, engine <-> draft messages, agreeing to stop on
SIGTERM. (A world of local processes for tests and benches is `fastgrpo/local_world.py`.)"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastgrpo.process_exit import die_with_parent
from fastgrpo.topology import EngineMap
from fastgrpo.types import Placement


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the training world (torchrun's) -------------------------------------------------------------
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # a rank lost in a collective fails after this, never hangs


def launched_world_size() -> int:
    """The world torchrun (or Slurm's srun through torchrun) launched this process into; 1 alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank in that world; 0 alone."""
    return int(os.environ.get("RANK", "0"))


# a receiver idle between steps is not a failure; a dead peer is seen at once (its connection closes)
CHANNEL_TIMEOUT = datetime.timedelta(days=1)
_channel: Channel | None = None


def is_draft_rank(draft_ranks: int) -> bool:
    """This process is one of the world's last `draft_ranks` ranks: it trains the draft, not the policy."""
    return draft_ranks > 0 and launched_rank() >= launched_world_size() - draft_ranks


def launch_store(rank: int, size: int) -> dist.Store:
    """The launch's key-value store: torchrun's agent store, or (ranks started without an agent, as by
    `run_world`) one that rank 0 hosts at MASTER_ADDR:MASTER_PORT."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None if agent else size,
                         is_master=not agent and rank == 0, timeout=COLLECTIVE_TIMEOUT)


def init_world(draft_ranks: int = 0) -> Channel | None:
    """The process groups of a torchrun launch, once: the policy ranks' default group (NCCL with GPUs,
    gloo without: megatron's groups and checkpoints live in it) and, with a reserved draft slice, the
    draft ranks' own default group plus a channel over every rank for engine <-> draft messages. A
    process started alone gets none (megatron's `initialize` makes a world of one when it needs one)."""
    global _channel
    size = launched_world_size()
    if size == 1 or dist.is_initialized():
        return _channel
    rank, policy_ranks = int(os.environ["RANK"]), size - draft_ranks
    if policy_ranks < 1:
        raise ValueError(f"parallel.draft_ranks={draft_ranks} leaves no policy rank in a world of {size}")
    # a process a rank forks (megatron's checkpoint writers fork theirs) dies with the rank: one that
    # outlived a killed rank blocked on the rank's results queue and held the job open
    os.register_at_fork(after_in_child=die_with_parent)
    store = launch_store(rank, size)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if rank < policy_ranks:
        dist.init_process_group(backend, store=dist.PrefixStore("fastgrpo/policy", store), rank=rank,
                                world_size=policy_ranks, timeout=COLLECTIVE_TIMEOUT)
    else:  # gloo: the draft trains on CPU tensors
        dist.init_process_group("gloo", store=dist.PrefixStore("fastgrpo/draft", store), rank=rank - policy_ranks,
                                world_size=draft_ranks, timeout=COLLECTIVE_TIMEOUT)
    if draft_ranks:
        _channel = Channel(store, rank, size)
    atexit.register(close_world)
    return _channel


def close_world() -> None:
    """Every process group of this process destroyed (megatron's and DeepSpeed's with the default one,
    and the channel's); `init_world` has it run at exit. A gloo group left to the interpreter's
    finalization can abort the process (its worker threads still hold finished work, whose release
    then needs a GIL that is gone: pytorch issue 190489), and under torchrun one rank's abort ends the
    job: the others' final evaluation, checkpoint and summary with it. A group that something else
    still holds outlives this: `fastgrpo.process_exit.end_process` covers that case."""
    global _channel
    _channel = None
    if dist.is_initialized():
        dist.destroy_process_group()


class Channel:
    """Point-to-point messages between any two ranks of a launch, whatever process groups they belong
    to: the rollout engines (on policy ranks) and the draft ranks. gloo over the launch's store (the
    messages are CPU tensors: captured states, draft weights), beside the trainer's own groups."""

    def __init__(self, store: dist.Store, rank: int, size: int):
        self.rank, self.size = rank, size
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("fastgrpo/channel", store), rank, size, CHANNEL_TIMEOUT)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._pg.send([t.contiguous()], dst, tag).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        self._pg.recv([t], src, tag).wait()


@dataclass(frozen=True)
class World:
    """This process's part in the run: its rank, its place among the trainer's data-parallel
    replicas, and the rollout engines' map over the policy ranks (which engine it belongs to)."""

    rank: int = 0
    size: int = 1
    placement: Placement = Placement()
    engines: EngineMap = EngineMap()

    @classmethod
    def of(cls, placement: Placement, engine_tensor: int = 1) -> World:
        if dist.is_initialized():
            size = dist.get_world_size()
            return cls(dist.get_rank(), size, placement, EngineMap(size, engine_tensor))
        return cls(placement=placement)

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints, tracks and writes the run's files."""
        return self.rank == 0

    @property
    def engine(self) -> int | None:
        """The engine this rank belongs to."""
        return self.engines.engine_of(self.rank)

    @property
    def leads_engine(self) -> bool:
        """This rank drives its engine: builds it, feeds it weights and prompts, returns its answers."""
        return self.engines.leads(self.rank)

    def share(self, items: list) -> tuple[int, list]:
        """This rank's engine's contiguous share of `items` (whole prompts: a group never splits), with
        the index of its first item."""
        start, stop = self.engines.bounds(len(items), self.engine)
        return start, items[start:stop]

    def gather(self, mine: Any) -> list:
        """Every engine leader's `mine`, in engine order, on every rank (other ranks pass None); what a
        rollout step exchanges: token ids, log-probabilities, rewards, engine statistics."""
        if self.size == 1:
            return [mine]
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, mine if self.leads_engine else None)
        return [everyone[r] for r in self.engines.leaders()]

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank."""
        if self.size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


class StopRequest:
    """SIGTERM (what Slurm sends before it ends a job, and torchrun passes on) asks for a checkpoint at
    the next step boundary and a clean exit; the ranks agree on it there (`World.any`), so every rank
    stops after the same step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (a run driven from a thread): SIGTERM keeps its default
            pass

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def is_peer_failure(error: BaseException) -> bool:
    """An error that says another rank failed (its connections closed, a collective timed out), not
    this rank's own: that rank prints its own error; this one only says it stops."""
    return isinstance(error, (dist.DistBackendError, dist.DistNetworkError)) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in ("Connection closed by peer", "Connection reset",
                                                                          "Gloo", "gloo")))
