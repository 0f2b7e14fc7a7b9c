"""The machinery behind the emulated `sglang` package (tests/sglang_emulation/sglang): what SGLang
0.5.23's scheduler does with the requests fastgrpo's adapter sends it, on a Hugging Face Llama on
CPU. Each rule below is SGLang's, read in its source (paths relative to the wheel's sglang/srt/);
where SGLang would crash, hang or silently compute garbage, the emulation raises EmulationError.

What it runs:
- generate: SGLang's continuous batching: waiting requests are prefilled in order while fewer than
  max_running_requests run (each prefill enters the radix cache before the next, so every request of
  a group after the first hits the cache: the case SGLang's in-batch prefix caching aims for), then
  one decode step of every running request, whose batch size (the running count) routes the step's
  adaptive depth after CUDA-graph padding; finished requests leave, waiting ones join. The policy's
  forwards with a KV cache per request, SGLang's pytorch sampling
  backend (top-k by rank, then top-p against the cumulative mass before top-k: layers/sampler.py
  top_k_top_p_min_p_sampling_from_probs_torch), seeds honoured only with
  enable_deterministic_inference (sampling/sampling_batch_info.py; otherwise a generator that runs
  on), the sampling mask and its cap (managers/scheduler.py, layers/sampler.py
  _build_sampling_mask_output), output_token_logprobs as log_softmax(logits / T) (greedy: T = 1)
  triples, finish reasons as schedule_batch.py's to_json, stops on stop_token_ids and on config.json's and
  generation_config.json's eos ids, never on the tokenizer's (skip_tokenizer_init), none with
  ignore_eos (schedule_batch.py _check_token_based_finish), context validation with the EAGLE
  reservation (managers/tokenizer_manager.py _validate_one_request, managers/utils.py).
- hidden states: prefill rows for the prompt's uncached part only, and with chunked prefill only
  for its last chunk (scheduler_components/batch_result_processor.py), then one row per emitted
  token; the list sliced to the output length (output_streamer.py).
- EAGLE: the exported draft directory read as SGLang reads it (config.json: LlamaForCausalLMEagle,
  tie_word_embeddings, dtype / torch_dtype through configs/model_config.py _get_and_verify_dtype;
  weights by llama_eagle.py's names), chain drafts verified against the target's own samples, so
  the output equals plain decoding with the same seeds; adaptive tiers from the tiers file
  (speculative/adaptive_spec_params.py), each decode step routed by its batch size padded to a
  captured CUDA-graph size (the sizes arg_groups/cuda_graph_hook.py generates); a step at depth 0 counted
  as a verify step with no correct draft (speculative/eagle_worker_v2.py's trivial verify). The
  draft's proposals come from a stand-in forward (its fc and MLP, no attention): acceptance is not
  SGLang's.
- weights: update sessions with selectors, refused outside a session, one payload per TP rank each
  deserialised once (managers/tp_worker.py deserialize_own_rank), the producer's
  monkey_patch_torch_reductions, HF names loaded by name and shape (a wrong name or shape fails as
  SGLang's loader does), the cache stale after an update until flushed.
- memory: release / resume with tags (scheduler_components/weight_updater.py): target weights are
  garbage after resume until every tensor is pushed again (unless enable_weights_cpu_backup), the
  draft comes back from its CPU backup, resuming a tag that was not released fails.
"""

from __future__ import annotations

import base64
import bisect
import itertools
import json
import pickle
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # constants.py GPU_MEMORY_ALL_TYPES
TOP_K_ALL = 1 << 30  # sampling/sampling_params.py
DEFAULT_ADAPTIVE_CONFIG = {"1": [1, 3, 5, 7], "8": [0, 1, 3], "32": [0, 1], "64": [0]}  # adaptive_spec_params.py
DEFAULT_CHUNKED_PREFILL = 8192  # what SGLang picks on a large GPU when chunked_prefill_size is None


class EmulationError(AssertionError):
    """SGLang would crash, hang or compute garbage here."""


# -- the producer side of tensor IPC ----------------------------------------------------------------------

