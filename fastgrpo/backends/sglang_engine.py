"""Rollout on SGLang's offline `Engine` (GPU nodes): the Engine protocol over sglang 0.5.23.

Written against the source of sglang 0.5.23 (the version pyproject's `sglang` extra pins) and never
run: SGLang needs CUDA and this project's machines have none. What it relies on, all in 0.5.23:
- `Engine.generate(input_ids=..., return_logprob=True)`: `meta_info["output_token_logprobs"]` are
  `log_softmax(logits / T)` (layers/sampler.py), the sampling distribution only when neither top-k nor
  top-p cuts it. With a finite top-k and no speculation, `return_sampling_mask=True` returns each
  token's log-probability renormalised over the kept set (`output_token_sampling_logprobs`), exactly
  what our trainer scores; SGLang refuses that option with EAGLE, and for top-p without a finite top-k.
  Other settings are refused here, before any work (`check_sampling`).
- Weights: `begin_weight_update(selector)`, `update_weights_from_tensor` one bucket at a time (the
  request's `selector` picks the target or the draft runner), `end_weight_update`, then `flush_cache`.
  The draft swap is `selector="draft"`: no patch to SGLang is needed for it at 0.5.23.
- `release_memory_occupation()` / `resume_memory_occupation()` around training (memory saver on; the
  draft's weights come back from SGLang's CPU backup, the policy's with the next push).
- `return_hidden_states=True` (server flag `enable_return_hidden_states`): the post-norm states of the
  prompt, then of every accepted token (`meta_info["hidden_states"]`), which is our `Completion.hidden`.
- Speculation is fixed when the engine starts: `static` is EAGLE with our depth / top-k / verify count;
  `fastgrpo` is SGLang's adaptive EAGLE (chains, top-k 1) with one tier per concurrency range taken
  from our policy's own choice (`adaptive_tiers`); `aware` is SGLang's adaptive EAGLE with its default
  tiers, since our cost model has no calibration of SGLang's GPU forwards (not built).
- The draft SGLang runs is our draft under its EAGLE Llama names (`sglang_eagle_tensors`) without the
  two norms that class has no place for: still lossless, acceptance unmeasured.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fastgrpo.backends import BackendUnavailable
from fastgrpo.backends.protocols import DraftUpdate, NamedTensors
from fastgrpo.config import Config
from fastgrpo.speculation.draft import DRAFT_WEIGHTS, export_sglang_eagle, sglang_eagle_tensors
from fastgrpo.speculation.policy import FastGRPOFormula, SpeculationPolicy
from fastgrpo.types import Completion, Request, SamplingParams

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
FINISH_REASONS = {"stop": "stop", "length": "length"}  # SGLang's meta_info["finish_reason"]["type"] -> ours


def check_sampling(sampling: SamplingParams, speculating: bool, mask_max_tokens: int) -> bool:
    """Whether SGLang can report the log-probabilities of the distribution it samples from with these
    settings (raises if not, naming the config key); True: the kept-set renormalised ones are needed
    (`return_sampling_mask`)."""
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
    if not 1 < sampling.top_k <= mask_max_tokens:
        raise ValueError(f"rollout.top_k {sampling.top_k}: SGLang 0.5.23 returns renormalised log-probabilities "
                         f"only for 1 < top_k <= {mask_max_tokens}")
    return True


def sampling_params(sampling: SamplingParams, request: Request, seed: int, index: int) -> dict[str, Any]:
    """One request's SGLang sampling parameters (top_k -1: off; a seed of its own per request, from its
    key, else its index in the call)."""
    key = index if request.key is None else request.key
    return {"temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_new_tokens": request.max_new_tokens or sampling.max_new_tokens,
            "ignore_eos": sampling.ignore_eos, "sampling_seed": (seed * 1_000_003 + key) % 2**63}


def flatten_hidden(chunks: list) -> Tensor:
    """`meta_info["hidden_states"]` as one [positions, H] tensor: prefill chunks arrive as lists of
    rows, decode steps as rows (one per accepted token)."""
    rows: list[list[float]] = []
    for chunk in chunks:
        if chunk and isinstance(chunk[0], list):
            rows.extend(chunk)
        else:
            rows.append(chunk)
    return torch.tensor(rows, dtype=torch.float32)


def completion(out: dict, prompt_len: int, max_new_tokens: int, max_context: int, masked: bool,
               capture: bool) -> Completion:
    """One SGLang output as our Completion: tokens, the sampling distribution's log-probabilities,
    why it ended, its speculation counts and (capture) the target states of positions 0..T-2."""
    meta = out["meta_info"]
    tokens = list(out["output_ids"])
    reason = meta["finish_reason"] or {"type": "length"}
    if reason["type"] not in FINISH_REASONS:
        raise RuntimeError(f"SGLang ended a request with {reason}")
    finish = FINISH_REASONS[reason["type"]]
    if finish == "length" and len(tokens) < max_new_tokens and prompt_len + len(tokens) >= max_context:
        finish = "context"
    if masked:
        logprobs = [float(x) for x in meta["output_token_sampling_logprobs"]]
    else:
        triples = meta["output_token_logprobs"]
        if [t for _, t, _ in triples] != tokens:
            raise RuntimeError("SGLang's log-probabilities belong to other tokens than its output")
        logprobs = [float(lp) for lp, _, _ in triples]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"SGLang returned {len(logprobs)} log-probabilities for {len(tokens)} tokens")
    verify = int(meta.get("spec_verify_ct", 0))
    hidden = None
    if capture:
        hidden = flatten_hidden(meta["hidden_states"])[: prompt_len + len(tokens) - 1]
        if hidden.shape[0] != prompt_len + len(tokens) - 1:
            raise RuntimeError(f"SGLang returned {hidden.shape[0]} hidden states for {prompt_len + len(tokens) - 1} "
                               f"positions")
    return Completion(tokens, logprobs, finish, {"spec_steps": verify, "spec_emitted": len(tokens) if verify else 0},
                      hidden)


def adaptive_tiers(policy: SpeculationPolicy, max_batch: int) -> dict[str, dict]:
    """SGLang's adaptive speculation slots (keys: the lowest batch size of each range) holding, for
    each range of concurrency, the one chain depth our policy picks there (0: no speculation). One
    candidate per slot: SGLang's acceptance EMA has nothing to switch between, our rule decides."""
    slots: dict[str, dict] = {}
    previous = None
    for running in range(1, max_batch + 1):
        config = policy.choose(running)
        steps = 0 if config is None else config.depth
        if steps != previous:
            slots[str(running)] = {"candidate_steps": [steps], "up_hysteresis": 0.0, "down_hysteresis": 0.0}
            previous = steps
    return slots


