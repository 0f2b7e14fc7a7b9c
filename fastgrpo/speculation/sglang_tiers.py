"""Speculation on SGLang: what its adaptive EAGLE can run, and `aware`'s decisions in that form.

What SGLang 0.5.23 lets an outside scheduler choose (read in its source, under sglang/srt/):
- Static EAGLE (`speculative_num_steps`, `speculative_eagle_topk`, `speculative_num_draft_tokens`)
  runs one tree shape, trees included, for the engine's whole life.
- Adaptive EAGLE (`speculative_adaptive`, speculative/adaptive_spec_params.py) runs chains only
  (top-k 1, `steps + 1` verified tokens; steps 0 is plain decoding). Its JSON config has one slot per
  lowest batch size; a decode step's batch is padded up to a captured CUDA-graph size
  (`spec_capture_sizes`) and served by the slot with the largest key not above it. Each slot keeps a
  current depth among its `candidate_steps`, moved by an EMA of accepted drafts (`AdaptiveSlots`,
  our model of `AdaptiveSpeculativeParams`). Every candidate depth gets its own CUDA graphs at start,
  so candidates are fixed for the engine's life; the current depth of a slot is not.
- Nothing in SGLang's API sets a slot's depth. Its general plugin mechanism (plugins/__init__.py: the
  `sglang.srt.plugins` entry points, loaded in every scheduler process) and `Engine.collective_rpc`
  (a Scheduler method by name, flat scalar arguments) let fastgrpo add one scheduler method that does
  (fastgrpo/engines/sglang/plugin.py).

So `aware` on SGLang (`AwareTiers`) is aware restricted to chains and to SGLang's slots: for each
captured size its cost model and learned acceptance pick the chain depth (or plain decoding) of
highest predicted goodput; the candidates of a slot are every depth it would pick for a per-level
acceptance anywhere in `ACCEPTANCE_BAND` (so a later choice is always one SGLang has graphs for); after
each generate call the acceptance learned from SGLang's per-request histograms of accepted drafts
(less the steps of depth-0 slots, which SGLang counts there as verify steps that accepted nothing:
`plain_steps`) refreshes the depths, and SGLang's EMA is frozen. What SGLang cannot run: trees under adaptive,
a per-sequence verify budget, and a choice that changes within a call as acceptance drifts.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence

from fastgrpo.speculation.policy import AcceptanceModel, Off
from fastgrpo.speculation.spec import SpecConfig

# adaptive_spec_params.py DEFAULT_ADAPTIVE_CONFIG (the conformance test compares it with the source)
SGLANG_DEFAULT_TIERS: dict[str, dict] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
# AdaptiveStepSlot's defaults for keys a slot's entry leaves out
SLOT_DEFAULTS = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
                 "up_hysteresis": 0.0, "ceiling_coeff": 0}
MAX_STEPS = 7  # the deepest chain we ask for (SGLang's default tiers' deepest)
ACCEPTANCE_BAND = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # per-level acceptance a slot's candidates cover
FIRST_CONTEXT = 256  # cached tokens per row assumed before any call has shown the real ones


def spec_capture_sizes(max_bs: int) -> list[int]:
    """The decode batch sizes SGLang captures CUDA graphs for with speculation on and padding allowed
    (arg_groups/cuda_graph_hook.py generate_decode_cuda_graph_batch_sizes), up to `max_bs`
    (max_running_requests), which is always captured."""
    return _up_to([*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)],
                  max_bs)


def plain_capture_sizes(max_bs: int) -> list[int]:
    """The same without speculation (the function's other branch)."""
    return _up_to([1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)], max_bs)