class _IPC:
    """CUDA IPC as SGLang relies on it: every serialize() is one producer-side handle, consumed by
    exactly one rank; the producer's reductions carry device UUIDs once monkey_patch_torch_reductions
    has run (utils/patch_torch.py)."""

    patched = False
    _ids = itertools.count()
    consumed: set[int] = set()

    @classmethod
    def serialize(cls, obj, output_str: bool) -> bytes | str:
        data = pickle.dumps(("sglang-emulated-ipc", next(cls._ids), cls.patched, obj))
        return base64.b64encode(data).decode() if output_str else data

    @classmethod
    def deserialize(cls, data) -> Any:
        if isinstance(data, str):
            data = base64.b64decode(data)
        tag, handle, patched, obj = pickle.loads(data)
        if tag != "sglang-emulated-ipc":
            raise EmulationError("not a MultiprocessingSerializer payload")
        if not patched:
            raise EmulationError("the producer serialised tensors without monkey_patch_torch_reductions(): their "
                                 "CUDA IPC handles carry device indices, which the scheduler's process reads as its "
                                 "own devices")
        if handle in cls.consumed:
            raise EmulationError("one serialised payload was deserialised twice (by two tensor-parallel ranks): "
                                 "SGLang needs one serialised copy per rank (producer-side CUDA IPC reference counts)")
        cls.consumed.add(handle)
        return obj


def reset_ipc() -> None:
    _IPC.patched = False


# -- dtypes as SGLang resolves them ----------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


def resolve_dtype(config: dict, dtype: str) -> torch.dtype:
    """configs/model_config.py _get_and_verify_dtype for a config dict."""
    config_dtype = _DTYPES.get(config.get("dtype") or config.get("torch_dtype"), torch.float32)
    if dtype == "auto":
        return torch.float16 if config_dtype == torch.float32 else config_dtype
    return _DTYPES[dtype]


# -- what the scheduler derives from its start ---------------------------------------------------------

H100_DECODE_MAX_BS = 256  # arg_groups/memory_hook.py:133-143: an 80 GB GPU at tp_size < 4 (the emulated GPU)


def decode_capture_sizes(args) -> list[int]:
    """The decode batch sizes SGLang captures CUDA graphs for (cuda_graph_config.decode.bs), with
    padding allowed: up to cuda_graph_max_bs_decode if given (arg_groups/cuda_graph_hook.py:72-73),
    else the GPU's default capped at max_running_requests (arg_groups/memory_hook.py:133-143, 182-188),
    listed by generate_decode_cuda_graph_batch_sizes (cuda_graph_hook.py:500-532; memory_hook.py:201-205)."""
    max_bs = args.cuda_graph_max_bs_decode
    if max_bs is None:
        max_bs = H100_DECODE_MAX_BS if args.tp_size < 4 else 2 * H100_DECODE_MAX_BS
        if args.max_running_requests is not None:
            max_bs = min(max_bs, args.max_running_requests)
    if args.speculative_algorithm is None:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    else:  # "Spec decoding case: less padding for smaller batch sizes"
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def hf_eos_token_ids(path: Path, config: dict) -> set[int]:
    """ModelConfig._get_hf_eos_token_id (configs/model_config.py:2190-2208): config.json's eos_token_id
    and generation_config.json's (read with GenerationConfig.from_pretrained, absent is fine:
    model_config.py:683-688, utils/hf_transformers/common.py:698-731), each an int or a list."""
    def ids(value) -> set[int]:
        return set() if value is None else {value} if isinstance(value, int) else set(value)

    eos = ids(config.get("eos_token_id"))
    generation = path / "generation_config.json"
    if generation.is_file():
        eos |= ids(json.loads(generation.read_text()).get("eos_token_id") or None)
    return eos


# -- the scheduler ---------------------------------------------------------------------------------------

@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: Any  # SamplingParams
    hidden: bool
    mask: bool
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask_ids: list[list[int]] = field(default_factory=list)
    mask_logprobs: list[float] = field(default_factory=list)
    hidden_states: list = field(default_factory=list)
    finish: dict | None = None
    verify_ct: int = 0
    cached: int = 0
    histogram: list[int] = field(default_factory=list)  # verify steps by accepted drafts


