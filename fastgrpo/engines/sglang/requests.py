"""What one SGLang 0.5.23 request sends and how its output becomes a Completion: the adapter's
request and output formats, read from SGLang's source (paths in the wheel, under sglang/srt/; the
conformance test checks each use against it):
- Seeds: `sampling_seed` is honoured only with `enable_deterministic_inference` (which forces the
  pytorch sampling backend: arg_groups/overrides.py, sampling/sampling_batch_info.py); the engine
  starts with it, so a request's samples follow its key wherever it runs.
- `output_token_logprobs` are `log_softmax(logits / T)` (layers/sampler.py): the sampling
  distribution only when neither top-k nor top-p cuts it. With a finite top-k and no speculation,
  `return_sampling_mask` returns each token's sampling support (`output_token_sampling_mask`: the
  kept token ids) and its log-probability renormalised over it (`output_token_sampling_logprobs`),
  which become `Completion.sample_sets` and `.logprobs`. SGLang refuses the mask with EAGLE and
  unless `1 < top_k <= sampling_mask_max_tokens` (managers/scheduler.py), and aborts a request whose
  support outgrows the cap (ties at the cutoff): the cap is set at start with headroom
  (`sampling_mask_cap`), and a call's top-k must fit it with that headroom (`check_sampling`).
- Stops: SGLang stops a request on config.json's and generation_config.json's eos ids (ModelConfig
  hf_eos_token_id, configs/model_config.py:2190-2208, given to every Req: managers/scheduler.py:3009)
  and on its `stop_token_ids`, but not on the tokenizer's eos: the engine starts with
  skip_tokenizer_init, and a Req checks the tokenizer's only when it has one (managers/scheduler.py:
  895-896, managers/schedule_batch.py:1857-1878). The engine's `stop_ids` go with every request as
  `stop_token_ids`; ignore_eos turns every token stop off.
- Context: SGLang refuses the whole call when a prompt plus `max_new_tokens` plus EAGLE's reserved
  draft slots exceeds the context (managers/tokenizer_manager.py, managers/utils.py): each request's
  `max_new_tokens` is clamped to what is left, and the clamp reported as a context stop.
- `return_hidden_states=True` (server flag `enable_return_hidden_states`): post-norm states, prefill
  rows for the prompt's uncached part only (a radix-cache hit: every GRPO group member after the
  first), then one row per emitted token. Chunked prefill (whose middle chunks return no rows) is off
  when states are captured; a capture call starts from an empty cache, so the rows a cache hit
  skipped were computed by another request of the same call and are taken from it (`fill_prefixes`).
- `return_routed_experts=True` (server flag `enable_return_routed_experts`; `routed_experts`): the
  experts each position ran, as the embedded engine records them (`Completion.routing`). SGLang keeps
  one int32 row [num_hidden_layers, num_experts_per_tok] per KV slot in a zeroed host buffer
  (state_capturer/routed_experts.py:72-93, state_capturer/base.py:63-75); every target forward writes
  the rows of the slots it computed, each sparse layer's column from its top-k, the logical expert ids
  before any expert-parallel remap (layers/moe/topk.py:2574, remap after it), the draft's layers never
  (routed_experts.py:177-190, model_executor/model_runner.py:721-723, 1222-1227), dense layers' columns
  left 0 (nothing captures them). A finished request gathers the rows of its slots for positions
  0..seqlen-2, seqlen = prompt + output through the stop (scheduler_components/batch_result_processor.py:
  136-161, base.py:173-188): every position but the last token, which was sampled and never run; a
  radix-cache hit's positions carry the routing of the forward that computed their KV. The tensor goes
  out as base64 of its bytes (detokenizer_manager.py:432-448; with skip_tokenizer_init, encoded the
  same way in tokenizer_manager.py:2602-2609). `decode_routing` decodes it and adds the last
  position's -1 row. Not with speculation (`ROUTING_SPECULATION`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fastgrpo.types import Completion, Request, SamplingParams

FINISH_REASONS = {"stop": "stop", "length": "length"}  # SGLang's meta_info["finish_reason"]["type"] -> ours
# SGLang's own values these depend on (the conformance test checks each against its source)
SGLANG_MASK_CAP = 4096  # sampling_mask_max_tokens' default (arg_groups/fields/exec_.py)
SGLANG_DEFAULT_ADAPTIVE_STEPS = 7  # the most steps of SGLang's default adaptive tiers (adaptive_spec_params.py)
TIE_HEADROOM = 64  # sampling-mask slots beyond top-k for tokens tied at the cutoff


# why routing replay on SGLang needs speculation off (the adapter and the config refuse it, citing this)
ROUTING_SPECULATION = (
    "SGLang 0.5.23 keys its routed-experts record by KV slot, and under EAGLE that record is not the accepted "
    "tokens' routing: with tree drafts (speculative_eagle_topk > 1) the accepted path's KV is moved to the "
    "front slots of the verify window (speculative/eagle_worker_common.py:772-784, speculative/spec_utils.py:"
    "859-910) while the record stays at the slots each tree node was verified in (state_capturer/base.py:"
    "117-118), so accepted tokens get other nodes' experts; and the capture buffer holds max(chunked_prefill_"
    "size, max_running_requests) tokens, not a verify step's requests x draft tokens (state_capturer/"
    "routed_experts.py:79-83, a FIXME). Chains (top-k 1) keep the accepted path in place but meet the same "
    "buffer, and none of it has run")


def sampling_mask_cap(top_k: int) -> int:
    """The `sampling_mask_max_tokens` an engine sampling with `top_k` needs: the top-k, plus headroom
    for tokens tied with the k-th (SGLang aborts a request whose support outgrows the cap)."""
    return top_k + max(top_k, TIE_HEADROOM)


def check_sampling(sampling: SamplingParams, speculating: bool, mask_max_tokens: int) -> bool:
    """Whether SGLang can report the log-probabilities of the distribution it samples from with these
    settings (raises if not, naming the config key); True: the kept-set renormalised ones are needed
    (`return_sampling_mask`). `mask_max_tokens`: the engine's `sampling_mask_max_tokens`."""
    cut = not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1)
    if not cut:
        return False
    if speculating:
        raise ValueError("rollout.top_k / rollout.top_p: with speculation, SGLang 0.5.23 reports only the "
                         "temperature-scaled log-probabilities (return_sampling_mask is refused with EAGLE); "
                         "use top_k 0 and top_p 1, or speculation.policy off")
    if sampling.top_k == 0:
        raise ValueError("rollout.top_p < 1 needs a finite rollout.top_k with engine.backend=sglang (SGLang 0.5.23 "
                         "returns the renormalised log-probabilities only for 1 < top_k <= sampling_mask_max_tokens)")
    if sampling.top_k < 2 or sampling_mask_cap(sampling.top_k) > mask_max_tokens:
        raise ValueError(f"rollout.top_k {sampling.top_k}: this SGLang engine returns renormalised log-probabilities "
                         f"for 1 < top_k with top_k + {TIE_HEADROOM} (or 2 top_k) <= sampling_mask_max_tokens "
                         f"{mask_max_tokens} (headroom for ties); start it with that top-k")
    return True