def server_args(cfg: Config, mode: str, draft_export: Path | None, tiers_file: Path | None,
                base_gpu_id: int) -> dict[str, Any]:
    """The keyword arguments of `sglang.Engine` for this rank's engine: `engine.tensor` GPUs of its
    node from `base_gpu_id` (the GPUs of the engine's own ranks, colocated with the trainer)."""
    args: dict[str, Any] = dict(
        model_path=cfg.model.path, tp_size=cfg.engine.tensor, base_gpu_id=base_gpu_id, mem_fraction_static=cfg.engine.mem_fraction,
        context_length=cfg.model.max_context, max_running_requests=cfg.rollout.max_batch, random_seed=cfg.seed,
        skip_tokenizer_init=True, enable_memory_saver=True, enable_draft_weights_cpu_backup=True,
        enable_return_hidden_states=cfg.draft.online != "off", sampling_mask_max_tokens=max(cfg.rollout.top_k, 64),
        log_level="warning")
    if mode == "off":
        return args
    sc = cfg.speculation
    args.update(speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft_export))
    if mode == "static":
        args.update(speculative_num_steps=sc.depth, speculative_eagle_topk=sc.topk,
                    speculative_num_draft_tokens=sc.num_verify)
    else:  # adaptive: chains (top-k 1), the depth chosen per batch-size slot
        args.update(speculative_eagle_topk=1, speculative_adaptive=True)
        if tiers_file is not None:
            args["speculative_adaptive_config"] = str(tiers_file)
    return args