@dataclass
class _Running:  # a request in the running batch, between decode steps
    request: _Request
    cache: Any  # its KV cache
    last_state: torch.Tensor  # the target's state at its last fed position (the draft's input)
    done: bool


@dataclass
class _Slot:  # AdaptiveStepSlot's attributes that fastgrpo's plugin touches
    candidate_steps: list[int]
    current_steps: int
    warmup_batches: float = 10


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Scheduler:
    def __init__(self, args):
        from transformers import AutoModelForCausalLM

        from sglang.srt.plugins import load_plugins

        load_plugins()  # run_scheduler_process: plugins may add Scheduler methods (collective_rpc's targets)
        self.draft_worker = None

        self.args = args
        path = Path(args.model_path)
        self.config = json.loads((path / "config.json").read_text())
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.vocab = self.config["vocab_size"]
        self.context_len = args.context_length or self.config.get("max_position_embeddings", 2048)
        self.eos = hf_eos_token_ids(path, self.config)
        self.target_dtype = resolve_dtype(self.config, args.dtype)
        self.tp = args.tp_size
        self.names = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self.garbage: set[str] = set()  # target tensors whose memory was released and not reloaded
        self.draft_garbage: set[str] = set()
        self.generation = 0  # target weight loads so far (the radix cache's entries remember theirs)
        self.cache: list[tuple[tuple[int, ...], int]] = []  # sequences whose KV the radix cache holds
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

    # -- EAGLE --------------------------------------------------------------------------------
    def _start_eagle(self, args) -> None:
        if self.algorithm != "EAGLE":
            raise EmulationError(f"the emulation runs EAGLE only, not {self.algorithm}")
        directory = Path(args.speculative_draft_model_path)
        cfg = json.loads((directory / "config.json").read_text())
        if cfg.get("architectures") != ["LlamaForCausalLMEagle"]:
            raise EmulationError(f"draft architectures {cfg.get('architectures')}: not LlamaForCausalLMEagle")
        if cfg.get("tie_word_embeddings", False):
            # models/llama_eagle.py: lm_head is embed_tokens; models/llama.py set_embed_and_head deletes
            # embed_tokens.weight, then lm_head.weight: the same parameter twice
            raise EmulationError("AttributeError: 'VocabParallelEmbedding' has no attribute 'weight' (the EAGLE "
                                 "draft config has tie_word_embeddings=true: set_embed_and_head deletes the shared "
                                 "weight twice)")
        self.draft_config = cfg
        self.draft_dtype = resolve_dtype(cfg, args.dtype)
        h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or h // heads
        ffn = cfg["intermediate_size"]
        self.draft_names = {
            "fc.weight": (h, 2 * h), "fc.bias": (h,),
            "layers.0.self_attn.q_proj.weight": (heads * d, h), "layers.0.self_attn.k_proj.weight": (kv * d, h),
            "layers.0.self_attn.v_proj.weight": (kv * d, h), "layers.0.self_attn.o_proj.weight": (h, heads * d),
            "layers.0.mlp.gate_proj.weight": (ffn, h), "layers.0.mlp.up_proj.weight": (ffn, h),
            "layers.0.mlp.down_proj.weight": (h, ffn), "layers.0.post_attention_layernorm.weight": (h,)}
        self.draft = {}
        self._load_draft(list(load_file(str(directory / "model.safetensors")).items()))
        if args.speculative_adaptive:
            if args.speculative_eagle_topk not in (None, 1):
                raise EmulationError("adaptive speculation runs chains only (speculative_eagle_topk 1)")
            if args.speculative_adaptive_config is not None:
                raw = json.loads(Path(args.speculative_adaptive_config).read_text())
                tiers = {}
                for key, entry in raw.items():
                    if not key.isdigit():
                        continue
                    steps = entry.get("candidate_steps")
                    if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
                        raise ValueError(f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}")
                    tiers[int(key)] = sorted(set(steps))
                if not tiers:
                    raise ValueError("speculative_adaptive_config must contain at least one integer-string BS key")
            else:
                tiers = {int(k): v for k, v in DEFAULT_ADAPTIVE_CONFIG.items()}
            self.tiers = dict(sorted(tiers.items()))
            every = sorted({s for steps in tiers.values() for s in steps})
            self.reserved = max(every) + 1  # topk 1 x num_steps <= max + 1 draft tokens
            # the adaptive controller on the EAGLE worker (eagle_worker_v2.py), one slot per key
            # (adaptive_spec_params.py): each starts at the server's num_steps (the middle of all
            # candidates) if it is one of its own, else at its own middle; the EMA is not emulated
            initial = every[len(every) // 2]
            slots = {k: _Slot(v, initial if initial in v else v[len(v) // 2]) for k, v in self.tiers.items()}
            self.draft_worker = _Namespace(adaptive_controller=_Namespace(params=_Namespace(_slots=slots)))
        else:
            steps, topk, tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
            if steps is None:
                steps, topk, tokens = 5, 4, 8  # speculative_hook.py _auto_choose_speculative_params, Llama
            self.tiers = None
            self.static_steps = steps
            self.reserved = max(topk * steps, tokens)

    def _steps(self, batch: int) -> int:
        """The depth of a decode step of `batch` running requests: EAGLEWorkerV2 activates the state of
        the slot for `batch.seq_lens.shape[0]` before the step (speculative/eagle_worker_v2.py:1444-1445,
        1771-1773; adaptive_runtime_state.py:122-125), AdaptiveSpeculativeParams._route pads it to a
        captured CUDA-graph size, then takes the largest slot key not above that
        (adaptive_spec_params.py:342-358; the sizes set at start, eagle_worker_v2.py:1408-1413)."""
        if self.tiers is None:
            return self.static_steps
        sizes = self.capture_sizes
        i = bisect.bisect_left(sizes, batch)
        padded = sizes[i] if i < len(sizes) else batch
        keys = sorted(self.tiers)
        key = keys[max(0, bisect.bisect_right(keys, padded) - 1)]
        return self.draft_worker.adaptive_controller.params._slots[key].current_steps

    def _load_draft(self, named) -> None:
        for name, t in named:
            if name not in self.draft_names:
                raise EmulationError(f"KeyError: {name!r} (the EAGLE draft has no such parameter)")
            if tuple(t.shape) != self.draft_names[name]:
                raise EmulationError(f"draft {name}: shape {tuple(t.shape)}, the model's is {self.draft_names[name]}")
            self.draft[name] = t.detach().float().clone()
            self.draft_garbage.discard(name)

    def _propose(self, token: int, hidden: torch.Tensor, steps: int) -> list[int]:
        """A stand-in for EAGLE's draft forward (fc over [embedding; state], its MLP, the target's head)."""
        w = self.draft
        embed = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings().weight
        out = []
        with torch.no_grad():
            for _ in range(steps):
                x = w["fc.weight"] @ torch.cat([embed[token], hidden]) + w["fc.bias"]
                n = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * w["layers.0.post_attention_layernorm.weight"]
                x = x + w["layers.0.mlp.down_proj.weight"] @ (
                    torch.nn.functional.silu(w["layers.0.mlp.gate_proj.weight"] @ n) * (w["layers.0.mlp.up_proj.weight"] @ n))
                token = int((head @ x).argmax())
                hidden = x
                out.append(token)
        return out

    # -- weights ------------------------------------------------------------------------------
    def begin(self, selector: str) -> tuple[bool, str]:
        self.calls.append(f"begin_weight_update({selector})")
        if selector not in ("target", "draft", "all"):
            raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session, self.session_loaded = selector, False
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        self.calls.append("end_weight_update")
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def update_from_tensor(self, req) -> tuple[bool, str]:
        self.calls.append(f"update_weights_from_tensor({req.selector})")
        if self.session is None:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if "weights" in self.offloaded:
            raise EmulationError("weights loaded into released memory (resume_memory_occupation(['weights']) first)")
        payloads = req.serialized_named_tensors
        per_rank = []
        for rank in range(self.tp):
            if rank >= len(payloads):
                raise EmulationError(f"IndexError: tensor-parallel rank {rank} has no payload ({len(payloads)} sent)")
            per_rank.append(_IPC.deserialize(payloads[rank]))
        named = per_rank[0]
        roles = {"all": ("target", "draft"), "target": ("target",), "draft": ("draft",)}[req.selector]
        if "target" in roles:
            for name, t in named:
                if name not in self.names:
                    raise EmulationError(f"KeyError: {name!r} (the target model has no such parameter)")
                if tuple(t.shape) != self.names[name]:
                    raise EmulationError(f"{name}: shape {tuple(t.shape)}, the model's is {self.names[name]}")
            with torch.no_grad():
                state = self.model.state_dict()
                for name, t in named:
                    state[name].copy_(t)
                    self.garbage.discard(name)
            self.generation += 1
        if "draft" in roles and self.draft is not None:
            self._load_draft(named)
        if req.weight_version is not None:
            self.weight_version = req.weight_version
        if req.flush_cache:
            self.flush()
        return True, "Success"

    def flush(self) -> bool:
        self.calls.append("flush_cache")
        self.cache.clear()
        return True

    # -- memory saver ---------------------------------------------------------------------------
    def release(self, tags: list[str] | None) -> None:
        tags = list(tags) if tags else list(ALL_TAGS)
        self.calls.append(f"release_memory_occupation({','.join(tags)})")
        self.offloaded |= set(tags)
        if "kv_cache" in tags:
            self.flush()

    def resume(self, tags: list[str] | None) -> None:
        tags = list(tags) if tags else list(ALL_TAGS)
        self.calls.append(f"resume_memory_occupation({','.join(tags)})")
        for tag in tags:
            if tag not in self.offloaded:
                raise EmulationError(f"KeyError: {tag!r} (resume_memory_occupation of memory that was not released)")
            self.offloaded.remove(tag)
        if "weights" in tags and self.args.enable_memory_saver:
            if not self.args.enable_weights_cpu_backup:
                self.garbage = set(self.names)
            if self.draft is not None and not (self.args.enable_draft_weights_cpu_backup or self.args.enable_weights_cpu_backup):
                self.draft_garbage = set(self.draft_names)

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

    def _match(self, prompt: list[int]) -> int:
        best, generation = 0, self.generation
        for seq, gen in self.cache:
            n = 0
            for a, b in zip(seq, prompt):
                if a != b:
                    break
                n += 1
            if n > best:
                best, generation = n, gen
        best = min(best, len(prompt) - 1)
        if best and generation != self.generation:
            raise EmulationError("a prefix computed by older weights was served from the radix cache: the cache "
                                 "was not flushed after a weight update")
        return best

    def _insert(self, seq: list[int]) -> None:
        self.cache.append((tuple(seq), self.generation))

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
        r.cached = self._match(prompt)
        out = self._forward([prompt])
        cache, states = out.past_key_values, out.hidden_states[-1][0]
        extend = P - r.cached
        stored = extend if self.chunk <= 0 or extend <= self.chunk else (extend - 1) % self.chunk + 1
        if r.hidden:
            r.hidden_states.append(states[P - stored:].tolist())  # one element: the (last) prefill chunk's rows
        self._insert(prompt)
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
            out = self._forward([[pending]], cache)
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
        if r.hidden:
            r.hidden_states.extend(fed_states[:accepted].tolist())
        state.last_state = fed_states[accepted - 1]
        # keep the fed tokens that were accepted (the last emitted one is pending, not fed)
        if (surplus := state.cache.get_seq_length() - (n + accepted)) > 0:
            state.cache.crop(-surplus)

    def _retire(self, state: _Running) -> None:
        r = state.request
        self._insert(r.prompt + r.out[:-1])
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
        return {"output_ids": list(r.out), "meta_info": meta}