def sampling_params(sampling: SamplingParams, request: Request, seed: int, index: int,
                    max_new_tokens: int | None = None, stop_ids: Sequence[int] = ()) -> dict[str, Any]:
    """One request's SGLang sampling parameters (top_k -1: off; a seed of its own per request, from its
    key, else its index in the call; `max_new_tokens`: the clamped limit; `stop_ids`: the engine's stop
    ids, sent as `stop_token_ids`, which SGLang stops on unless ignore_eos: SGLang stops by itself only
    on config.json's and generation_config.json's eos ids, never on the tokenizer's with
    skip_tokenizer_init (managers/schedule_batch.py:1857-1878, configs/model_config.py:2190-2208,
    managers/scheduler.py:895-896)."""
    key = index if request.key is None else request.key
    return {"temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_new_tokens": max_new_tokens or request.max_new_tokens or sampling.max_new_tokens,
            "ignore_eos": sampling.ignore_eos, "sampling_seed": (seed * 1_000_003 + key) % 2**63,
            "stop_token_ids": sorted(set(stop_ids)) or None}  # None: none (sampling_params.py:201-205)


def flatten_hidden(chunks: list) -> Tensor:
    """`meta_info["hidden_states"]` as one [positions, H] tensor: prefill chunks arrive as lists of
    rows, decode steps as rows (one per emitted token)."""
    rows: list[list[float]] = []
    for chunk in chunks:
        if chunk and isinstance(chunk[0], list):
            rows.extend(chunk)
        else:
            rows.append(chunk)
    return torch.tensor(rows, dtype=torch.float32)


def captured(meta: dict, prompt_len: int, n_tokens: int) -> tuple[int, Tensor]:
    """(first position, states of positions first..prompt_len + n_tokens - 2) of one output: SGLang
    returns no rows for the `cached_tokens` a radix-cache hit skipped."""
    if int(meta.get("num_retractions", 0)):
        raise RuntimeError("SGLang retracted a request (KV memory ran short) and prefilled it again: its hidden "
                           "states cannot be aligned with positions; lower rollout.max_batch or raise "
                           "engine.mem_fraction")
    first = int(meta.get("cached_tokens", 0))
    rows = flatten_hidden(meta["hidden_states"])
    need = prompt_len + n_tokens - 1 - first
    if rows.shape[0] < need:
        raise RuntimeError(f"SGLang returned {rows.shape[0]} hidden states for positions {first}.."
                           f"{prompt_len + n_tokens - 2} (a prompt longer than SGLang's chunked_prefill_size gets "
                           f"none for its middle chunks: an engine started with draft.online on does not chunk)")
    return first, rows[:need]