def _up_to(sizes: list[int], max_bs: int) -> list[int]:
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def pad(batch: int, sizes: Sequence[int]) -> int:
    """The captured size a decode batch of `batch` rows runs at (itself beyond the largest)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else batch


def chain(steps: int) -> SpecConfig | None:
    return None if steps == 0 else SpecConfig(steps, 1, steps + 1)


class _Slot:
    """One batch-size slot of SGLang's adaptive EAGLE: its candidate depths, its current one, and the
    EMA rule that moves it (probe one step beyond the EMA of accepted drafts, with hysteresis; a zero
    slot probes its smallest positive candidate at its next update)."""

    def __init__(self, initial: int, entry: dict):
        e = SLOT_DEFAULTS | entry
        self.candidates = sorted(set(e["candidate_steps"]))
        self.alpha, self.interval, self.warmup = e["ema_alpha"], e["update_interval"], e["warmup_batches"]
        self.down, self.up, self.ceiling = e["down_hysteresis"], e["up_hysteresis"], e["ceiling_coeff"]
        self.current = initial if initial in self.candidates else self.candidates[len(self.candidates) // 2]
        self.ema = float(self.current - 1)
        self.batches = 0

    def update(self, correct: Sequence[int]) -> bool:
        if not correct:
            return False
        if self.current > 0:
            self.ema = (1 - self.alpha) * self.ema + self.alpha * sum(correct) / len(correct)
        self.batches += 1
        if self.batches <= self.warmup or (self.batches - self.warmup) % self.interval:
            return False
        return self._move()

    def _move(self) -> bool:
        old = self.current
        i = self.candidates.index(old)
        if old == 0:
            i = min(i + 1, len(self.candidates) - 1)
            if self.candidates[i] > 0 and self.ema < 0:
                self.ema = float(self.candidates[i] - 1)
            return self._set(self.candidates[i])
        start = i
        while i > 0:
            below = self.candidates[i - 1]
            if self.ema <= (0.5 if below == 0 else below - 0.5) + self.down:
                i -= 1
            else:
                break
        if i == start:
            while i < len(self.candidates) - 1 and self.ema > self.candidates[i] - 0.5 + self.up:
                i += 1
        target = self.candidates[i]
        if self.ceiling > 0:
            cap = max(1, math.ceil(self.ema * self.ceiling))
            if cap < target <= old:
                while i > 0 and self.candidates[i] > cap:
                    i -= 1
                target = self.candidates[i]
        return self._set(target)

    def _set(self, target: int) -> bool:
        changed, self.current = target != self.current, target
        return changed


class AdaptiveSlots:
    """SGLang's adaptive EAGLE controller as the scheduler runs it: `steps(batch)` before a decode step
    (padded to a captured size, then the slot), `verified(correct, batch)` after it with each row's
    accepted drafts. `config`: SGLang's JSON config (keys: lowest batch size); `initial`: the server's
    speculative_num_steps (SGLang's default: the middle of all slots' candidates)."""

    def __init__(self, config: dict[str, dict], capture_sizes: Sequence[int] | None, initial: int | None = None):
        entries = {int(k): v for k, v in config.items() if k.isdigit()}
        union = sorted({s for e in entries.values() for s in e["candidate_steps"]})
        initial = union[len(union) // 2] if initial is None else initial
        shared = {k: v for k, v in config.items() if not k.isdigit()}
        self.keys = sorted(entries)
        self.slots = {k: _Slot(initial, shared | entries[k]) for k in self.keys}
        self.sizes = sorted(capture_sizes) if capture_sizes else None

    def slot(self, batch: int) -> _Slot:
        padded = batch if self.sizes is None else pad(batch, self.sizes)
        return self.slots[self.keys[max(0, bisect.bisect_right(self.keys, padded) - 1)]]

    def steps(self, batch: int) -> int:
        return self.slot(batch).current

    def verified(self, correct: Sequence[int], batch: int) -> None:
        self.slot(batch).update(correct)


class SGLangAdaptive(Off):
    """SGLang's adaptive EAGLE as a policy (for the simulator): its slots and EMA decide every step.
    Called on every decode step, plain ones too (their rows report zero accepted drafts)."""

    name = "sglang_adaptive"

    def __init__(self, config: dict[str, dict] | None = None, capture_sizes: Sequence[int] | None = None):
        self.controller = AdaptiveSlots(config or SGLANG_DEFAULT_TIERS, capture_sizes)

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        return chain(self.controller.steps(running))

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        self.controller.verified(accepted if accepted is not None else [0] * running, running)


def plain_steps(lengths: Sequence[int], max_running: int, depth: Callable[[int], int]) -> list[int]:
    """Each request's decode steps that ran at depth 0 (plain decoding) in a call whose requests were
    all submitted at once (a GRPO batch) and emitted `lengths` tokens, replayed: a request's first
    token comes from its prefill, rows run together up to `max_running`, waiting ones join in order as
    others finish, and a step of B rows runs at `depth(B)` (the depth SGLang's slot for B had during
    the call: its padded size routes it, `AdaptiveSlots.steps`, `AwareTiers.depth`).

    Why: SGLang counts a depth-0 slot's step as a verify step that accepted no draft (it verifies a
    one-node tree, srt/speculative/eagle_worker_v2.py:1469-1472, 1678-1684; the scheduler adds it to
    `spec_verify_ct` and to slot 0 of `spec_correct_drafts_histogram`,
    srt/managers/scheduler_components/batch_result_processor.py:783-787, 832-836), and nothing in
    a request's output says which of its steps ran at depth 0. The caller of SGLang set every slot's
    depth for the whole call, and at depth 0 every row emits one token per step, so the replay is
    SGLang's own batch up to the call's first speculative step; after it the batch only shrinks (a
    GRPO call's waiting rows joined while it was full), so when depth 0 is picked only at batch sizes
    above every positive pick (as aware's prices pick it: a deeper chain costs more per row as the
    batch grows) no depth-0 step follows and the count is exact. With depth 0 below a positive depth
    the steps after the first speculative one are estimated (rows that speculate finish sooner than
    one token a step). The simplest design that is exact: SGLang reports nothing per slot to count
    with instead (`Engine.collective_rpc` returns nothing, srt/entrypoints/engine.py:1862-1867, so
    the plugin could not send counts back), and changing SGLang's counters would patch more of SGLang
    than a slot's depth. Like `AwareTiers.saw_call`, it assumes SGLang runs every row it may (KV
    memory permitting)."""
    waiting = deque(i for i, n in enumerate(lengths) if n > 1)  # a 1-token request ends at its prefill
    running: list[tuple[int, int]] = []  # (request, decode tokens left)
    plain = [0] * len(lengths)
    while waiting or running:
        while waiting and len(running) < max_running:
            i = waiting.popleft()
            running.append((i, lengths[i] - 1))
        advance = min(left for _, left in running)  # steps until the next row finishes
        if depth(len(running)) == 0:
            for i, _ in running:
                plain[i] += advance
        running = [(i, left - advance) for i, left in running if left > advance]
    return plain


def observe_histogram(acceptance: AcceptanceModel, histogram: Sequence[int], shortest: int) -> None:
    """Per-level acceptance from a histogram of accepted drafts per speculative step: SGLang's
    `spec_correct_drafts_histogram` summed over requests, less the steps of depth-0 slots SGLang
    counts in its slot 0 (`plain_steps`; `AwareTiers.count` takes them out). The histogram does not
    say which chain a step ran, so only the levels every chain of the call drafted, 1..`shortest`
    (its shallowest positive chain), are evidence: a step that accepted a drafts passed levels 1..a
    and failed level a + 1 when a < shortest. Deeper levels are left as they were, so that until they
    are tried they take the pooled acceptance of those (`AcceptanceModel.alpha`): counting only their
    passes, as a histogram alone would, drives their estimate to 1."""
    if shortest <= 0 or not any(histogram):
        return
    for a, n in enumerate(histogram):
        for d in range(1, min(a + 1, shortest) + 1):
            acceptance.reached[d] += n
            acceptance.passed[d] += n * (d <= a)


class AwareTiers(Off):
    """`aware` restricted to what SGLang's adaptive EAGLE runs (see the module docstring): at each
    captured batch size the chain depth of highest predicted goodput, B * E[emitted | chain] / step
    seconds, against plain decoding (which a chain must beat by `margin`), E from the acceptance
    learned online, fixed within a generate call (`begin` starts one). A slot is keyed by batch size
    alone, but what a deeper chain costs depends on the rows' context (at long contexts a step reads
    the KV cache far more than the weights, and verifying more tokens adds little), so each size is
    priced at the mean context its rows had in the calls before (`contexts`).

    `prices`: the step seconds of the GPU and model (decode_step / spec_step, as speculation/roofline.py
    gives them). aware's own cost model is not used: its sweep, timed at one short context and
    extended linearly, misses that memory and compute overlap, and on SGLang there is no calibration
    of the engine's own forwards to sweep anyway. Nor is its step fit (`StepFit`): it needs each
    step's measured time and shape, and SGLang gives its caller neither (per-request histograms of
    accepted drafts only; `Engine.collective_rpc` returns nothing), while a fit to whole calls' wall
    time would have one equation per generate call for several unknowns. SGLang's steps run as CUDA
    graphs, which is where the roofline's forwards are the step."""

    name = "aware_sglang"

    def __init__(self, prices, capture_sizes: Sequence[int], max_context: int, max_steps: int = MAX_STEPS,
                 margin: float = 0.05):
        self.prices, self.sizes, self.max_steps, self.margin = prices, list(capture_sizes), max_steps, margin
        self.max_context = max_context
        self.acceptance = AcceptanceModel()
        self.histogram: list[int] = []
        self.seen: dict[int, tuple[float, int]] = {}  # this call: padded size -> (context sum, steps)
        self.contexts: dict[int, float] = {}  # the calls before: padded size -> mean context per row
        self.table = self.depths()
        self.candidates = self.band()

    def _pick(self, size: int, acceptance: AcceptanceModel, ctx: float | None = None) -> int:
        ctx = ctx or self.contexts.get(size, FIRST_CONTEXT)
        best, best_rate = 0, size / self.prices.decode_step(size, ctx, ctx * size) * (1 + self.margin)
        for d in range(1, self.max_steps + 1):
            emitted = acceptance.expected(chain(d))
            rate = size * emitted / self.prices.spec_step(chain(d), size, math.ceil(emitted), ctx, ctx * size)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def depths(self, acceptance: AcceptanceModel | None = None, ctx: float | None = None) -> dict[int, int]:
        """The chain depth (0: plain decoding) picked at each captured size now (at `ctx` cached tokens
        per row, else at the context each size had before)."""
        return {s: self._pick(s, acceptance or self.acceptance, ctx) for s in self.sizes}

    def band(self) -> dict[int, list[int]]:
        """Each captured size's candidates (SGLang builds graphs for them once, at start): the depths
        picked at every per-level acceptance in ACCEPTANCE_BAND and every context from FIRST_CONTEXT
        to `max_context` in factors of 4, and the current pick."""
        out = {s: {d} for s, d in self.table.items()}
        contexts = [FIRST_CONTEXT * 4**i for i in range(8) if FIRST_CONTEXT * 4**i < self.max_context] + [self.max_context]
        for alpha in ACCEPTANCE_BAND:
            for ctx in contexts:
                for s, d in self.depths(AcceptanceModel(prior_alpha=alpha), ctx).items():
                    out[s].add(d)
        return {s: sorted(v) for s, v in out.items()}

    def sglang_config(self) -> dict[str, dict]:
        """SGLang's adaptive config: a slot per captured size with its candidates (the EMA never runs:
        the plugin freezes it)."""
        return {str(s): {"candidate_steps": c, "up_hysteresis": 0.0, "down_hysteresis": 0.0}
                for s, c in self.candidates.items()}

    def refresh(self) -> dict[int, int]:
        """Learn from the last call's histogram and pick again, within each slot's candidates."""
        if any(self.histogram):
            shortest = min((d for d in self.table.values() if d > 0), default=0)
            observe_histogram(self.acceptance, self.histogram, shortest)
        self.histogram = []
        if self.seen:
            seen = {s: total / n for s, (total, n) in self.seen.items()}
            # a size no step ran at takes the context of the nearest size that did
            self.contexts = {s: seen[min(seen, key=lambda t, s=s: (abs(t - s), t))] for s in self.sizes}
            self.seen = {}
        picks = self.depths()
        self.table = {s: min(self.candidates[s], key=lambda c, d=d: (abs(c - d), c)) for s, d in picks.items()}
        return self.table

    def count(self, histogram: Sequence[int], plain: int = 0) -> None:
        """Add a request's histogram of accepted drafts per verify step as SGLang reports it, of which
        `plain` steps ran at depth 0 (`plain_steps`): SGLang counts those as verify steps that accepted
        no draft, and they drafted nothing, so they come out of slot 0 (at most all of it: a replay
        that estimated more is cut there)."""
        self.histogram.extend([0] * (len(histogram) - len(self.histogram)))
        for a, n in enumerate(histogram):
            self.histogram[a] += max(0, n - plain) if a == 0 else n

    def begin(self) -> None:
        self.refresh()

    def saw(self, running: int, context: float, steps: int = 1) -> None:
        """`steps` decode steps ran with `running` rows of `context` cached tokens each."""
        total, n = self.seen.get(size := pad(running, self.sizes), (0.0, 0))
        self.seen[size] = (total + context * steps, n + steps)

    def saw_call(self, prompt_lens: Sequence[int], lengths: Sequence[int], max_running: int) -> None:
        """The contexts of a call whose requests were all submitted at once (a GRPO batch), replayed
        from their lengths as one token per step: rows join in order as others finish. (SGLang
        reports no per-step context; speculation shortens every row alike, so the profile holds.)"""
        waiting = deque(range(len(lengths)))  # in submission order
        running: list[tuple[int, int]] = []  # (row, tokens so far)
        while waiting or running:
            while waiting and len(running) < max_running:
                running.append((waiting.popleft(), 0))
            # run until the next row finishes: every row gains the same tokens meanwhile
            advance = min(lengths[i] - done for i, done in running)
            if advance > 0:
                mean = sum(prompt_lens[i] + done for i, done in running) / len(running) + advance / 2
                self.saw(len(running), mean, advance)
            running = [(i, done + advance) for i, done in running if done + advance < lengths[i]]

    def depth(self, running: int) -> int:
        """The chain depth (0: plain decoding) a decode step of `running` rows runs at now: its slot's,
        the captured size it is padded to."""
        return self.table.get(pad(running, self.sizes), 0)

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        if context is not None:
            self.saw(running, context)
        return chain(self.depth(running))

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        # the simulator reports no accepted drafts for a plain step (SGLang would count it in slot 0,
        # and `count` would take it out again: plain_steps)
        if accepted:  # one pass over the rows (the simulator calls this every step)
            counts = Counter(accepted)
            self.count([counts[a] for a in range(max(counts) + 1)])
