"""bench simulate: the simulator; the policies it runs."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastgrpo.engines.embedded.engine import DRAFT_WINDOW
from fastgrpo.engines.embedded.steps import node_widths
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, FastGRPOFormula, Off, SpeculationPolicy, Static
from fastgrpo.speculation.roofline import Roofline, simulated_cost_model
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.bench.simulate.costs import Costs
from fastgrpo.bench.simulate.acceptance import AcceptanceProfile, DraftConfidence
from fastgrpo.bench.simulate.workload import Workload


class Rows:
    """The running batch as the engine keeps it: rows 0..B-1, a finished row replaced by the last."""

    def __init__(self):
        self.req = np.zeros(0, dtype=np.int64)
        self.prompt_len = np.zeros(0, dtype=np.int64)
        self.generated = np.zeros(0, dtype=np.int64)
        self.limit = np.zeros(0, dtype=np.int64)
        self.behind = np.zeros(0, dtype=np.int64)  # target states the draft has not seen

    @property
    def n(self) -> int:
        return len(self.req)

    def add(self, req: Sequence[int], prompt_len: Sequence[int], limit: Sequence[int]) -> None:
        """Prefilled rows: the first token is sampled from the prefill's logits."""
        cat = np.concatenate
        self.req = cat([self.req, np.asarray(req, dtype=np.int64)])
        self.prompt_len = cat([self.prompt_len, np.asarray(prompt_len, dtype=np.int64)])
        self.generated = cat([self.generated, np.ones(len(req), dtype=np.int64)])
        self.limit = cat([self.limit, np.asarray(limit, dtype=np.int64)])
        self.behind = cat([self.behind, np.asarray(prompt_len, dtype=np.int64)])

    def context(self) -> tuple[int, int]:
        """(longest, summed) cached tokens of the running rows."""
        ctx = self.prompt_len + self.generated - 1
        return int(ctx.max()), int(ctx.sum())

    def catch_up_width(self) -> int:
        return int(min(self.behind.max(), DRAFT_WINDOW))

    def step_off(self) -> int:
        self.generated += 1
        self.behind += 1
        return self.n

    def step_spec(self, accepted: np.ndarray) -> int:
        emitted = np.minimum(accepted + 1, self.limit - self.generated)
        self.generated += emitted
        self.behind = accepted + 1
        return int(emitted.sum())

    def retire(self) -> list[int]:
        """Finished requests, removed in the engine's order (the last row moves into a freed one)."""
        done = self.generated >= self.limit
        if not done.any():
            return []
        order = list(range(self.n))
        fin = done.tolist()
        out, row = [], 0
        while row < len(order):
            if not fin[order[row]]:
                row += 1
                continue
            out.append(int(self.req[order[row]]))
            order[row] = order[-1]
            order.pop()
        idx = np.asarray(order, dtype=np.int64)
        for a in ("req", "prompt_len", "generated", "limit", "behind"):
            setattr(self, a, getattr(self, a)[idx])
        return out


@dataclass
class SimRun:
    seconds: float
    prefill_s: float
    decode_steps: int
    spec_steps: int
    emitted: int
    policy_s: float  # wall time of the policy's own choose/observe calls
    trace: list[tuple[float, int, str, int, float]]  # per decode step: end time, running, config, emitted, seconds
    finished_order: list[int]