class SGLangEngine:
    """The Engine protocol over one `sglang.Engine`; see the module docstring for what it relies on."""

    def __init__(self, engine: Any, cfg: Config, model_config: PretrainedConfig, mode: str, masked_sampling: bool):
        self._engine = engine
        self.cfg = model_config
        self.max_context = cfg.model.max_context
        self.tp = cfg.engine.tensor
        self.mode = mode
        self.masked_sampling = masked_sampling  # the rollout's sampling needs SGLang's renormalised log-probabilities
        self.weights_version: int | None = -1  # None: a push is under way
        self._incoming = -1
        self._names: set[str] = set()
        self.draft_version = -1
        self.draft_source = None
        self._dropped_warned = False
        self._stats: dict[str, Any] = {}

    # -- weights --------------------------------------------------------------------------
    def _call(self, what: str, coroutine) -> None:
        result = self._engine.loop.run_until_complete(coroutine)
        success, message = result if isinstance(result, tuple) else (getattr(result, "success", True), "")
        if not success:
            raise RuntimeError(f"SGLang {what} failed: {message}")

    def _push(self, named_tensors: list[tuple[str, Tensor]], selector: str, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize(named_tensors)
        request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload] * self.tp, flush_cache=False,
                                                  weight_version=str(version), selector=selector)
        self._call("update_weights_from_tensor", self._engine.tokenizer_manager.update_weights_from_tensor(request))

    def _begin(self, selector: str) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self._call("begin_weight_update",
                   self._engine.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector)))

    def _end(self) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self._call("end_weight_update", self._engine.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput()))
        self._call("flush_cache", self._engine.tokenizer_manager.flush_cache())

    def update_weights(self, named_tensors: NamedTensors, version: int, complete: bool = True) -> None:
        """A bucket of policy `version` (SGLang stacks q/k/v and gate/up and slices by its own TP);
        until the commit closes SGLang's update session, generate() refuses to run."""
        if self._incoming != version:
            if self.weights_version is None:
                raise RuntimeError(f"weight version {version} began before the push of {self._incoming} was committed")
            self._begin("target")
            self._incoming, self.weights_version, self._names = version, None, set()
        bucket = [(name, t.detach().contiguous()) for name, t in named_tensors]
        self._push(bucket, "target", version)
        self._names.update(name for name, _ in bucket)
        if complete:
            self.commit_weights(version)

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """SGLang holds the tensors fused and sharded, so the sender's per-tensor checksums cannot be
        compared with what it loaded; what is checked is that every tensor the sender summed arrived."""
        if self._incoming != version:
            raise RuntimeError(f"commit of weight version {version}, but the push under way is of {self._incoming}")
        if checksums is not None and (missing := sorted(set(checksums) - self._names)):
            raise RuntimeError(f"weight version {version} did not include {missing[:3]}")
        self._end()
        self.weights_version = version

    def update_draft(self, named_tensors: NamedTensors, version: int) -> None:
        """Our draft under SGLang's EAGLE names, into the draft runner only; between generate() calls."""
        tensors, dropped = sglang_eagle_tensors({k: v.detach() for k, v in named_tensors}, self.cfg)
        if dropped and not self._dropped_warned:
            log.warning("SGLang's EAGLE Llama draft has no place for the draft's %s: SGLang runs the draft without "
                        "them (lossless; acceptance may be lower than the embedded engine's)", ", ".join(dropped))
            self._dropped_warned = True
        self._begin("draft")
        self._push(list(tensors.items()), "draft", version)
        self._end()
        self.draft_version = version

    def set_speculation(self, policy: SpeculationPolicy) -> None:
        if policy.name != self.mode:
            raise ValueError(f"SGLang fixes speculation when the engine starts ({self.mode}); speculation.policy "
                             f"{policy.name} needs an engine started with it")

    def release_memory(self) -> None:
        self._engine.release_memory_occupation()

    def resume_memory(self) -> None:
        self._engine.resume_memory_occupation()

    def stats(self) -> dict[str, Any]:
        return dict(self._stats, weights_version=self.weights_version, draft_version=self.draft_version)

    # -- generation -----------------------------------------------------------------------
    def generate(self, requests: list[Request], sampling: SamplingParams, seed: int = 0,
                 capture: bool = False) -> list[Completion]:
        if self.weights_version is None:
            raise RuntimeError(f"the push of weight version {self._incoming} is incomplete: no generation until it "
                               f"is committed")
        for i, r in enumerate(requests):
            r.check(i, self.max_context, self.cfg.vocab_size)
        masked = check_sampling(sampling, self.mode != "off", max(sampling.top_k, 64))
        if self.draft_source is not None and (update := self.draft_source()) is not None:
            self.update_draft(*update)
        t0 = time.perf_counter()
        outs = self._engine.generate(
            input_ids=[r.prompt_ids for r in requests],
            sampling_params=[sampling_params(sampling, r, seed, i) for i, r in enumerate(requests)],
            return_logprob=True, return_sampling_mask=masked or None, return_hidden_states=capture)
        seconds = time.perf_counter() - t0
        done = [completion(o, len(r.prompt_ids), r.max_new_tokens or sampling.max_new_tokens, self.max_context,
                           masked, capture) for o, r in zip(outs, requests)]
        tokens = sum(len(c.token_ids) for c in done)
        verify = sum(c.spec["spec_steps"] for c in done)
        emitted = sum(c.spec["spec_emitted"] for c in done)
        self._stats = dict(sequences=len(done), tokens=tokens, seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9),
                           spec_steps=verify, spec_seq_steps=verify, spec_emitted=emitted, decode_steps=verify or tokens,
                           mean_running=0.0, accept_len=emitted / verify if verify else 1.0,
                           config_by_concurrency={}, trace=[])
        return done

    def close(self) -> None:
        self._engine.shutdown()


