"""Rollout on SGLang's offline `Engine` (GPU nodes): the Engine protocol over sglang 0.5.23.

Written against the source of sglang 0.5.23 (the version `make install-gpu` pins) and never run on a
GPU: SGLang needs CUDA and this project's machines have none. Instead it is proven two ways here:
tests/test_sglang_conformance.py reads the pinned wheel's source (ast, no import) and checks every
SGLang import, attribute, call, keyword, field and output key this module uses, and the engine
contract suite runs this module's own code against an emulation of SGLang's engine
(tests/sglang_emulation) whose interface the same test checks against that source. What it relies
on, all in 0.5.23 (paths in the wheel, under sglang/srt/), beside what a request sends and its output
holds (`requests.py`: seeds, log-probabilities, stops, the context, hidden states, routed experts):
- Generation sends one `GenerateReqInput` through `tokenizer_manager.generate_request(obj, None)` on
  the engine's event loop, as `Engine.generate` does (entrypoints/engine.py), because
  `Engine.generate` has no `return_sampling_mask` parameter (the request object has the field).
- Weights: `begin_weight_update(selector)`, `update_weights_from_tensor` one bucket at a time (one
  serialised payload per tensor-parallel rank, made after `monkey_patch_torch_reductions()`:
  managers/tp_worker.py, utils/patch_torch.py), `end_weight_update`, then `flush_cache`. A new
  version pushed over an uncommitted one continues SGLang's open session (a second begin is refused).
  The push goes through the model's `load_weights` (model_runner_components/weight_updater.py), which
  maps a checkpoint's names: transformers 5's stacked experts would match none of Qwen3-MoE's
  mappings and be skipped without a word, so they go as one tensor per expert (`checkpoint_tensors`).
- Memory: `release_memory_occupation` frees the KV cache, the weights and the CUDA graphs; resume
  brings the weights' memory back first (their contents are garbage until the next push: generate
  refuses until it commits), the KV cache and CUDA graphs only after that push (peak memory beside
  the trainer); the draft comes back from SGLang's CPU backup (scheduler_components/weight_updater.py).
- EAGLE: the draft is exported with its own config (`models/draft.py sglang_eagle_config`: untied head, the target's
  dtype and rope), and the engine gets the dtype explicitly.
- Speculation: `static` is EAGLE with our depth / top-k / verify count; `fastgrpo` is SGLang's
  adaptive EAGLE (chains, top-k 1) with our policy's own choice at each captured CUDA-graph batch size,
  the size SGLang pads a decode batch to before it picks the slot (`adaptive_tiers`); `aware` is SGLang's adaptive EAGLE driven by aware
  (speculation/sglang_tiers.py `AwareTiers`): a slot per captured CUDA-graph batch size whose
  candidates cover every chain aware would pick there, the depths set at start and after every
  generate call from the acceptance learned from SGLang's per-request histograms of accepted drafts
  (`spec_correct_drafts_histogram`, less the steps of depth-0 slots, which SGLang counts there as
  verify steps: `plain_steps` replays them, and they are no speculative steps in `stats()` either),
  through fastgrpo's scheduler plugin (engines/sglang/plugin.py,
  an `sglang.srt.plugins` entry point) called with `Engine.collective_rpc`. Its costs are the
  roofline of the GPU and model (speculation/roofline.py) until SGLang's forwards are calibrated.
  `aware_per_sequence` runs as `aware` (SGLang has no per-sequence verify budget).
- The draft SGLang runs is our draft under its EAGLE Llama names (`sglang_eagle_tensors`) without the
  two norms that class has no place for: still lossless, acceptance unmeasured.
- Routing replay (`trainer.routing_replay=rollout`, a mixture of experts): the engine starts with
  `enable_return_routed_experts` and `generate(routing=True)` asks each request for
  `return_routed_experts`; SGLang's per-KV-slot record of every layer's top-k comes back as
  `meta_info["routed_experts"]` and becomes `Completion.routing` exactly as the embedded engine
  records it (`requests.decode_routing`: positions 0..T-2 of prompt + response, -1 at the last;
  Qwen3-MoE's layers are all sparse in SGLang, `check_model`, so its layer columns are the trainer's
  routers in order). The order of the k ids within a row is SGLang's top-k kernel's, which replay does not read
  (models/routing.py compares sets and takes each recorded expert's own gate weight). Refused with
  speculation (`requests.ROUTING_SPECULATION`: under EAGLE the record is not the accepted tokens').
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fastgrpo.protocols import BackendUnavailable
from fastgrpo.protocols import NamedTensors
from fastgrpo.config import Config
from fastgrpo.models.draft import export_sglang_eagle, sglang_eagle_tensors
from fastgrpo.models.families import checkpoint_tensors
from fastgrpo.paths import draft_dir, draft_weights, has_draft
from fastgrpo.speculation.policy import FastGRPOFormula, SpeculationPolicy
from fastgrpo.engines.sglang.requests import (ROUTING_SPECULATION, SGLANG_MASK_CAP, captured, check_sampling,
                                              completion, decode_routing, eagle_reservation, fill_prefixes,
                                              sampling_mask_cap, sampling_params)
from fastgrpo.speculation.sglang_tiers import AdaptiveSlots, AwareTiers, plain_steps, spec_capture_sizes
from fastgrpo.types import Completion, EngineStats, Request, SamplingParams

if TYPE_CHECKING:
    import sglang

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"


def gpus_available() -> bool:
    return torch.cuda.is_available()


def engine_dtype(cfg: Config) -> str:
    """The dtype SGLang runs target and draft in: the trainer's (`trainer.precision`; auto is bf16 on
    GPUs), so that pushed weights arrive as the trainer holds them. Passed explicitly: SGLang's "auto"
    would read each config (a float32 one becomes float16)."""
    return "float32" if cfg.trainer.precision == "fp32" else "bfloat16"


def adaptive_tiers(policy: SpeculationPolicy, max_batch: int) -> dict[str, dict]:
    """SGLang's adaptive speculation slots holding the one chain depth (0: no speculation) our policy
    picks at each CUDA-graph batch size SGLang captures (`spec_capture_sizes`, up to max_batch: the
    engine's cuda_graph_max_bs_decode), keyed by the first size of each run of equal depths. SGLang
    pads a decode batch of B rows to a captured size before it picks the slot
    (srt/speculative/adaptive_spec_params.py:342-358), so the B rows run at the size's depth, with the
    graph's cost: the policy is asked at that size, and the keys are sizes SGLang routes to. One
    candidate per slot: SGLang's acceptance EMA has nothing to switch between, our rule decides."""
    slots: dict[str, dict] = {}
    previous = None
    for size in spec_capture_sizes(max_batch):
        config = policy.choose(size)
        steps = 0 if config is None else config.depth
        if steps != previous:
            slots[str(size)] = {"candidate_steps": [steps], "up_hysteresis": 0.0, "down_hysteresis": 0.0}
            previous = steps
    return slots


def is_moe(model_config: PretrainedConfig) -> bool:
    """Whether the policy routes tokens to experts (only then is there routing to record)."""
    return bool(getattr(model_config, "num_experts", 0)) and bool(getattr(model_config, "num_experts_per_tok", 0))


def server_args(cfg: Config, mode: str, draft_export: Path | None, tiers_file: Path | None,
                base_gpu_id: int, dtype: str = "bfloat16", moe: bool = False) -> dict[str, Any]:
    """The keyword arguments of `sglang.Engine` for this rank's engine: `engine.tensor` GPUs of its
    node from `base_gpu_id` (the GPUs of the engine's own ranks, colocated with the trainer). A mixture
    of experts (`moe`) under routing replay records its routing (`enable_return_routed_experts`), without
    speculation only: under EAGLE the record is not the accepted tokens' (`ROUTING_SPECULATION`), and
    the capture costs a host row per KV slot, which no other run needs."""
    args: dict[str, Any] = dict(
        model_path=cfg.model.path, tp_size=cfg.engine.tensor, base_gpu_id=base_gpu_id, mem_fraction_static=cfg.engine.mem_fraction,
        context_length=cfg.model.max_context, max_running_requests=cfg.rollout.max_batch, random_seed=cfg.seed,
        dtype=dtype, skip_tokenizer_init=True, enable_memory_saver=True, enable_draft_weights_cpu_backup=True,
        enable_deterministic_inference=True,  # sampling_seed is ignored without it
        enable_return_hidden_states=True,  # generate(capture=True) at any time (EAGLE keeps the states anyway)
        log_level="warning")
    if cfg.draft.online != "off":
        args["chunked_prefill_size"] = -1  # a chunked prompt's middle chunks return no hidden states
    if cfg.rollout.top_k > 0:
        args["sampling_mask_max_tokens"] = sampling_mask_cap(cfg.rollout.top_k)
    if cfg.trainer.routing_replay == "rollout" and moe and mode == "off":
        args["enable_return_routed_experts"] = True  # generate(routing=True) at any time
    if mode == "off":
        return args
    sc = cfg.speculation
    args.update(speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft_export))
    if mode == "static":
        args.update(speculative_num_steps=sc.depth, speculative_eagle_topk=sc.topk,
                    speculative_num_draft_tokens=sc.num_verify)
    else:  # adaptive: chains (top-k 1), the depth chosen per batch-size slot
        # chains (top-k 1); graphs captured up to max_running_requests, the sizes aware's slots assume
        args.update(speculative_eagle_topk=1, speculative_adaptive=True, cuda_graph_max_bs_decode=cfg.rollout.max_batch)
        if tiers_file is not None:
            args["speculative_adaptive_config"] = str(tiers_file)
    return args


