"""The emulated scheduler: its start (the policy, the arguments it derives from), request validation and
generation (continuous batching, the radix cache with the KV slots it holds, sampling, EAGLE's verify,
hidden states, routed experts, outputs); EAGLE and weight updates are its mixins (eagle.py, weights.py),
the routed-experts record its capturer (routed.py)."""

from __future__ import annotations

import itertools
import json
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .common import EmulationError, decode_capture_sizes, hf_eos_token_ids, resolve_dtype
from .eagle import Eagle
from .routed import RoutedExperts, encode
from .weights import Weights, checkpoint_names

DEFAULT_CHUNKED_PREFILL = 8192  # what SGLang picks on a large GPU when chunked_prefill_size is None


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: Any  # SamplingParams
    hidden: bool
    mask: bool
    routed: bool = False  # return_routed_experts
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask_ids: list[list[int]] = field(default_factory=list)
    mask_logprobs: list[float] = field(default_factory=list)
    hidden_states: list = field(default_factory=list)
    finish: dict | None = None
    verify_ct: int = 0
    cached: int = 0
    histogram: list[int] = field(default_factory=list)  # verify steps by accepted drafts
    slots: list[int] = field(default_factory=list)  # the KV slot of each position fed (req_to_token)
    routed_experts: Any = None  # int32 [seqlen - 1, layers, k], gathered when it finished


@dataclass
class _Running:  # a request in the running batch, between decode steps
    request: _Request
    cache: Any  # its KV cache
    last_state: torch.Tensor  # the target's state at its last fed position (the draft's input)
    done: bool