def build_engine(cfg: Config, model_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 weights: NamedTensors | None = None, speculation: str | None = None) -> SGLangEngine:
    """An SGLang engine on `engine.tensor` GPUs from this rank's (LOCAL_RANK: the engine's leading rank), started
    with the policy at `model.path`, then given `weights` if any; with speculation, our draft exported
    to SGLang's EAGLE format next to the run."""
    if not torch.cuda.is_available():
        raise BackendUnavailable("engine.backend=sglang needs CUDA GPUs; this machine has none (use engine.backend="
                                 "embedded)")
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        log.warning("the SGLang adapter was written against sglang %s; this is %s", SGLANG_VERSION,
                    sglang.__version__)
    gpus = cfg.engine.tensor  # the loop's layout check: they divide the node's GPUs, so they are this node's
    mode = speculation or cfg.speculation.policy
    masked = check_sampling(SamplingParams.of(cfg.rollout), mode != "off", max(cfg.rollout.top_k, 64))
    work = Path(tempfile.mkdtemp(prefix="fastgrpo-sglang-"))
    draft_export = tiers_file = None
    if mode != "off":
        from fastgrpo.backends.embedded import draft_dir

        if not (draft_dir(cfg) / DRAFT_WEIGHTS).is_file():
            raise FileNotFoundError(f"speculation.policy={mode} needs a draft at {draft_dir(cfg) / DRAFT_WEIGHTS}")
        draft_export = work / "eagle-draft"
        export_sglang_eagle(draft_dir(cfg), model_config, draft_export)
        if mode == "fastgrpo":
            tiers_file = work / "adaptive.json"
            tiers_file.write_text(json.dumps(adaptive_tiers(FastGRPOFormula(), cfg.rollout.max_batch), indent=1))
        elif mode in ("aware", "aware_per_sequence"):
            log.warning("speculation.policy=%s on SGLang: SGLang's own adaptive tiers decide (our cost model has "
                        "no calibration of SGLang's GPU forwards; no per-sequence verify budget)", mode)
    base_gpu_id = int(os.environ.get("LOCAL_RANK", 0))
    engine = sglang.Engine(**server_args(cfg, mode, draft_export, tiers_file, base_gpu_id))
    adapter = SGLangEngine(engine, cfg, model_config, mode, masked)
    if weights is not None:
        adapter.update_weights(weights, version=0)
    log.info("SGLang engine on GPUs %d-%d (speculation %s, %s)", base_gpu_id, base_gpu_id + gpus - 1, mode,
             "tiers " + str(tiers_file) if tiers_file else "static" if mode == "static" else "no tiers file")
    return adapter