class SGLangEngine:
    """The Engine protocol over one `sglang.Engine`; see the module docstring for what it relies on.
    `args`: the engine's keyword arguments (`server_args`); `tiers`: its adaptive tiers, if any; `work`: the
    folder of the files it was started with (the exported draft, the tiers), removed by `close`."""

    def __init__(self, engine: sglang.Engine, cfg: Config, model_config: PretrainedConfig, mode: str,
                 args: dict[str, Any], tiers: dict[str, dict] | None = None, aware: AwareTiers | None = None,
                 stop_ids: Sequence[int] = (), work: Path | None = None):
        self._engine = engine
        self._work = work
        self.stop_ids = tuple(sorted(set(stop_ids)))  # sent with every request (`sampling_params`)
        self.aware = aware  # aware's chain per slot: set now and after every generate call
        self.cfg = model_config
        self.max_context = cfg.model.max_context
        self.max_running = cfg.rollout.max_batch
        self.tp = args.get("tp_size", 1)
        self.mode = mode
        self.mask_cap = args.get("sampling_mask_max_tokens", SGLANG_MASK_CAP)
        self.capture = bool(args.get("enable_return_hidden_states"))
        self.records_routing = bool(args.get("enable_return_routed_experts"))
        self.reserved = eagle_reservation(args, tiers)
        self.weights_version: int | None = -1  # None: a push is under way
        self._incoming = -1
        self._names: set[str] = set()
        self._released: list[str] = []  # memory tags released and not yet resumed
        self._stale = False  # target weights released: garbage until the next push commits
        self.draft_version = -1
        self.draft_source = None
        self._dropped_warned = False
        self._stats: EngineStats = {}
        # the depth a decode step of B rows runs at, where some slot may run plain (depth 0): SGLang
        # counts those steps as verify steps, which `plain_steps` replays from it
        self._depth = (aware.depth if aware is not None else
                       AdaptiveSlots(tiers, spec_capture_sizes(self.max_running)).steps if mode == "fastgrpo" and tiers
                       else None)
        if aware is not None:
            self.set_tiers(aware.table)

    # -- speculation ----------------------------------------------------------------------
    def set_tiers(self, table: dict[int, int]) -> None:
        """Each adaptive slot's chain depth (0: plain decoding), through fastgrpo's scheduler plugin."""
        from fastgrpo.engines.sglang.plugin import SET_STEPS

        try:
            self._engine.collective_rpc(SET_STEPS, tiers=json.dumps({str(k): v for k, v in table.items()}))
        except AssertionError as e:  # collective_rpc asserts the schedulers' success
            if SET_STEPS in str(e):  # the method is missing: SGLang started without the plugin
                raise RuntimeError(f"fastgrpo's SGLang plugin is not registered in SGLang's scheduler ({e}): SGLang "
                                   f"starts without a plugin that fails to load or raises in register() (its log "
                                   f"says why) and without one SGLANG_PLUGINS leaves out (srt/plugins/__init__.py)"
                                   ) from None
            raise RuntimeError(f"SGLang's schedulers refused fastgrpo's adaptive depths: {e}") from None

    def _learn(self, requests: list[Request], done: list[Completion], outs: list[dict], plain: list[int]) -> None:
        """aware learns the call's accepted drafts (`plain`: each request's steps at depth 0) and sets
        the slots for the next call."""
        for o, p in zip(outs, plain):
            self.aware.count(o["meta_info"].get("spec_correct_drafts_histogram") or [], p)
        self.aware.saw_call([len(r.prompt_ids) for r in requests], [len(c.token_ids) for c in done], self.max_running)
        before = dict(self.aware.table)
        if self.aware.refresh() != before:
            self.set_tiers(self.aware.table)

    # -- weights --------------------------------------------------------------------------
    def _run(self, coroutine):
        return self._engine.loop.run_until_complete(coroutine)

    @staticmethod
    def _check(what: str, result) -> None:
        success, message = result if isinstance(result, tuple) else (getattr(result, "success", True), "")
        if not success:
            raise RuntimeError(f"SGLang {what} failed: {message}")

    def _push(self, named_tensors: list[tuple[str, Tensor]], selector: str, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # CUDA IPC handles name devices by UUID, as SGLang's ranks read them
        payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.tp)]  # one per rank
        request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, flush_cache=False,
                                                  weight_version=str(version), selector=selector)
        self._check("update_weights_from_tensor", self._run(self._engine.tokenizer_manager.update_weights_from_tensor(
            request, None)))

    def _begin(self, selector: str) -> None:
        self._check("begin_weight_update", self._engine.begin_weight_update(selector=selector))

    def _end(self) -> None:
        self._check("end_weight_update", self._engine.end_weight_update())
        self._check("flush_cache", self._engine.flush_cache())

    def update_weights(self, named_tensors: NamedTensors, version: int, complete: bool = True) -> None:
        """A bucket of policy `version` (SGLang stacks q/k/v and gate/up and slices by its own TP);
        until the commit closes SGLang's update session, generate() refuses to run. A new version
        pushed over one never committed continues the session that one opened."""
        if self._incoming != version:
            if self.weights_version is None:
                log.warning("weight version %d pushed over version %d, which was never committed", version,
                            self._incoming)
            else:
                self.resume_memory()  # a push straight after a release: the weights' memory comes back first
                self._begin("target")
            self._incoming, self.weights_version, self._names = version, None, set()
        bucket = [(name, t.detach().contiguous()) for name, t in named_tensors]
        self._push(list(checkpoint_tensors(bucket)), "target", version)  # experts by the names load_weights maps
        self._names.update(name for name, _ in bucket)
        if complete:
            self.commit_weights(version)

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """SGLang holds the tensors fused and sharded, so the sender's per-tensor checksums cannot be
        compared with what it loaded; what is checked is that every tensor the sender summed arrived
        (and, after a release, that the push was whole: the rest would be garbage)."""
        if self._incoming != version:
            raise RuntimeError(f"commit of weight version {version}, but the push under way is of {self._incoming}")
        if checksums is not None and (missing := sorted(set(checksums) - self._names)):
            raise RuntimeError(f"weight version {version} did not include {missing[:3]}")
        self._end()
        self.weights_version = version
        self._stale = False
        if self._released:  # the KV cache and CUDA graphs come back once the weights are in
            self._engine.resume_memory_occupation(tags=self._released)
            self._released = []

    def update_draft(self, named_tensors: NamedTensors, version: int) -> None:
        """Our draft under SGLang's EAGLE names, into the draft runner only; between generate() calls."""
        tensors, dropped = sglang_eagle_tensors({k: v.detach() for k, v in named_tensors}, self.cfg)
        if dropped and not self._dropped_warned:
            log.warning("SGLang's EAGLE Llama draft has no place for the draft's %s: SGLang runs the draft without "
                        "them (lossless; acceptance may be lower than the embedded engine's)", ", ".join(dropped))
            self._dropped_warned = True
        self.resume_memory()  # released: the draft's memory comes back with the weights' (the target stays stale)
        self._begin("draft")
        self._push(list(tensors.items()), "draft", version)
        self._end()
        self.draft_version = version

    def set_speculation(self, policy: SpeculationPolicy) -> None:
        if policy.name != self.mode:
            raise ValueError(f"SGLang fixes speculation when the engine starts ({self.mode}); speculation.policy "
                             f"{policy.name} needs an engine started with it")

    def release_memory(self) -> None:
        """All of the engine's GPU memory goes to training: KV cache, weights, CUDA graphs."""
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        if self._released:
            return
        self._engine.release_memory_occupation(tags=list(GPU_MEMORY_ALL_TYPES))
        self._released = list(GPU_MEMORY_ALL_TYPES)
        self._stale = True

    def resume_memory(self) -> None:
        """The weights' memory comes back for the push that follows (their contents are garbage until
        it commits); the KV cache and CUDA graphs come back after it (`commit_weights`)."""
        from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

        if GPU_MEMORY_TYPE_WEIGHTS in self._released:
            self._engine.resume_memory_occupation(tags=[GPU_MEMORY_TYPE_WEIGHTS])
            self._released.remove(GPU_MEMORY_TYPE_WEIGHTS)

    def stats(self) -> EngineStats:
        return dict(self._stats, weights_version=self.weights_version, draft_version=self.draft_version)

    # -- generation -----------------------------------------------------------------------
    def limit(self, request: Request, sampling: SamplingParams, index: int) -> int:
        """The max_new_tokens SGLang can take for `request`: what it asks, within the context left
        after its prompt and EAGLE's reserved slots."""
        room = self.max_context - len(request.prompt_ids) - self.reserved
        if room < 1:
            raise ValueError(f"request {index}: prompt of {len(request.prompt_ids)} tokens leaves no room in the "
                             f"context of {self.max_context} beside SGLang's {self.reserved} slots for EAGLE's drafts")
        return min(request.max_new_tokens or sampling.max_new_tokens, room)

    def generate(self, requests: list[Request], sampling: SamplingParams, seed: int = 0,
                 capture: bool = False, routing: bool = False) -> list[Completion]:
        """The Engine protocol's generate as one SGLang request object (module docstring). `capture`: the
        target's hidden states (an engine started with enable_return_hidden_states); `routing`: a mixture
        of experts' completions carry SGLang's routed experts in the embedded engine's format (an engine
        started with enable_return_routed_experts, which `server_args` sets only without speculation, as
        SGLang's record under EAGLE is not the accepted tokens'); a dense model's carry none."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        routing = routing and is_moe(self.cfg)  # a dense model has no routing (None, as the embedded engine)
        if routing and self.mode != "off":
            raise ValueError(f"routing replay (trainer.routing_replay=rollout) on SGLang needs speculation.policy=off "
                             f"(this engine speculates: {self.mode}): {ROUTING_SPECULATION}")
        if routing and not self.records_routing:
            raise ValueError("routing needs an SGLang engine started with enable_return_routed_experts "
                             "(trainer.routing_replay=rollout)")
        if self._stale:
            raise RuntimeError("the engine's weights were released for training: no generation until the next "
                               "weight push commits")
        if self.weights_version is None:
            raise RuntimeError(f"the push of weight version {self._incoming} is incomplete: no generation until it "
                               f"is committed")
        for i, r in enumerate(requests):
            r.check(i, self.max_context, self.cfg.vocab_size)
        if not requests:  # SGLang refuses an empty batch ("input_ids cannot be empty")
            return []
        limits = [self.limit(r, sampling, i) for i, r in enumerate(requests)]
        masked = check_sampling(sampling, self.mode != "off", self.mask_cap)
        if capture and not self.capture:
            raise ValueError("capture needs an SGLang engine started with enable_return_hidden_states (draft.online "
                             "sync or async)")
        if self.draft_source is not None and (update := self.draft_source()) is not None:
            self.update_draft(*update)
        if capture:  # every prefix this call reads from the cache is then computed by one of its requests
            self._check("flush_cache", self._engine.flush_cache())
        t0 = time.perf_counter()
        obj = GenerateReqInput(
            input_ids=[list(r.prompt_ids) for r in requests],
            sampling_params=[sampling_params(sampling, r, seed, i, limits[i], self.stop_ids)
                             for i, r in enumerate(requests)],
            return_logprob=True, return_sampling_mask=masked, return_hidden_states=capture,
            return_routed_experts=routing)
        outs = self._run(self._engine.tokenizer_manager.generate_request(obj, None).__anext__())
        seconds = time.perf_counter() - t0
        # each request's steps at depth-0 slots (the depths set for this call, before aware moves them)
        plain = (plain_steps([len(o["output_ids"]) for o in outs], self.max_running, self._depth)
                 if self._depth is not None else [0] * len(outs))
        done = [completion(o, len(r.prompt_ids), r.max_new_tokens or sampling.max_new_tokens, limit, masked, p)
                for o, r, limit, p in zip(outs, requests, limits, plain)]
        if capture:
            parts = [captured(o["meta_info"], len(r.prompt_ids), len(c.token_ids)) for o, r, c in zip(outs, requests, done)]
            states = fill_prefixes([r.prompt_ids + c.token_ids for r, c in zip(requests, done)], parts)
            for c, h in zip(done, states):
                c.hidden = h
        if routing:
            for o, r, c in zip(outs, requests, done):
                c.routing = self._routing(o["meta_info"], len(r.prompt_ids), len(c.token_ids))
        if self.aware is not None:
            self._learn(requests, done, outs, plain)
        tokens = sum(len(c.token_ids) for c in done)
        verify = sum(int(o["meta_info"].get("spec_verify_ct", 0)) for o in outs)  # plain steps included
        spec = sum(c.spec["spec_steps"] for c in done)
        emitted = sum(c.spec["spec_emitted"] for c in done)
        self._stats = dict(sequences=len(done), tokens=tokens, seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9),
                           spec_steps=spec, spec_seq_steps=spec, spec_emitted=emitted, decode_steps=verify or tokens,
                           mean_running=0.0, accept_len=emitted / spec if spec else 1.0,
                           config_by_concurrency={}, trace=[])
        return done

    def _routing(self, meta: dict, prompt_len: int, n_tokens: int) -> Tensor:
        """One output's routed experts as `Completion.routing` (`requests.decode_routing`): SGLang's record
        has a column per layer (num_hidden_layers), each a sparse layer here (`check_model`)."""
        return decode_routing(meta, prompt_len, n_tokens, self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok,
                       self.cfg.num_experts)

    def close(self) -> None:
        shut_down(self._engine, self._work)


def shut_down(engine: sglang.Engine | None, work: Path | None) -> None:
    """Shut `engine` down and remove `work`, the folder of the files it started from: at `close`, and when
    a start fails (nothing left behind: the engine's processes, its files)."""
    try:
        if engine is not None:
            engine.shutdown()
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def check_plugin() -> None:
    """SGLang will load fastgrpo's scheduler plugin: its entry point is installed and SGLANG_PLUGINS, if
    set, allows it. SGLang 0.5.23 reads any value of SGLANG_PLUGINS but the empty string as an
    allow-list of names, split at commas and stripped (srt/plugins/__init__.py:51-55, 67-70; the
    variable is read as it is, srt/environ.py:128-130): commas or blanks alone allow no plugin."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("fastgrpo.")}
    if not names:
        raise RuntimeError("speculation.policy=aware on SGLang needs fastgrpo's SGLang plugin, an entry point of the "
                           "installed fastgrpo: reinstall it (`pip install -e .`)")
    raw = os.environ.get("SGLANG_PLUGINS", "")
    if raw == "":  # unset or empty: SGLang loads every plugin
        return
    allowed = {x.strip() for x in raw.split(",")} - {""}
    if not allowed:
        raise RuntimeError(f"SGLANG_PLUGINS={raw!r} names no plugin, and SGLang reads it as an allow-list all the same: "
                           f"it would load none, and speculation.policy=aware needs fastgrpo's "
                           f"({', '.join(sorted(names))}); unset it or name that plugin")
    if not names & allowed:
        raise RuntimeError(f"SGLANG_PLUGINS={raw} leaves out fastgrpo's plugin "
                           f"({', '.join(sorted(names))}), which speculation.policy=aware needs")


def aware_tiers(cfg: Config, model_config: PretrainedConfig) -> AwareTiers:
    """aware for this engine's SGLang slots, priced by the roofline of this GPU and the policy's shape
    at `engine.tensor` GPUs (no calibration of SGLang's own forwards exists yet)."""
    from fastgrpo.speculation.roofline import Roofline, accelerator_named, model_shape

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""  # the emulation in tests: H100
    prices = Roofline(accelerator_named(gpu), model_shape(model_config, cfg.engine.tensor))
    return AwareTiers(prices, spec_capture_sizes(cfg.rollout.max_batch), cfg.model.max_context)


def check_model(model_config: PretrainedConfig) -> None:
    """What SGLang 0.5.23 computes as the checkpoint does: its Qwen3-MoE builds every layer as a sparse
    block (models/qwen3_moe.py) whatever `mlp_only_layers` and `decoder_sparse_step` say, so a checkpoint
    with dense layers among its sparse ones would lose those layers' weights without a word."""
    dense = list(getattr(model_config, "mlp_only_layers", None) or [])
    step = getattr(model_config, "decoder_sparse_step", 1)
    if getattr(model_config, "num_experts", 0) and (dense or step != 1):
        raise ValueError(f"engine.backend=sglang: SGLang {SGLANG_VERSION} runs every layer of a "
                         f"{model_config.model_type} checkpoint as a mixture of experts, but this one has dense layers "
                         f"(mlp_only_layers={dense}, decoder_sparse_step={step}); use engine.backend=embedded")


def start_files(cfg: Config, model_config: PretrainedConfig, mode: str, dtype: str, work: Path
                ) -> tuple[Path | None, Path | None, dict[str, dict] | None, AwareTiers | None]:
    """What SGLang starts from with speculation `mode`, written into `work`: our draft exported to SGLang's
    EAGLE format, and the adaptive tiers file (fastgrpo's rule, or `aware`'s, whose tiers object is returned
    too). Returns (draft export, tiers file, tiers, aware), None where the mode has none."""
    if mode == "off":
        return None, None, None, None
    if not has_draft(draft_dir(cfg)):
        raise FileNotFoundError(f"speculation.policy={mode} needs a draft at {draft_weights(draft_dir(cfg))}")
    draft_export = work / "eagle-draft"
    export_sglang_eagle(draft_weights(draft_dir(cfg)), model_config, draft_export, dtype)
    tiers = aware = tiers_file = None
    if mode == "fastgrpo":
        tiers = adaptive_tiers(FastGRPOFormula(), cfg.rollout.max_batch)
    elif mode in ("aware", "aware_per_sequence"):
        if mode == "aware_per_sequence":
            log.warning("speculation.policy=aware_per_sequence on SGLang runs as aware: SGLang has no "
                        "per-sequence verify budget")
        check_plugin()
        aware = aware_tiers(cfg, model_config)
        tiers = aware.sglang_config()
    if tiers is not None:
        tiers_file = work / "adaptive.json"
        tiers_file.write_text(json.dumps(tiers, indent=1))
    return draft_export, tiers_file, tiers, aware


def build_engine(cfg: Config, model_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 weights: NamedTensors | None = None, speculation: str | None = None,
                 stop_ids: Sequence[int] = ()) -> SGLangEngine:
    """An SGLang engine on `engine.tensor` GPUs from this rank's (LOCAL_RANK: the engine's leading rank), started
    with the policy at `model.path`, then given `weights` if any; with speculation, from the files of
    `start_files` in a folder of its own until `close`. It stops a sequence at any of `stop_ids` (sent with each
    request: SGLang's own stops miss the tokenizer's eos, `sampling_params`)."""
    check_model(model_config)
    if not gpus_available():
        raise BackendUnavailable("engine.backend=sglang needs CUDA GPUs; this machine has none (use engine.backend="
                                 "embedded)")
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        log.warning("the SGLang adapter was written against sglang %s; this is %s", SGLANG_VERSION,
                    sglang.__version__)
    gpus = cfg.engine.tensor  # the loop's layout check: they divide the node's GPUs, so they are this node's
    mode = speculation or cfg.speculation.policy
    check_sampling(SamplingParams.of(cfg.rollout), mode != "off",
                   sampling_mask_cap(cfg.rollout.top_k) if cfg.rollout.top_k > 0 else SGLANG_MASK_CAP)
    dtype = engine_dtype(cfg)
    work = Path(tempfile.mkdtemp(prefix="fastgrpo-sglang-"))  # the exported draft and tiers: until `close`
    engine = None
    try:
        draft_export, tiers_file, tiers, aware = start_files(cfg, model_config, mode, dtype, work)
        base_gpu_id = int(os.environ.get("LOCAL_RANK", 0))
        args = server_args(cfg, mode, draft_export, tiers_file, base_gpu_id, dtype, moe=is_moe(model_config))
        engine = sglang.Engine(**args)
        adapter = SGLangEngine(engine, cfg, model_config, mode, args, tiers, aware, stop_ids, work)
        if weights is not None:
            adapter.update_weights(weights, version=0)
    except BaseException:
        shut_down(engine, work)
        raise
    log.info("SGLang engine on GPUs %d-%d (speculation %s, %s)", base_gpu_id, base_gpu_id + gpus - 1, mode,
             "tiers " + str(tiers_file) if tiers_file else "static" if mode == "static" else "no tiers file")
    return adapter