def simulate(workload: Workload, costs: Costs, acceptance: AcceptanceProfile | None, policy: SpeculationPolicy,
             max_batch: int, rng: np.random.Generator, policy_clock: bool = False,
             share_prefill: bool = True, confidence: DraftConfidence = DraftConfidence(),
             static_widths: bool = False) -> SimRun:
    """One engine.generate() call, step by step (the engine's loop: fastgrpo/engines/embedded/engine.py).

    `policy` is called exactly as the engine calls it: choose(running) before a step while
    speculating, observe(config, running, emitted, seconds, accepted) after, with the simulated
    step seconds; a policy with a per-sequence budget (`select`) picks the nodes to verify from the
    draft confidences of `confidence`, and the step costs what it verifies. With `policy_clock` the
    policy's own wall time is added to the clock (on this CPU the engine spends it between steps, and
    it is the same code on the same machine). `static_widths`: the engine's steps are static (a GPU's CUDA
    graphs), so a per-sequence budget picks one of the widths its verify runs for every row (`node_widths`)
    instead of a ragged set of nodes."""
    reqs = workload.requests
    speculating = policy.name != "off"
    select = getattr(policy, "select", None)
    if (begin := getattr(policy, "begin", None)) is not None:  # a policy that decides once per generate call
        begin()
    if speculating and acceptance is None:
        raise ValueError("a speculating policy needs an acceptance profile")
    waiting = deque(range(len(reqs)))
    rows = Rows()
    clock = prefill_s = policy_s = 0.0
    steps = spec_steps = emitted_total = 0
    trace: list[tuple[float, int, str, int, float]] = []
    finished: list[int] = []
    while waiting or rows.n:
        if waiting and rows.n < max_batch:
            joined = [waiting.popleft() for _ in range(min(len(waiting), max_batch - rows.n))]
            keys = [reqs[i].prompt if share_prefill else i for i in joined]
            unique = {k: reqs[i].prompt_len for k, i in zip(keys, joined)}
            s = costs.prefill(len(unique), max(unique.values()), len(joined))
            prefill_s += s
            clock += s
            rows.add(joined, [reqs[i].prompt_len for i in joined],
                     [max(1, min(reqs[i].length, workload.max_new, workload.max_context - reqs[i].prompt_len))
                      for i in joined])
        else:
            B = rows.n
            ctx_max, ctx_sum = rows.context()
            t = time.perf_counter()
            if speculating and (tokens_left := getattr(policy, "tokens_left", None)) is not None:
                tokens_left((rows.limit - rows.generated).tolist() if workload.known_lengths else None)
            config = policy.choose(B, ctx_max if costs.padded else ctx_sum / B) if speculating else None
            policy_s_step = time.perf_counter() - t
            if config is None:
                seconds = costs.decode_step(B, ctx_max, ctx_sum, speculating)
                accepted = None
                emitted = rows.step_off()
            elif select is None:
                seconds = costs.spec_step(config, B, rows.catch_up_width(), ctx_max, ctx_sum)
                accepted = acceptance.draw(config, B, rng)
                emitted = rows.step_spec(accepted)
                spec_steps += 1
            else:
                scores, depth, L, w = confidence.tree(acceptance, config, B, rng)
                # the confidences' K nodes a row stand for the tree's N - 1 (K = depth x a whole fill, up to
                # N - 1): verifying a share of them verifies that share of the tree, priced so
                K, N = scores.shape[1], config.num_verify
                widths = {"widths": confidence_widths(N, K)} if static_widths else {}
                t = time.perf_counter()
                nodes = select(torch.from_numpy(scores), torch.from_numpy(depth), config, B, **widths).numpy()
                policy_s_step += time.perf_counter() - t
                seconds = costs.spec_step(config, B, rows.catch_up_width(), ctx_max, ctx_sum,
                                          verified=float(1 + (N - 1) * nodes.sum() / (B * K)))
                accepted = confidence.accepted(nodes, L, w, rng)
                emitted = rows.step_spec(accepted)
                spec_steps += 1
            t = time.perf_counter()
            policy.observe(config, B, emitted, seconds, None if accepted is None else accepted.tolist())
            policy_s_step += time.perf_counter() - t
            policy_s += policy_s_step
            clock += seconds + costs.between_steps(B) + (policy_s_step if policy_clock else 0.0)
            steps += 1
            emitted_total += emitted
            trace.append((clock, B, "off" if config is None else config.name, emitted, seconds))
        finished += rows.retire()
    clock += costs.per_call(len(reqs))
    return SimRun(clock, prefill_s, steps, spec_steps, emitted_total, policy_s, trace, finished)


def confidence_widths(nodes: int, columns: int) -> list[int]:
    """A static engine's verify widths for a tree of `nodes` (`node_widths`), in the units of the draft
    confidences' `columns` nodes a row that stand for its `nodes` - 1 (the nearest, root included)."""
    return sorted({1 + round((w - 1) * columns / (nodes - 1)) for w in node_widths(nodes)})


def replay_steps(records: list[tuple[SpecConfig | None, int, list[int] | None]], prompt_lens: Sequence[int],
                 limits: Sequence[int]) -> list[tuple[int, int, int]]:
    """(running, catch-up width, longest context) before each decode step of a real engine run whose
    requests all joined in its first prefill, from the configs and accepted lengths its policy saw."""
    rows = Rows()
    rows.add(list(range(len(prompt_lens))), prompt_lens, limits)
    rows.retire()
    out = []
    for config, running, accepted in records:
        assert running == rows.n, (running, rows.n)
        out.append((rows.n, rows.catch_up_width(), rows.context()[0]))
        if config is None or accepted is None:
            rows.step_off()
        else:
            rows.step_spec(np.asarray(accepted, dtype=np.int64))
        rows.retire()
    return out


def sim_policies(costs: Costs, statics: Sequence[SpecConfig], calibration_error: Callable[[str, int], float] | None = None,
                 tlt_seed: int = 0) -> dict[str, SpeculationPolicy]:
    """Fresh policy objects for the simulated machine; `aware` calibrated on the simulated forwards.

    On a mixture-of-experts model (a Roofline whose shape has experts) also `aware_expert_blind`:
    `aware` calibrated on the same GPU with the model priced as if every forward read one token's k
    experts (`ModelShape.blind`, a dense model of the active size), then run against the true costs
    like every other policy: what pricing speculation without the experts a verify touches costs."""
    out: dict[str, SpeculationPolicy] = {"off": Off()}
    out |= {f"static_{c.name}": Static(c) for c in statics}
    out["fastgrpo"] = FastGRPOFormula()
    out["tlt"] = TLT(seed=tlt_seed)
    out["aware"] = Aware(simulated_cost_model(costs, calibration_error))
    out["aware_per_sequence"] = AwarePerSequence(simulated_cost_model(costs, calibration_error))
    if isinstance(costs, Roofline) and costs.model.moe:
        blind = Roofline(costs.hw, costs.model.blind())
        out["aware_expert_blind"] = Aware(simulated_cost_model(blind, calibration_error))
    return out


class Recorder:
    """A policy as the engine sees it, recording every decision and what followed (the engine's
    own trace has no accepted lengths)."""

    def __init__(self, policy: SpeculationPolicy):
        self.policy = policy
        self.name = policy.name
        self.tag: Any = None
        self.log: list[tuple[Any, SpecConfig | None, int, int, float | None, list[int] | None]] = []

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        return self.policy.choose(running, context)

    def __getattr__(self, name: str) -> Any:  # select(), for a per-sequence budget
        return getattr(self.policy, name)

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float | None,
                accepted: list[int] | None = None) -> None:
        self.policy.observe(config, running, emitted, seconds, accepted)
        self.log.append((self.tag, config, running, emitted, seconds, None if accepted is None else list(accepted)))