def fill_prefixes(sequences: list[list[int]], parts: list[tuple[int, Tensor]]) -> list[Tensor]:
    """Each sequence's states at every position 0..len(rows) + first - 1: the positions a cache hit
    skipped (before `first`) come from another sequence of the call with the same tokens up to
    there (a state depends only on the tokens up to it)."""
    node_of: dict[tuple[int, int], int] = {}
    state_at: dict[int, Tensor] = {}
    paths = []
    for tokens, (first, rows) in zip(sequences, parts):
        node, path = 0, []
        for position in range(first + rows.shape[0]):
            node = node_of.setdefault((node, tokens[position]), len(node_of) + 1)
            path.append(node)
            if position >= first:
                state_at.setdefault(node, rows[position - first])
        paths.append(path)
    out = []
    for (first, rows), path in zip(parts, paths):
        missing = [p for p in range(first) if path[p] not in state_at]
        if missing:
            raise RuntimeError(f"no request of the call computed the states of positions {missing[0]}..{missing[-1]} "
                               f"(a radix-cache hit on a prefix from an earlier call)")
        out.append(torch.cat([torch.stack([state_at[path[p]] for p in range(first)]), rows]) if first else rows)
    return out


def decode_routing(meta: dict, prompt_len: int, n_tokens: int, layers: int, top_k: int, experts: int) -> Tensor:
    """One output's `meta_info["routed_experts"]` as the embedded engine's record (`Completion.routing`):
    [prompt_len + n_tokens, layers, top_k] int16, position t the experts of the forward that ran token
    t, the last position -1 (sampled, never run). SGLang sends positions 0..T-2 as base64 of an int32
    [T-1, num_hidden_layers, top_k] tensor's bytes (module docstring): the adapter and SGLang's tokenizer
    manager share a process, so its byte order is ours. A length or id that does not fit is an error:
    a record that does not line up with the sequence would replay experts onto the wrong tokens."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise RuntimeError("SGLang returned no routed experts (meta_info['routed_experts']): the engine must start "
                           "with enable_return_routed_experts")
    rows = prompt_len + n_tokens - 1
    ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if ids.size != rows * layers * top_k:
        raise RuntimeError(f"SGLang's routed experts hold {ids.size} ids; positions 0..{rows - 1} of {layers} layers "
                           f"x top-{top_k} are {rows * layers * top_k}")
    if ids.size and not (0 <= ids.min() and ids.max() < experts):
        raise RuntimeError(f"SGLang's routed experts name experts {ids.min()}..{ids.max()}; the model has {experts}")
    ran = torch.from_numpy(ids.astype(np.int16)).view(rows, layers, top_k)
    return torch.cat([ran, torch.full((1, layers, top_k), -1, dtype=torch.int16)])


def completion(out: dict, prompt_len: int, requested: int, limit: int, masked: bool, plain: int = 0) -> Completion:
    """One SGLang output as our Completion: tokens, the sampling distribution's log-probabilities (and
    with the sampling mask each token's sampling set), why it ended (`limit`: the max_new_tokens sent,
    `requested` clamped to the context) and its speculation counts: `plain` of its verify steps ran
    at depth 0 (`plain_steps`; SGLang counts them as verify steps, each emitting one token), the rest
    speculated."""
    meta = out["meta_info"]
    tokens = list(out["output_ids"])
    reason = meta["finish_reason"] or {"type": "length"}
    if reason["type"] not in FINISH_REASONS:
        raise RuntimeError(f"SGLang ended a request with {reason}")
    finish = FINISH_REASONS[reason["type"]]
    if finish == "length" and limit < requested and len(tokens) >= limit:
        finish = "context"
    sets = None
    if masked:
        logprobs = [float(x) for x in meta["output_token_sampling_logprobs"]]
        sets = [list(s) for s in meta["output_token_sampling_mask"]]
        if len(sets) != len(tokens) or any(t not in s for t, s in zip(tokens, sets)):
            raise RuntimeError("SGLang's sampling sets do not hold the tokens it sampled")
    else:
        triples = meta["output_token_logprobs"]
        if [t for _, t, _ in triples] != tokens:
            raise RuntimeError("SGLang's log-probabilities belong to other tokens than its output")
        logprobs = [float(lp) for lp, _, _ in triples]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"SGLang returned {len(logprobs)} log-probabilities for {len(tokens)} tokens")
    steps = max(0, int(meta.get("spec_verify_ct", 0)) - plain)
    return Completion(tokens, logprobs, finish, {"spec_steps": steps, "spec_emitted": len(tokens) - plain if steps else 0},
                      None, sets)


def eagle_reservation(args: dict[str, Any], tiers: dict[str, dict] | None) -> int:
    """Context slots SGLang reserves per request for EAGLE's draft tokens (managers/utils.py
    compute_num_reserved_tokens): top-k x steps or the draft-token count; adaptive: the most steps of
    any tier + 1."""
    if args.get("speculative_algorithm") != "EAGLE":
        return 0
    if args.get("speculative_adaptive"):
        steps = (max(s for t in tiers.values() for s in t["candidate_steps"]) if tiers
                 else SGLANG_DEFAULT_ADAPTIVE_STEPS)
        return steps + 1
    return max(args["speculative_eagle_topk"] * args["speculative_num_steps"], args["speculative_num_draft_tokens"])