class Scheduler(Eagle, Weights):
    def __init__(self, args):
        from transformers import AutoModelForCausalLM

        from sglang.srt.plugins import load_plugins

        load_plugins()  # run_scheduler_process: plugins may add Scheduler methods (collective_rpc's targets)
        self.draft_worker = None

        self.args = args
        path = Path(args.model_path)
        self.config = json.loads((path / "config.json").read_text())
        if self.config.get("model_type") == "qwen3_moe" and (self.config.get("mlp_only_layers")
                                                           or self.config.get("decoder_sparse_step", 1) != 1):
            raise EmulationError("SGLang builds every Qwen3-MoE layer as a sparse block (models/qwen3_moe.py "
                                 "stage_facts): this checkpoint's dense layers would lose their weights")
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.vocab = self.config["vocab_size"]
        self.context_len = args.context_length or self.config.get("max_position_embeddings", 2048)
        self.eos = hf_eos_token_ids(path, self.config)
        self.target_dtype = resolve_dtype(self.config, args.dtype)
        self.tp = args.tp_size
        self.targets = checkpoint_names(self.model)  # what a push loads, by the names SGLang's loader maps
        self.names = {n: tuple(t.shape) for n, t in self.targets.items()}
        self.garbage: set[str] = set()  # target tensors whose memory was released and not reloaded
        self.draft_garbage: set[str] = set()
        self.generation = 0  # target weight loads so far (the radix cache's entries remember theirs)
        self.cache: list[tuple[tuple[int, ...], int, list[int]]] = []  # sequences whose KV the radix cache
        # holds: tokens, the weight load that computed them, their KV slots
        self.kv_slots = itertools.count()  # KV slots, never reused (a freed slot's old row is never read)
        self.experts = RoutedExperts.for_model(self.model, self.config) if args.enable_return_routed_experts else None
        self.session: str | None = None
        self.session_loaded = False
        self.offloaded: set[str] = set()
        self.weight_version = "default"
        self.rng = torch.Generator().manual_seed(args.random_seed or 0)
        self.chunk = DEFAULT_CHUNKED_PREFILL if args.chunked_prefill_size is None else args.chunked_prefill_size
        self.mask_cap = args.sampling_mask_max_tokens
        self.calls: list[str] = []  # what the scheduler received, for tests
        self.max_running = args.max_running_requests or 1 << 30
        self.capture_sizes = decode_capture_sizes(args)
        self.decode_steps: list[tuple[int, int]] = []  # (batch size, depth) of each decode step, for tests
        self.algorithm = args.speculative_algorithm
        self.draft: dict[str, torch.Tensor] | None = None
        self.reserved = 0
        if self.algorithm is not None:
            self._start_eagle(args)

    # -- generation -----------------------------------------------------------------------------
    def validate(self, prompt: list[int], params) -> None:
        """tokenizer_manager.py _validate_one_request: the whole call raises."""
        n = len(prompt) + self.reserved
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        if params.max_new_tokens is not None and params.max_new_tokens + n > self.context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                             f"tokens. You requested a total of {params.max_new_tokens + n} tokens: {n} tokens from "
                             f"the input messages and {params.max_new_tokens} tokens for the completion.")

    def run(self, requests: list[_Request]) -> None:
        if self.session is not None:
            raise EmulationError("generate while a weight-update session is open: SGLang would serve a mix of versions")
        if self.offloaded:
            raise EmulationError(f"generate with {sorted(self.offloaded)} released")
        if self.garbage:
            raise EmulationError(f"generate from released target weights never pushed again ({len(self.garbage)} "
                                 f"tensors are garbage): SGLang would sample from garbage")
        if self.draft is not None and self.draft_garbage:
            raise EmulationError("generate with a released draft that has no CPU backup")
        if self.experts is not None and self.algorithm is not None and any(r.routed for r in requests):
            raise EmulationError("routed experts under EAGLE: SGLang moves a tree's accepted path in the KV cache "
                                 "but not its record, and sizes the capture buffer without verify tokens "
                                 "(state_capturer/routed_experts.py:79-83); not emulated")
        for r in requests:  # scheduler.py: requests it refuses end as aborts (400), which the call raises
            if r.mask:
                top_k = r.params.top_k
                if top_k != 1 and not 1 < top_k <= self.mask_cap:
                    raise ValueError(f"return_sampling_mask requires top_k=1 for greedy sampling or finite "
                                     f"1 < top_k <= {self.mask_cap}; got top_k={top_k}. Lower top_k or increase "
                                     f"--sampling-mask-max-tokens.")
                if self.algorithm is not None:
                    raise ValueError("return_sampling_mask is not supported with speculative decoding.")
        # continuous batching (managers/scheduler.py:3894 get_next_batch_to_run: a prefill batch of waiting
        # requests whenever they fit, else a decode step of the running batch)
        waiting, running = deque(requests), []
        while waiting or running:
            while waiting and len(running) < self.max_running:
                if (state := self._prefill(waiting.popleft())) is not None:
                    running.append(state)
            if not running:
                continue
            steps = self._steps(len(running)) if self.algorithm is not None else 0
            self.decode_steps.append((len(running), steps))
            for state in running:
                self._decode(state, steps)
            for state in running:
                if state.done:
                    self._retire(state)
            running = [state for state in running if not state.done]

    def _match(self, prompt: list[int]) -> tuple[int, list[int]]:
        """(cached tokens, their KV slots): the longest prefix the radix cache holds, short of the whole
        prompt (SGLang computes at least its last token)."""
        best, generation, slots = 0, self.generation, []
        for seq, gen, held in self.cache:
            n = 0
            for a, b in zip(seq, prompt):
                if a != b:
                    break
                n += 1
            if n > best:
                best, generation, slots = n, gen, held
        best = min(best, len(prompt) - 1)
        if best and generation != self.generation:
            raise EmulationError("a prefix computed by older weights was served from the radix cache: the cache "
                                 "was not flushed after a weight update")
        return best, list(slots[:best])

    def _insert(self, seq: list[int], slots: list[int]) -> None:
        assert len(slots) == len(seq)
        self.cache.append((tuple(seq), self.generation, list(slots)))

    def _allocate(self, n: int) -> list[int]:
        return [next(self.kv_slots) for _ in range(n)]

    @contextmanager
    def _recording(self):
        """Around one target forward: each sparse layer's top-k, by layer id, when the server captures
        (it records every forward, a request's that did not ask too: a later request that asks may read
        those rows through the radix cache)."""
        if self.experts is None:
            yield None
            return
        with self.experts.capture() as seen:
            yield seen

    def _noise(self, seed: int, position: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((seed * 1_000_003 + position) % (2**63))
        u = torch.rand(self.vocab, generator=g, dtype=torch.float64).clamp(1e-300, 1 - 1e-16)
        return -torch.log(-torch.log(u))

    def _sample(self, logits: torch.Tensor, r: _Request, position: int) -> tuple[int, float, list[int] | None, float]:
        """(token, output logprob, sampling-mask ids, sampling-mask logprob) for one position."""
        p = r.params
        logits = logits.float()
        if p.top_k == 1:  # greedy (temperature 0 became top_k 1)
            token = int(logits.argmax())
            return token, float(torch.log_softmax(logits, -1)[token]), [token], 0.0
        scaled = logits / p.temperature
        logprobs = torch.log_softmax(scaled, -1)
        probs = torch.softmax(scaled, -1)
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        sorted_probs[torch.arange(self.vocab) >= p.top_k] = 0.0
        sorted_probs[(cumulative - sorted_probs) > p.top_p] = 0.0
        deterministic = self.args.enable_deterministic_inference
        if deterministic:
            seed = p.sampling_seed if p.sampling_seed is not None else 42
            index = int((sorted_probs.double().log() + self._noise(seed, position)).argmax())
        else:
            index = int(torch.multinomial(sorted_probs, 1, generator=self.rng))
        token = int(order[index])
        support = sorted_probs > 0
        ids = order[support].tolist()
        if r.mask and len(ids) > self.mask_cap:
            raise ValueError(f"Sampling support exceeds --sampling-mask-max-tokens={self.mask_cap}, commonly because "
                             f"of cutoff ties. Lower top_k to leave more headroom or increase the server limit.")
        selected = float(torch.log(sorted_probs[index] / sorted_probs[support].sum()))
        return token, float(logprobs[token]), ids, selected

    def _finished(self, r: _Request, token: int) -> bool:
        """Req._check_token_based_finish (managers/schedule_batch.py:1857-1878): nothing with ignore_eos;
        else the request's stop_token_ids and the model's eos ids (Req.eos_token_ids, which the
        scheduler sets to ModelConfig.hf_eos_token_id: managers/scheduler.py:3009, 3077); the tokenizer's
        eos_token_id only with a tokenizer, which skip_tokenizer_init leaves None (scheduler.py:895-896).
        Then the length (check_finished)."""
        stops = self.eos | (r.params.stop_token_ids or set())
        if not r.params.ignore_eos and token in stops:
            r.finish = {"type": "stop", "matched": token}
            return True
        if len(r.out) >= r.params.max_new_tokens:
            r.finish = {"type": "length", "length": r.params.max_new_tokens}
            return True
        return False

    def _emit(self, r: _Request, sampled) -> bool:
        token, lp, ids, mlp = sampled
        r.out.append(token)
        r.logprobs.append(lp)
        if r.mask:
            r.mask_ids.append(ids)
            r.mask_logprobs.append(mlp)
        return self._finished(r, token)

    def _forward(self, ids: list[list[int]], cache=None):
        with warnings.catch_warnings():  # transformers' past_key_values rename
            warnings.simplefilter("ignore", FutureWarning)
            return self.model(torch.tensor(ids), past_key_values=cache, use_cache=True, output_hidden_states=True)

    @torch.no_grad()
    def _prefill(self, r: _Request) -> _Running | None:
        """The request's prefill and first token; None if that finished it."""
        prompt = r.prompt
        P = len(prompt)
        r.cached, r.slots = self._match(prompt)
        r.slots += self._allocate(P - r.cached)  # the uncached part's slots: what the forward computes
        with self._recording() as seen:
            out = self._forward([prompt])
        if seen is not None:
            self.experts.write(r.slots[r.cached:], seen, first=r.cached)
        cache, states = out.past_key_values, out.hidden_states[-1][0]
        extend = P - r.cached
        stored = extend if self.chunk <= 0 or extend <= self.chunk else (extend - 1) % self.chunk + 1
        if r.hidden:
            r.hidden_states.append(states[P - stored:].tolist())  # one element: the (last) prefill chunk's rows
        self._insert(prompt, r.slots)
        if r.params.max_new_tokens == 0:
            r.finish = {"type": "length", "length": 0}
            return None
        state = _Running(r, cache, states[-1], self._emit(r, self._sample(out.logits[0, -1], r, P)))
        if state.done:
            self._retire(state)
            return None
        return state

    @torch.no_grad()
    def _decode(self, state: _Running, steps: int) -> None:
        """One decode step of a running request at `steps` drafts (0: plain, or a depth-0 slot)."""
        r, cache = state.request, state.cache
        n = len(r.prompt) + len(r.out) - 1  # position of the last emitted token, not yet fed
        pending = r.out[-1]
        if steps == 0:
            slot = self._allocate(1)
            r.slots += slot
            with self._recording() as seen:
                out = self._forward([[pending]], cache)
            if seen is not None:
                self.experts.write(slot, seen, first=0)
            state.cache, hidden = out.past_key_values, out.hidden_states[-1][0, -1]
            if r.hidden:
                r.hidden_states.append(hidden.tolist())
            state.last_state = hidden
            state.done = self._emit(r, self._sample(out.logits[0, -1], r, n + 1))
            if self.algorithm is not None:
                # a depth-0 slot still runs EAGLE's verify, on a one-node tree: the root is accepted and
                # one token sampled (speculative/eagle_worker_v2.py:1469-1472, 1678-1684), and the
                # scheduler counts it as any verify step with 0 correct drafts: spec_verify_ct += 1,
                # slot 0 of the histogram (scheduler_components/batch_result_processor.py:783-787,
                # 832-836; schedule_batch.py:1566-1572)
                r.verify_ct += 1
                self._count_correct(r, 0)
            return
        drafted = self._propose(pending, state.last_state, steps)
        out = self._forward([[pending] + drafted], cache)
        state.cache, fed_states = out.past_key_values, out.hidden_states[-1][0]
        r.verify_ct += 1
        accepted = correct = 0
        for i in range(steps + 1):
            sampled = self._sample(out.logits[0, i], r, n + 1 + i)
            state.done = self._emit(r, sampled)
            accepted = i + 1
            correct += i < steps and sampled[0] == drafted[i]
            if state.done or i == steps or sampled[0] != drafted[i]:
                break
        self._count_correct(r, correct)
        r.slots += self._allocate(accepted)  # the accepted nodes' slots (the rest are freed)
        if r.hidden:
            r.hidden_states.extend(fed_states[:accepted].tolist())
        state.last_state = fed_states[accepted - 1]
        # keep the fed tokens that were accepted (the last emitted one is pending, not fed)
        if (surplus := state.cache.get_seq_length() - (n + accepted)) > 0:
            state.cache.crop(-surplus)

    def _retire(self, state: _Running) -> None:
        r = state.request
        seqlen = len(r.prompt) + len(r.out)  # out ends at the stop
        self._insert(r.prompt + r.out[:-1], r.slots[: seqlen - 1])
        if self.experts is not None and r.routed:  # batch_result_processor.py _maybe_collect_routed_experts
            r.routed_experts = self.experts.get_topk(r.slots, seqlen)
        if r.hidden:
            r.hidden_states = r.hidden_states[: len(r.out)]  # output_streamer.py: hs[: finished_len]

    @staticmethod
    def _count_correct(r: _Request, correct: int) -> None:
        """Req.update_spec_correct_drafts_histogram (managers/schedule_batch.py:1566-1572)."""
        r.histogram.extend([0] * (correct + 1 - len(r.histogram)))
        r.histogram[correct] += 1

    def output(self, r: _Request) -> dict:
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.prompt),
                "weight_version": self.weight_version, "num_retractions": 0,
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(r.logprobs, r.out)],
                "output_token_logprobs_length": len(r.out), "input_token_logprobs": [],
                "reasoning_tokens": 0, "completion_tokens": len(r.out), "cached_tokens": r.cached}
        if r.mask:
            meta["output_token_sampling_mask"] = r.mask_ids
            meta["output_token_sampling_logprobs"] = r.mask_logprobs
            meta["output_token_sampling_mask_length"] = len(r.mask_ids)
        if r.verify_ct:
            meta["spec_verify_ct"] = r.verify_ct
            meta["spec_accept_length"] = len(r.out) / r.verify_ct
            meta["spec_correct_drafts_histogram"] = list(r.histogram)
        if r.hidden:
            meta["hidden_states"] = r.hidden_states
        if r.routed_experts is not None:
            meta["routed_experts"] = encode(r.routed_experts)
        return {"output_ids": list(r.out), "meta_info": meta}
