"""The embedded rollout engine: continuous batching over a static slot KV cache, with speculation.

Requests wait in a queue; whenever rows are free, waiting prompts are prefilled together and join
the running batch. Every other step advances all running sequences at once: either a plain decode
step (one token each) or, when the speculation policy says so, a speculative step (draft a tree per
sequence, verify all trees in one target forward, keep each accepted path). A finished sequence
leaves at once and the last running row is moved into its place, so the running batch is always
rows 0..B-1 of the caches.

Steps run eagerly (shapes from the data; the CPU's default) or statically (`static_steps`: shapes fixed
by batch and context buckets, state in device buffers, results read back once a step; on CUDA each shape
is captured once as a CUDA graph and replayed). The step functions are `steps.py`, their capture
`graphs.py`; this module keeps the batch, the requests and the bookkeeping on the host.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import LlamaConfig

from fastgrpo.bridge import checksum
from fastgrpo.device import on_device
from fastgrpo.models.families import checkpoint_tensors
from fastgrpo.types import Completion, EngineStats, Request, SamplingParams, padding_shares
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.engines.embedded.pending import PendingStates
from fastgrpo.models.sampling import cuts, kept_sets, sample, sampling_logprobs, sampling_uniforms
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.fused import fused_pointwise
from fastgrpo.models.layers import EAGER
from fastgrpo.speculation.policy import Off, PerSequencePolicy, SpeculationPolicy
from fastgrpo.engines.embedded.graphs import StepGraphs
from fastgrpo.engines.embedded.steps import (StaticSteps, StepResult, StepState, batch_bucket, catch_up,
                                             context_bucket, cut_tree, depth_bucket, keep_path, merged_rows,
                                             node_widths, tree_rows, unpack_learned)
from fastgrpo.engines.embedded.tree import (NonFiniteDraft, Tree, Verified, draft_tree, hybrid_tree,
                                            observe_verified, verify_tree)
from fastgrpo.speculation.node_calibration import NodeCalibration
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.speculation.suffix_index import CandidateRows, IndexLimits, Response, SuffixIndex

log = logging.getLogger(__name__)
TREE_SLACK = 256  # cache room past the context for tree tokens that are verified and then dropped
DRAFT_WINDOW = 16  # the most target states a draft catch-up feeds per row (after a stretch of plain steps)
# cache room a static step keeps past its context bucket: the draft writes a tree's expansion entries
# (up to (depth - 1) * topk: 40 for aware's largest candidates) after the bucket's positions
STATIC_TREE_ROOM = 64


@dataclass(slots=True)
class _Sequence:
    index: int  # position in the caller's request list
    key: int  # sampling key: the request's own, else its index
    prompt_len: int
    max_new: int
    pending: int = -1  # last sampled token, not yet in the target cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sample_sets: list[list[int]] = field(default_factory=list)  # when top-k / top-p cut: each token's set
    finish: str | None = None
    spec_steps: int = 0
    spec_emitted: int = 0
    captured: list[Tensor] = field(default_factory=list)  # target states of every position, in order
    routed: list[Tensor] = field(default_factory=list)  # a MoE's experts at every position, in order
    response: Response | None = None  # its text in the suffix index (drafts: index | hybrid)


class EmbeddedEngine:
    """On `device` (its tensors made there: every factory call of a generate() runs inside the device's
    context, which on a CPU is skipped since it costs a Python call per torch op) in `dtype` (weights,
    activations and KV cache; sampling in fp32). Host round trips in a decode step, on purpose: the
    emitted tokens (`tolist`: the Python bookkeeping of stops and limits), the longest row's length
    (the attention's context width) and, with speculation, the accepted lengths.

    `eos_id`: the id (or ids) a sequence stops at: a checkpoint's tokenizer eos and generation_config's
    eos ids (instruct checkpoints end a turn with a token only generation_config names). `pad_id` fills
    the unused tail of a right-padded prefill, which the causal mask and lengths keep out of every
    result: any id in the vocabulary serves (a tokenizer needs no pad token).

    `static_steps`: run decode steps statically (None: where the device is CUDA, where they are captured
    as CUDA graphs unless `graphs` is false). Prefill, and the steps a static one cannot take (a
    per-sequence verify budget, a tree deeper than the draft window), stay eager. `fused`: static steps run
    the policy's and the draft's pointwise regions as compiled kernels (`models.fused`; the `fused`
    attribute switches)."""

    def __init__(self, cfg: LlamaConfig, max_batch: int, max_context: int, eos_id: int | Sequence[int],
                 pad_id: int = 0,
                 policy: SpeculationPolicy | None = None, draft_window: int = DRAFT_WINDOW,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 static_steps: bool | None = None, graphs: bool = True, fused: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.device, self.dtype = torch.device(device), dtype
        self.static = self.device.type == "cuda" if static_steps is None else static_steps
        with self._on_device():
            self._build(cfg, max_batch, max_context, eos_id, pad_id, policy, draft_window)
        self.graphs = StepGraphs(self.device, enabled=graphs and self.static)
        self.fused = fused

    @property
    def fused(self) -> bool:
        """Static steps run the pointwise regions (`layers.Pointwise`) as fused kernels (`models.fused`)."""
        return self.model.static_ops is not EAGER

    @fused.setter
    def fused(self, on: bool) -> None:
        if on and not self.static:
            raise ValueError("fused kernels run in static steps; this engine's steps are eager")
        if on != self.fused:
            self.model.static_ops = fused_pointwise() if on else EAGER
            self.graphs.clear()  # captured with the other kernels

    def _on_device(self) -> contextlib.AbstractContextManager:
        return on_device(self.device)

    def _build(self, cfg: LlamaConfig, max_batch: int, max_context: int, eos_id: int | Sequence[int], pad_id: int,
               policy: SpeculationPolicy | None, draft_window: int) -> None:
        self.cfg = cfg
        self.max_batch = max_batch
        self.max_context = max_context
        self.stop_ids = frozenset([eos_id] if isinstance(eos_id, int) else eos_id)
        self.pad_id = pad_id
        self.model = InferenceModel(cfg, max_context + TREE_SLACK, self.dtype,
                                    kernel="auto" if self.device.type == "cpu" else "dense")
        # a static step runs the running rows padded to a bucket: the caches hold the largest bucket's rows
        self.rows = batch_bucket(max_batch) if self.static else max_batch
        self.cache = KVCache(cfg, self.rows, max_context + TREE_SLACK, self.dtype)
        self.state = StepState(self.rows) if self.static else None
        self.steps = StaticSteps(self.model, self.cache, self.state) if self.state is not None else None
        self._readback: Tensor | None = None  # the pinned host buffer a static step's results land in
        self._tree_staging: dict[int, Tensor] = {}  # pinned host buffers a merged tree crosses to the device from
        # a merged static step's tree, accepted path and counts, not yet observed (`_observe_held`)
        self._unobserved: tuple[Tree, Tensor, Tensor] | None = None
        self._kept_pending: PendingStates | None = None  # static steps: the draft's pending states, kept
        self.draft: DraftHead | None = None
        self.draft_cache: KVCache | None = None
        self.policy: SpeculationPolicy = policy or Off()
        self.weights_version: int | None = -1  # None: a push is under way (`update_weights`)
        self._incoming = -1
        self.draft_version = -1
        if draft_window < 1:
            raise ValueError(f"draft_window must be >= 1, got {draft_window}")
        self.draft_window = draft_window  # most target states the draft catches up on per row at once
        self.share_prefill = True  # prefill a prompt several requests share once (off: to measure what it saves)
        self._capture = False  # this generate() call returns the target's hidden states (online draft learning)
        self._routing = False  # this generate() call returns a mixture of experts' routing (routing replay)
        self._pending: PendingStates | None = None  # for the draft's catch-up, kept while speculating
        # async draft learning: polled between decode steps for a newer draft, (weights, version) or None
        self.draft_source: Callable[[], tuple[Iterable[tuple[str, Tensor]], int] | None] | None = None
        self._in_step = False
        self._stats: EngineStats = {}
        self.drafts = "learned"  # who proposes a speculative step's tree: learned | index | hybrid
        self.index: SuffixIndex | None = None  # what the prompts' responses wrote (drafts: index | hybrid)
        self.calibration: NodeCalibration | None = None  # merged trees' node acceptance per source, learned
        self._requests: list[Request] = []

    # -- weights --------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, complete: bool = True) -> None:
        """Tensors of policy `version`: all of them (`complete`), or one bucket of a streamed push that
        `commit_weights` completes. Buckets are copied in place (no second copy of the model); until
        the commit the engine refuses to generate, so it never serves a mix of two versions."""
        if self._incoming != version:
            self._incoming, self.weights_version = version, None
        self.model.load(named_tensors)
        if complete:
            self.commit_weights(version)

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """The push of `version` is whole: check what arrived against the sender's per-tensor
        checksums, then serve it. A mixture of experts' weights are checked under the names the sender
        used: experts stacked (a Hugging Face model's state dict: the torch and DeepSpeed trainers) or one
        tensor per expert (a checkpoint's names: the Megatron trainer's export)."""
        if self._incoming != version:
            raise RuntimeError(f"commit of weight version {version}, but the push under way is of {self._incoming}")
        if checksums is not None:
            held = dict(self.model.named_weights())
            per_expert = dict(checkpoint_tensors(held.items()))
            if any(name in checksums and name not in held for name in per_expert):  # the sender's naming
                held = per_expert
            for name, t in held.items():
                if name in checksums and checksum(t) != checksums[name]:
                    raise RuntimeError(f"weight version {version}: {name} differs from what the trainer sent")
            if missing := [name for name in held if name not in checksums]:
                raise RuntimeError(f"weight version {version} did not include {missing[:3]}")
        self.weights_version = version

    def update_draft(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Install or replace the draft: between generate() calls or between decode steps, never
        inside one (a tree drafted by one version is verified against the same version's KV)."""
        if self._in_step:
            raise RuntimeError("update_draft inside a decode step")
        with self._on_device():
            self._install_draft(named_tensors, version)

    def _install_draft(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        if self.draft is None:
            self.draft = DraftHead(self.cfg, self.max_context + TREE_SLACK).to(self.device, self.dtype)
            self.draft.pack()
            self.draft_cache = KVCache(self.cfg, self.rows, self.max_context + TREE_SLACK, self.dtype, layers=1)
            if self.steps is not None:
                self.steps.draft, self.steps.draft_cache = self.draft, self.draft_cache
                self.graphs.clear()  # captured before the draft's buffers existed
        self.draft.load_named(named_tensors)
        self.draft.bind_target(self.model.embed, self.model.lm_head)
        self.draft_version = version
        # the cached keys/values are the previous version's: the new one starts from nothing and its
        # next catch-up feeds it each row's last `draft_window` states (those it attends to from then on)
        self.draft_cache.lengths.zero_()
        self.draft_cache.visible_from.zero_()

    def remember(self, prompts: Sequence[Sequence[int]], completions: Sequence[Completion]) -> None:
        """Answers another engine wrote (completion i answers prompt i: a distributed rollout's other
        shares), kept in the suffix index as their prompts' history, so that a prompt's next visit drafts
        from all its responses whichever engine gets it (`SuffixIndex.remember`: indexed when the prompt
        is next used here). Nothing without an index (drafts: learned)."""
        if self.index is None:
            return
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
        for prompt, completion in zip(prompts, completions):
            by_prompt.setdefault(tuple(prompt), []).append(completion.token_ids)
        for key, responses in by_prompt.items():
            self.index.remember(key, key, responses)

    def set_speculation(self, policy: SpeculationPolicy) -> None:
        self.policy = policy

    def set_drafts(self, drafts: str, limits: IndexLimits | None = None, index: SuffixIndex | None = None,
                   calibration: NodeCalibration | None = None) -> None:
        """Who proposes the trees of speculative steps: the learned draft, the suffix index of the
        prompts' responses (earlier calls' and this call's siblings') or both in one tree
        (`tree.hybrid_tree`, its nodes ranked by `calibration`: each source's acceptance as verification
        found it). The index and the calibration live across generate() calls: that is their history
        (`index`, `calibration`: ones to use instead, as a benchmark keeping one per source does). A static
        engine runs a merged tree in two step functions, the learned draft's (hybrid) and the verify, with
        the host's lookups and merge between them (`_merged_tree`)."""
        if drafts not in ("learned", "index", "hybrid"):
            raise ValueError(f"drafts must be learned, index or hybrid, got {drafts!r}")
        self.drafts = drafts
        self.calibration = None if drafts == "learned" else (calibration or self.calibration or NodeCalibration())
        if drafts == "learned":
            self.index = None
        elif index is not None:
            self.index = index
        elif self.index is None or (limits is not None and limits != self.index.limits):
            self.index = SuffixIndex(limits)

    def release_memory(self) -> None:
        """No-op on CPU: the KV cache stays allocated (SGLang frees GPU memory here for the trainer)."""

    def resume_memory(self) -> None:
        """No-op on CPU."""

    def stats(self) -> EngineStats:
        return dict(self._stats, weights_version=self.weights_version, draft_version=self.draft_version)

    @property
    def speculating(self) -> bool:
        return self.draft is not None and self.policy.name != "off"

    # -- generation -----------------------------------------------------------------------
    def generate(self, requests: list[Request], sampling: SamplingParams, seed: int = 0,
                 capture: bool = False, routing: bool = False) -> list[Completion]:
        """`capture`: each completion carries the target's hidden states (the draft learner's data);
        `routing`: a mixture of experts' completions carry the experts each position ran (routing replay;
        eager and static steps alike, a static step's captured graph keyed apart)."""
        with self._on_device():
            return self._generate(requests, sampling, seed, capture, routing)

    def _generate(self, requests: list[Request], sampling: SamplingParams, seed: int,
                  capture: bool, routing: bool = False) -> list[Completion]:
        self._check(requests)
        self._capture = capture
        self._routing = routing and self.model.sparse_layers > 0
        self._requests = requests
        self._unobserved = None  # (what a call that raised left)
        self._pending = self._pending_states() if self.speculating else None
        if self.state is not None:
            self.state.active.zero_()
            self.state.set_seed(seed)
        self.cache.lengths.zero_()
        if self.draft_cache is not None:
            self.draft_cache.lengths.zero_()
            self.draft_cache.visible_from.zero_()
        t0, capture_s = time.perf_counter(), self.graphs.capture_s
        waiting = deque(range(len(requests)))
        running: list[_Sequence] = []
        done: dict[int, _Sequence] = {}
        self._counts: Counter = Counter()
        self._by_config: dict[str, Counter] = {}
        self._trace: list[tuple[int, str, int, float]] = []  # per decode step: running, config, tokens emitted, seconds
        # per speculative step with the index: running rows, host seconds, and of those the seconds a static
        # step spent while one of its step functions computed (hidden on a GPU: the lookups behind the learned
        # draft's step, the index's upkeep behind the verify's)
        self._host_steps: list[tuple[int, float, float]] = []
        while waiting or running:
            drafting = None  # a step drafting from the index: its running rows, and the host seconds before it
            if waiting and len(running) < self.max_batch:
                joined = [waiting.popleft() for _ in range(min(len(waiting), self.max_batch - len(running)))]
                t = time.perf_counter()
                first = len(running)
                running += self._prefill(requests, joined, first, sampling, seed)
                if self.state is not None:
                    self.state.start_rows(first, [s.pending for s in running[first:]],
                                          [s.key for s in running[first:]], [len(s.tokens) for s in running[first:]])
                self._counts["prefill_s"] += time.perf_counter() - t
            else:
                self._swap_draft()
                # a draft that arrives during the call (async learning) is used from the next call: the
                # states of the steps before it were not kept
                # the context a step is priced at: attention reads every row to the longest row's cache
                # a step's seconds include the policy's choice: aware is held to realised wall time
                t, captures = time.perf_counter(), self.graphs.captures
                cached = [_cached(s) for s in running]
                context = max(cached)
                speculating = self._pending is not None and self.speculating
                if speculating and (tokens_left := getattr(self.policy, "tokens_left", None)) is not None:
                    # exact only where EOS is ignored (a bench's fixed lengths): then a row runs its budget
                    tokens_left([min(s.max_new, self.max_context - s.prompt_len) - len(s.tokens) for s in running]
                                if sampling.ignore_eos else None)
                config = self.policy.choose(len(running), context) if speculating else None
                self._counts["policy_s"] += time.perf_counter() - t  # (with the rows' lengths read for it)
                if config is not None and self.index is not None:
                    drafting = (len(running), self._host_seconds(), self._counts["hidden_s"])
                self._in_step = True
                try:
                    static = self._static_takes(config)
                    shape = self._step_shape(len(running), config, context, static)
                    if static:
                        emitted, accepted = self._static_step(running, config, context, shape, sampling)
                    elif config is None:
                        emitted, accepted = self._decode(running, sampling, seed), None
                    else:
                        emitted, accepted = self._speculate(running, config, sampling, seed)
                    if self.state is not None and not static:  # an eager step in a static engine
                        self.state.start_rows(0, [s.pending for s in running], [s.key for s in running],
                                              [len(s.tokens) for s in running])
                    if not static:  # (a static step tidies while its step function computes)
                        self._tidy_index()
                finally:
                    self._in_step = False
                seconds = time.perf_counter() - t
                # a step that captured its graph ran eagerly and recorded: its time prices no later step
                timed = self.graphs.captures == captures
                t = time.perf_counter()
                self.policy.observe(config, len(running), emitted, seconds if timed else None, accepted)
                self._counts["policy_s"] += time.perf_counter() - t
                self._count_step(config, len(running), emitted, seconds)
                self._count_reads(config, len(running), static, shape, sum(cached))
            self._retire(running, done)
            if not (running or waiting):  # the call returns an index within its limits
                self._tidy_index()
            if drafting is not None:  # the step's host work for index drafts, its retire's included
                self._host_steps.append((drafting[0], self._host_seconds() - drafting[1],
                                         self._counts["hidden_s"] - drafting[2]))
        self._observe_held()
        out = [done[i] for i in range(len(requests))]
        self._counts["capture_s"] = self.graphs.capture_s - capture_s
        self._finish_stats(out, time.perf_counter() - t0)
        return [Completion(s.tokens, s.logprobs, s.finish or "length",
                           {"spec_steps": s.spec_steps, "spec_emitted": s.spec_emitted}, self._captured(s),
                           s.sample_sets[: len(s.tokens)] if cuts(sampling) else None, self._routed(s))
                for s in out]

    def _pending_states(self) -> PendingStates:
        """The draft's pending states for a call: one buffer for the engine's life when steps are static (a
        captured step reads the buffer it was captured with; every entry is written before it is read),
        a fresh one per call otherwise."""
        if self.state is None:
            return PendingStates(self.rows, self.draft_window, self.cfg.hidden_size, self.dtype)
        if self._kept_pending is None:
            self._kept_pending = PendingStates(self.rows, self.draft_window, self.cfg.hidden_size, self.dtype)
        self._kept_pending.discard()
        return self._kept_pending

    def _swap_draft(self) -> None:
        if self.draft_source is not None and (update := self.draft_source()) is not None:
            self.update_draft(*update)

    def _check(self, requests: list[Request]) -> None:
        if self.weights_version is None:
            raise RuntimeError(f"the push of weight version {self._incoming} is incomplete: no generation until it "
                               f"is committed")
        for i, r in enumerate(requests):
            r.check(i, self.max_context, self.cfg.vocab_size)

    def _prefill(self, requests: list[Request], joined: list[int], first_row: int,
                 sampling: SamplingParams, seed: int) -> list[_Sequence]:
        """Prefill new prompts into the rows after the running batch, in one right-padded forward.

        A prompt that several requests share (GRPO samples each prompt group_size times) is computed
        once and its keys/values are copied to the other rows: a prompt's cache does not depend on
        what is sampled after it, and prefill is a third of a GRPO batch's rollout time otherwise."""
        prompts = [requests[i].prompt_ids for i in joined]
        keys = [tuple(p) if self.share_prefill else i for i, p in enumerate(prompts)]
        row_of = {k: r for r, k in enumerate(dict.fromkeys(keys))}  # distinct prompt -> its prefill row
        unique = [prompts[keys.index(k)] for k in row_of]
        which = torch.tensor([row_of[k] for k in keys])
        width = max(map(len, unique))
        tokens = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        for r, p in enumerate(unique):
            tokens[r, : len(p)] = torch.tensor(p)
        rows = slice(first_row, first_row + len(prompts))
        self.cache.lengths[rows] = 0
        routed = [] if self._routing else None
        logits, hidden = self.model.forward(tokens, self.cache, slice(first_row, first_row + len(unique)),
                                            routing=routed)
        if len(unique) < len(prompts):
            for c in (self.cache.k, self.cache.v):
                c[:, rows, :width] = c[:, first_row : first_row + len(unique), :width][:, which]
        lens = torch.tensor([len(p) for p in prompts])
        self.cache.lengths[rows] = lens  # padding keys beyond a prompt's length are never visible
        seqs = [_Sequence(index=i, key=i if requests[i].key is None else requests[i].key, prompt_len=len(p),
                          max_new=requests[i].max_new_tokens or sampling.max_new_tokens)
                for i, p in zip(joined, prompts)]
        first = self._sample_one(seqs, logits[which, lens - 1], sampling, seed)
        if self.draft_cache is not None:
            self.draft_cache.lengths[rows] = 0
            self.draft_cache.visible_from[rows] = 0
        if self._pending is not None:
            self._pending.flush(self.cache.lengths)  # the running rows' deferred steps, before new rows join
            self._keep_prompt_states(first_row, which, hidden, tokens, lens, torch.tensor(first))
        if self._capture:
            for s, w in zip(seqs, which.tolist()):
                s.captured.append(hidden[w, : s.prompt_len])
        if routed is not None:
            experts = torch.stack(routed, 2)  # [prompts, width, sparse layers, k]
            for s, w in zip(seqs, which.tolist()):
                s.routed.append(experts[w, : s.prompt_len])
        return seqs

    def _keep_prompt_states(self, first_row: int, which: Tensor, hidden: Tensor, tokens: Tensor, lens: Tensor,
                            first: Tensor) -> None:
        """The last `draft_window` states of each new prompt for the draft, in one write: the state at
        position p with the token after it (the prompt's next one, or the first sampled at its end).
        Row i of the new rows is prefill row which[i] of `hidden` and `tokens`."""
        assert self._pending is not None
        n, window = len(lens), self._pending.window
        following = tokens[which].roll(-1, 1)  # the prompt's next token; at its end, the first sampled
        following[torch.arange(n), lens - 1] = first
        # the last `window` positions; a prompt shorter than that writes position 0 several times over
        positions = (lens[:, None] - window + torch.arange(window)).clamp(min=0)
        rows = torch.arange(first_row, first_row + n)[:, None].expand(n, window)
        states = hidden[which[:, None], positions].reshape(n * window, -1)
        self._pending.put(rows.reshape(-1), positions.reshape(-1), states, following.gather(1, positions).reshape(-1))

    def _decode(self, running: list[_Sequence], sampling: SamplingParams, seed: int) -> int:
        rows = slice(0, len(running))
        tokens = torch.tensor([[s.pending] for s in running])
        routed = [] if self._routing else None
        logits, hidden = self.model.forward(tokens, self.cache, rows, routing=routed)
        self.cache.lengths[rows] += 1
        new = self._sample_one(running, logits[:, 0], sampling, seed)
        if self._pending is not None:
            self._pending.defer(hidden[:, 0], new)
        if self._capture:
            for s, h in zip(running, hidden):
                s.captured.append(h)
        if routed is not None:
            for s, r in zip(running, torch.stack(routed, 2)):
                s.routed.append(r)
        return len(running)

    def _sample_one(self, seqs: list[_Sequence], logits: Tensor, sampling: SamplingParams,
                    seed: int) -> list[int]:
        logprobs = sampling_logprobs(logits, sampling)
        chosen = sample(logprobs, sampling, _uniforms(seqs, sampling, seed))
        chosen_lp = logprobs.gather(-1, chosen[:, None])[:, 0]
        toks = chosen.tolist()
        sets = kept_sets(logprobs) if cuts(sampling) else [None] * len(seqs)
        for s, tok, lp, kept in zip(seqs, toks, chosen_lp.tolist(), sets):
            self._append(s, [tok], [lp], sampling.ignore_eos, None if kept is None else [kept])
        return toks

    def _append(self, s: _Sequence, tokens: list[int], logprobs: list[float], ignore_eos: bool,
                sets: list[list[int]] | None = None) -> None:
        """Add emitted tokens (with the sets they were sampled from, when cut), stopping at EOS, the
        token limit or the context."""
        kept, stops = s.tokens, self.stop_ids
        for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
            kept.append(tok)
            s.logprobs.append(lp)
            if sets is not None:
                s.sample_sets.append(sets[i])
            s.pending = tok
            if tok in stops and not ignore_eos:
                s.finish = "stop"
            elif len(kept) >= s.max_new:
                s.finish = "length"
            elif s.prompt_len + len(kept) >= self.max_context:
                s.finish = "context"
            if s.finish:
                return

    # -- static steps ---------------------------------------------------------------------
    def _static_takes(self, config: SpecConfig | None) -> bool:
        """A static step can run this step: the engine has static steps, and a speculative step verifies
        trees whose learned part, if any, the draft window and the tree's cache room hold (with a per-sequence
        budget, learned trees only)."""
        if self.steps is None:
            return False
        if config is None:
            return True
        if isinstance(self.policy, PerSequencePolicy) and self.drafts != "learned":
            return False  # (a merged tree's nodes carry no scores for `select` yet)
        return self.drafts == "index" or (config.depth + 1 <= self.draft_window
                                          and (config.depth - 1) * config.topk <= STATIC_TREE_ROOM)

    def _step_shape(self, running: int, config: SpecConfig | None, context: int, static: bool) -> tuple[int, int]:
        """The rows and cache positions a decode step's target forward runs for `running` rows whose longest
        has `context` cached: a static step's batch bucket and the bucket of that length plus the step's new
        tokens; an eager step's own rows and that length."""
        needed = context + (1 if config is None else config.num_verify)
        if not static:
            return running, needed
        return batch_bucket(running), context_bucket(needed, self.max_context + TREE_SLACK - STATIC_TREE_ROOM)

    def _static_step(self, running: list[_Sequence], config: SpecConfig | None, context: int,
                     shape: tuple[int, int], sampling: SamplingParams) -> tuple[int, list[int] | None]:
        """One step of the running rows, padded to their bucket (`shape`: `_step_shape`'s rows and cache
        positions), through the step functions (replaying the step's graph where captured); its results
        come back in one copy. Returns (tokens emitted, accepted per sequence or None for a plain step)."""
        assert self.steps is not None
        B = len(running)
        rows, ctx = shape
        if self._pending is not None:
            self._pending.flush(self.cache.lengths)  # the states of eager plain steps before this one
        # a graph is keyed by everything its step's Python decides on: the shape, the sampling rule (not
        # the length limit, which only the host reads), whether the draft's states are kept, the routing
        rule = (sampling.temperature, sampling.top_p, sampling.top_k)
        merged = None  # drafts index | hybrid: the tree the host merged, which the step verified
        if config is None:
            out = self.graphs.run(("plain", rows, ctx, rule, self._pending is not None, self._routing),
                                  lambda: self.steps.plain(rows, ctx, sampling, self._pending, self._routing))
            levels = 1
        elif self.drafts == "learned" and not isinstance(self.policy, PerSequencePolicy):
            out = self.graphs.run((config, rows, ctx, rule, self._routing),
                                  lambda: self.steps.speculate(config, rows, ctx, sampling, self._pending,
                                                               self._routing))
            levels = config.depth + 1
        else:  # a tree the host cut (a per-sequence budget) or merged (drafts index | hybrid), then verified
            if self.drafts == "learned":
                nodes, depth = self._cut_tree(running, config, rows, ctx)
            else:
                nodes = config.num_verify
                merged, depth = self._merged_tree(running, config, rows, ctx)
            out = self.graphs.run(("verify", nodes, depth, rows, ctx, rule, self._routing),
                                  lambda: self.steps.verify(nodes, depth, rows, ctx, sampling, self._pending,
                                                            self._routing))
            levels = depth + 1
        self._tidy_index(hidden=True)  # the step function computes on a GPU: launched, not waited for
        ahead = getattr(self.policy, "ahead", None) if self._pending is not None and self.speculating else None
        packed = self._read_back(out.packed[:B], ahead and (lambda: ahead(B, context, config)))
        result = StepResult.unpack(packed, levels)
        if not all(result.finite):
            log.warning("non-finite draft (draft version %d): plain tokens for %d rows this step",
                        self.draft_version, result.finite.count(False))
        emitted = 0
        cut, ignore_eos, capture, experts = cuts(sampling), sampling.ignore_eos, self._capture, out.experts
        for b, s in enumerate(running):  # (the invariants hoisted: this loop is a step's host work per row)
            a = result.accepted[b]
            nodes = [0] + result.path[b][:a] if cut or capture or experts is not None else None
            before = len(s.tokens)
            self._append(s, result.tokens[b][: a + 1], result.logprobs[b][: a + 1], ignore_eos,
                         kept_sets(out.logprobs[b, nodes]) if cut else None)
            emitted += len(s.tokens) - before
            if config is not None:
                s.spec_steps += 1
                s.spec_emitted += a + 1
            # indexing by a list copies: a graph's outputs are overwritten by its next replay
            if capture:
                s.captured.append(out.hidden[b, nodes])
            if experts is not None:  # the accepted nodes' routing
                s.routed.append(experts[b, nodes])
        if merged is not None:  # observed at the next merged step, while its draft computes (`_observe_held`)
            L = levels  # (the packed columns, `pack`: a copy, as the next step's read-back overwrites them)
            outcome = packed[:, 2 * L:3 * L].long()  # the accepted path, then the accepted count
            self._unobserved = (merged, outcome[:, :L - 1], outcome[:, L - 1])
        return emitted, None if config is None else result.accepted

    def _cut_tree(self, running: list[_Sequence], config: SpecConfig, rows: int, ctx: int) -> tuple[int, int]:
        """A static step with a verify budget per sequence (`PerSequencePolicy`): the learned draft's trees
        (its step function, read back), the nodes the policy keeps at one of the widths the verify step runs
        (`node_widths`: the same width for every row, as a captured step's shape is), the cut trees written
        into the verify step's input (`cut_tree`). Returns the width and the levels the verify walks."""
        assert self.steps is not None and self._pending is not None
        B, N = len(running), config.num_verify
        out = self.graphs.run(("draft", config, rows, ctx),
                              lambda: self.steps.propose(config, rows, ctx, self._pending))
        tree, finite = unpack_learned(self._read_back(out[:B]), N)
        if not bool(finite.all()):
            log.warning("non-finite draft (draft version %d): plain tokens for %d rows this step",
                        self.draft_version, int((~finite).sum()))
        scores = tree.score[:, 1:].masked_fill(~finite[:, None], -math.inf)  # such a row's nodes: never kept
        chosen = self.policy.select(scores, tree.depth[:, 1:], config, B, widths=node_widths(N))
        cut = cut_tree(tree, chosen, finite)
        width = cut.tokens.shape[1]
        depth = depth_bucket(int(cut.depth.masked_fill(~cut.valid, 0).max()), config.depth)
        tree_rows(cut, self._tree_input_rows(width, rows), depth)
        self._send_tree_input(width, rows)
        return width, depth

    def _merged_tree(self, running: list[_Sequence], config: SpecConfig, rows: int, ctx: int) -> tuple[Tree, int]:
        """A merged static step's tree: the learned draft's (drafts: hybrid; drafted by its step function
        while the host looks up the index, then read back) merged on the host with the index's candidates
        straight into the verify step's input (`merged_rows`). Returns the tree (on the host, for the
        calibration) and the levels its verify walks: the deepest node's on the ladder. No node is deeper
        than the draft window allows (`keep_states`), which only shortens what the step can accept."""
        assert self.steps is not None and self._pending is not None
        B, N = len(running), config.num_verify
        packed = None
        if self.drafts == "hybrid":  # launched first: on a GPU the host's work below runs while it drafts
            out = self.graphs.run(("draft", config, rows, ctx),
                                  lambda: self.steps.propose(config, rows, ctx, self._pending))
        t = time.perf_counter()
        self._observe_held()
        candidates = self._index_candidates(running, config)
        if self.drafts == "hybrid":
            self._counts["hidden_s"] += time.perf_counter() - t
            packed = self._read_back(out[:B])
        t = time.perf_counter()
        cap = min(N - 1, self.draft_window - 1)
        tree, deepest, finite = merged_rows(packed, candidates, torch.tensor([s.pending for s in running]), N,
                                            self.calibration, cap, self._tree_input_rows(N, rows))
        if not finite:
            log.warning("non-finite draft (draft version %d): the index's candidates alone this step",
                        self.draft_version)
        depth = depth_bucket(deepest, cap)
        self._send_tree_input(N, rows)
        self._counts["merge_s"] += time.perf_counter() - t
        return tree, depth

    def _tree_input_rows(self, nodes: int, rows: int) -> Tensor:
        """Where the host writes a merged tree for the verify step (`merged_rows`): its input buffer on the
        CPU; on a GPU a pinned buffer, which `_send_tree_input` then copies there."""
        assert self.steps is not None
        buffer = self.steps.tree_input(nodes)
        if buffer.device.type == "cpu":
            return buffer[:rows]
        staging = self._tree_staging.get(nodes)
        if staging is None:
            staging = self._tree_staging[nodes] = torch.empty(self.rows, 4 * nodes, dtype=torch.long, pin_memory=True)
        return staging[:rows]

    def _send_tree_input(self, nodes: int, rows: int) -> None:
        """On a GPU: one copy of the written tree, ordered on the stream before the step (the read-back after
        the step waits for it, so the pinned buffer is free again by the next step's merge)."""
        assert self.steps is not None
        buffer = self.steps.tree_input(nodes)
        if buffer.device.type != "cpu":
            buffer[:rows].copy_(self._tree_staging[nodes][:rows], non_blocking=True)

    def _tidy_index(self, hidden: bool = False) -> None:
        """The index's upkeep after the sequences retired since the last step (`SuffixIndex.tidy`: removing
        responses past a prompt's limit walks each through its trie), once a step, between its lookups and
        its retire, eager and static alike (the same candidates either way); a static step runs it while its
        step function computes (`hidden`: counted as such)."""
        if self.index is None:
            return
        t = time.perf_counter()
        self.index.tidy()
        seconds = time.perf_counter() - t
        self._counts["index_s"] += seconds
        if hidden:
            self._counts["hidden_s"] += seconds

    def _observe_held(self) -> None:
        """Observe the last merged static step's outcome, if not yet (`_observe_merged`): before the next
        merge, which ranks by it, and before the call's stats."""
        if self._unobserved is not None:
            self._observe_merged(*self._unobserved)
            self._unobserved = None

    def _observe_merged(self, tree: Tree, path: Tensor, accepted: Tensor) -> None:
        """What a verified merged tree says of its sources (its accepted `path` and counts, as `Verified`
        holds them): each source's node acceptance (the calibration that ranks the next merges) and the
        accepted tokens the index proposed."""
        t = time.perf_counter()
        self._counts["index_accepted"] += observe_verified(self.calibration, tree, path, accepted)
        self._counts["merge_s"] += time.perf_counter() - t

    def _read_back(self, packed: Tensor, meanwhile: Callable[[], None] | None = None) -> Tensor:
        """The step's packed results on the host: on a GPU one copy into a pinned buffer, then the wait;
        `meanwhile` (the policy's `ahead`) runs before the wait, while the device still computes the step
        (on the CPU, where the step is done, at the same point of the step). Its seconds and the wait's
        after it are summed (`ahead_s`, `wait_s`): a wait left after it says the device's steps outlasted it."""
        host = packed
        if packed.device.type != "cpu":
            n = packed.numel()
            if self._readback is None or self._readback.numel() < n:
                self._readback = torch.empty(max(n, 4096), dtype=packed.dtype, device="cpu", pin_memory=True)
            host = self._readback[:n].view(packed.shape)
            host.copy_(packed, non_blocking=True)
        if meanwhile is not None:
            t = time.perf_counter()
            meanwhile()
            self._counts["ahead_s"] += time.perf_counter() - t
        if packed.device.type != "cpu":  # (on the CPU the step is done: nothing is waited for)
            t = time.perf_counter()
            torch.cuda.current_stream(packed.device).synchronize()
            self._counts["wait_s"] += time.perf_counter() - t
        return host

    # -- speculation ----------------------------------------------------------------------
    def _speculate(self, running: list[_Sequence], config: SpecConfig, sampling: SamplingParams,
                   seed: int) -> tuple[int, list[int] | None]:
        """One draft-tree-verify step for all running sequences: (tokens emitted, accepted per sequence)."""
        assert self.draft is not None and self.draft_cache is not None
        B = len(running)
        rows = slice(0, B)
        pending = torch.tensor([s.pending for s in running])
        try:
            tree = self._draft(running, rows, pending, config)
        except NonFiniteDraft as e:
            log.warning("%s (draft version %d): plain decoding for this step", e, self.draft_version)
            return self._decode(running, sampling, seed), None
        if isinstance(self.policy, PerSequencePolicy):  # a verify budget per sequence
            chosen = self.policy.select(tree.score[:, 1:], tree.depth[:, 1:], config, B)
            tree = tree.restricted(chosen if tree.valid is None else chosen & tree.valid[:, 1:])
        start = self.cache.lengths[rows].clone()
        ragged = tree.valid is not None and not bool(tree.valid.all())
        routed = [] if self._routing else None
        logits, hidden = self.model.forward(tree.tokens, self.cache, rows, positions=start[:, None] + tree.depth,
                                            new_mask=tree.mask, valid=tree.valid if ragged else None, routing=routed)
        experts = torch.stack(routed, 2) if routed is not None else None  # [B, nodes, sparse layers, k]
        node_logprobs = sampling_logprobs(logits, sampling)
        result = verify_tree(node_logprobs, tree, sampling,
                             _uniforms(running, sampling, seed, levels=int(tree.depth.max()) + 1))
        self._keep_path(rows, start, result.path, result.accepted)
        self.cache.lengths[rows] = start + result.accepted + 1
        self._keep_pending(start, hidden, result)
        if tree.source is not None:  # a merged tree
            self._observe_merged(tree, result.path, result.accepted)
        emitted = 0
        accepted, tokens, logprobs, path = (t.tolist() for t in (result.accepted, result.tokens, result.logprobs, result.path))
        for b, s in enumerate(running):
            a = accepted[b]
            before = len(s.tokens)
            # emitted token k was sampled at the root (k = 0) or at the k-th accepted node
            sets = kept_sets(node_logprobs[b, [0] + path[b][:a]]) if cuts(sampling) else None
            self._append(s, tokens[b][: a + 1], logprobs[b][: a + 1], sampling.ignore_eos, sets)
            emitted += len(s.tokens) - before
            s.spec_steps += 1
            s.spec_emitted += a + 1
            if self._capture:  # the root and the accepted nodes (a view: nothing writes to forward outputs)
                s.captured.append(hidden[b, [0] + path[b][:a]])
            if experts is not None:  # the verify forward's routing of the kept nodes; rejected ones' is dropped
                s.routed.append(experts[b, [0] + path[b][:a]])
        return emitted, accepted

    def _draft(self, running: list[_Sequence], rows: slice, pending: Tensor, config: SpecConfig) -> Tree:
        """The step's tree of `config`'s node budget: the learned draft's (EAGLE-2), the index's
        continuations, or both merged (`hybrid_tree`)."""
        learned = None
        if self.drafts != "index":
            assert self.draft is not None and self.draft_cache is not None
            root_features = self._draft_catch_up(running)
            learned = draft_tree(self.draft, self.draft_cache, rows, root_features, pending, config)
            if self.drafts == "learned":
                return learned
        self._observe_held()  # (a merged static step's, where static and eager merged steps mix)
        candidates = self._index_candidates(running, config)
        t = time.perf_counter()
        tree = hybrid_tree(learned, candidates, pending, config.num_verify, self.calibration)
        self._counts["merge_s"] += time.perf_counter() - t
        return tree

    def _index_candidates(self, running: list[_Sequence], config: SpecConfig) -> CandidateRows:
        """Each row's continuations from the index after its pending token, at most the tree's budget.
        Every row's text is brought up to date before any row looks up, so each row's lookup sees every token
        its siblings emitted before this step, whatever its place in the batch."""
        assert self.index is not None
        t = time.perf_counter()
        out, matched = self.index.lookup_rows([self._indexed(s) for s in running], config.num_verify - 1)
        self._counts["index_s"] += time.perf_counter() - t
        self._counts["index_matched"] += matched
        self._counts["index_lookups"] += len(out)
        return out

    def _indexed(self, s: _Sequence) -> Response:
        """The sequence's response in the index, holding every token it has emitted (opened at first use)."""
        assert self.index is not None
        if s.response is None:
            prompt = self._requests[s.index].prompt_ids
            s.response = self.index.open(tuple(prompt), prompt)
        if len(s.tokens) > s.response.written:
            s.response.extend(s.tokens[s.response.written:])
        return s.response

    def _keep_pending(self, start: Tensor, hidden: Tensor, result: Verified) -> None:
        """The states of a verify step whose keys stay in the cache (the root and the accepted nodes,
        at positions start .. start + accepted), with the token that follows each, for the draft."""
        assert self._pending is not None
        B, D = len(start), int(result.accepted.max())
        k = torch.arange(D + 1)
        kept = k[None] <= result.accepted[:, None]
        nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), result.path[:, :D]], 1)
        rows = torch.arange(B)[:, None].expand(B, D + 1)
        self._pending.put(rows[kept], (start[:, None] + k)[kept], hidden[rows[kept], nodes[kept]],
                          result.tokens[:, : D + 1][kept])

    def _routed(self, s: _Sequence) -> Tensor | None:
        """Experts of positions 0..T-1 of prompt + response [T, sparse layers, k]: each position's from
        the forward that ran its token (a prompt's prefill, a plain step, or the verify that accepted
        it); the last token was sampled and never ran (-1), and rows past a stop are dropped."""
        if not self._routing:
            return None
        ran = torch.cat(s.routed)[: s.prompt_len + len(s.tokens) - 1].cpu()
        return torch.cat([ran, torch.full_like(ran[:1], -1)])

    def _captured(self, s: _Sequence) -> Tensor | None:
        """States of positions 0..T-2 of prompt + response (T tokens); rows computed for tokens
        past a stop are dropped."""
        if not self._capture:
            return None
        return torch.cat(s.captured)[: s.prompt_len + len(s.tokens) - 1]

    def _draft_catch_up(self, running: list[_Sequence]) -> Tensor:
        """Feed the draft the target states it has not seen (accepted paths, decoded and prefilled
        tokens) in one forward; its output at the last one is its prediction at the pending token.

        A row more than `draft_window` states behind (it decoded plainly for a while) feeds only its
        last `draft_window` states, and from then on the draft attends to those onwards: the first
        speculative step after a stretch of plain decoding then costs a window, not the stretch. This
        can only lower the draft's acceptance, never change an output (verification is exact)."""
        assert self.draft is not None and self.draft_cache is not None
        assert self._pending is not None
        B = len(running)
        end = self.cache.lengths[:B]  # the draft catches up to the target
        counts = (end - self.draft_cache.lengths[:B]).clamp(0, self._pending.window)
        self._pending.flush(self.cache.lengths)
        with torch.inference_mode():  # as wide as the furthest-behind row, over the longest row's cache
            return catch_up(self.draft, self.draft_cache, self.cache, self._pending, B, int(counts.max()),
                            int(end.max()) + 1)

    def _keep_path(self, rows: slice, start: Tensor, path: Tensor, accepted: Tensor) -> None:
        """Move the accepted nodes' keys/values to the positions right after the root, for the deepest
        accepted path's levels only (the rest of the tree is left beyond the length, overwritten later)."""
        keep_path(self.cache, rows.stop, start, path[:, : int(accepted.max())], accepted)

    # -- bookkeeping ----------------------------------------------------------------------
    def _retire(self, running: list[_Sequence], done: dict[int, _Sequence]) -> None:
        """Remove finished sequences, moving the last running row into each freed row."""
        row = 0
        while row < len(running):
            if running[row].finish is None:
                row += 1
                continue
            if self._pending is not None:
                self._pending.flush(self.cache.lengths)  # rows are about to move
            if self.index is not None:  # a finished response stays in the index as its prompt's history
                t = time.perf_counter()
                self._indexed(running[row]).close(tidy=False)  # its prompt's limits: `_tidy_index`
                self._counts["index_s"] += time.perf_counter() - t
            done[running[row].index] = running[row]
            last = len(running) - 1
            if row != last:
                self.cache.move_row(last, row)
                if self.draft_cache is not None:
                    self.draft_cache.move_row(last, row)
                if self._pending is not None:
                    self._pending.move_row(last, row)
                if self.state is not None:
                    self.state.move_row(last, row)
                running[row] = running[last]
            if self.state is not None:  # the freed row pads static steps from now on: length 0, its scratch slot
                self.state.clear_row(last)
                for cache in (self.cache, self.draft_cache):
                    if cache is not None:
                        cache.lengths[last] = 0
                        cache.visible_from[last] = 0
            running.pop()

    def _host_seconds(self) -> float:
        """Host seconds of index drafting so far in this call: the index's and the merged trees'."""
        return self._counts["index_s"] + self._counts["merge_s"]

    def _count_step(self, config: SpecConfig | None, running: int, emitted: int, seconds: float) -> None:
        c = self._counts
        c["decode_steps"] += 1
        c["running_sum"] += running
        c["emitted"] += emitted
        if config is not None:
            c["spec_steps"] += 1
            c["spec_seq_steps"] += running
            c["spec_emitted"] += emitted
        bucket = _bucket(running)
        name = "off" if config is None else config.name
        self._by_config.setdefault(bucket, Counter())[name] += 1
        self._trace.append((running, name, emitted, seconds))

    def _count_reads(self, config: SpecConfig | None, running: int, static: bool, shape: tuple[int, int],
                     cached: int) -> None:
        """What a decode step's target forward computed beyond its rows' needs (`shape`: the rows and cache
        positions it ran, `_step_shape`; `cached`: the running rows' cached tokens in all): the token slots
        of padded rows, and the cache positions its attention read beyond each row's own (every row reads
        to the longest row, or to the context bucket; a padded row all of it)."""
        new = 1 if config is None else config.num_verify
        rows, ctx = shape
        c = self._counts
        c["static_steps"] += static
        c["slots"] += rows * new
        c["padded_slots"] += (rows - running) * new
        c["positions_read"] += rows * ctx
        c["positions_needed"] += cached + running * new

    def _finish_stats(self, out: list[_Sequence], seconds: float) -> None:
        c = self._counts
        tokens = sum(len(s.tokens) for s in out)
        self._stats = dict(
            sequences=len(out), tokens=tokens, seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9),
            decode_steps=c["decode_steps"], mean_running=c["running_sum"] / max(c["decode_steps"], 1),
            prefill_s=c["prefill_s"], decode_s=sum(step[3] for step in self._trace),
            spec_steps=c["spec_steps"], spec_seq_steps=c["spec_seq_steps"], spec_emitted=c["spec_emitted"],
            # tokens emitted per sequence per verify forward (accepted draft tokens + 1)
            accept_len=c["spec_emitted"] / c["spec_seq_steps"] if c["spec_seq_steps"] else 1.0,
            # drafts: index | hybrid: the index's host seconds (lookups, inserts, history), the host
            # seconds of building the merged trees and calibrating their nodes, how many lookups
            # matched, and the accepted tokens the index proposed
            index_s=c["index_s"], merge_s=c["merge_s"], index_lookups=c["index_lookups"],
            index_matched=c["index_matched"],
            index_accepted=c["index_accepted"], host_steps=list(self._host_steps),
            # the host seconds of the policy's choices and updates (on every step's path), of its `ahead` in
            # static steps (while the device computes), and of waiting on the device after it
            policy_s=c["policy_s"], ahead_s=c["ahead_s"], wait_s=c["wait_s"],
            capture_s=c["capture_s"], static_steps=c["static_steps"], token_slots=c["slots"],
            padded_slots=c["padded_slots"], positions_read=c["positions_read"],
            positions_needed=c["positions_needed"], **padding_shares(c["slots"], c["padded_slots"],
                                                                    c["positions_read"], c["positions_needed"]),
            config_by_concurrency={b: dict(v) for b, v in sorted(self._by_config.items())},
            trace=list(self._trace),
        )


def _cached(s: _Sequence) -> int:
    """Tokens in the sequence's target cache: its prompt and all it emitted but the pending token."""
    return s.prompt_len + len(s.tokens) - 1


def _uniforms(seqs: list[_Sequence], sampling: SamplingParams, seed: int, levels: int = 0) -> Tensor | None:
    """The sampling noise of each sequence's next position ([B]), or of its next `levels` positions
    ([B, levels], for a verify step): keyed by (seed, request, position), never by batch row."""
    if sampling.greedy:
        return None
    request = torch.tensor([s.key for s in seqs])
    position = torch.tensor([len(s.tokens) for s in seqs])
    if levels:
        request, position = request[:, None], position[:, None] + torch.arange(levels)
    return sampling_uniforms(seed, request, position)


def _bucket(running: int) -> str:
    for hi in (1, 2, 4, 8, 16, 32, 64, 128):
        if running <= hi:
            return f"<={hi}"
    return ">128"
