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
- routed experts (enable_return_routed_experts, return_routed_experts): a record per KV slot, zeroed,
  written by each target forward for the slots it computes (a cache hit's slots keep the rows of the
  request that computed them), gathered for positions 0..seqlen-2 when a request finishes and sent as
  base64 of the int32 bytes (state_capturer/, managers/detokenizer_manager.py: routed.py); refused under
  EAGLE. A Qwen3-MoE checkpoint with dense layers raises (SGLang builds every layer sparse), and its
  experts load one tensor per expert, the names SGLang's loader maps (weights.py checkpoint_names).
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

The package: `common` (SGLang's constants, `EmulationError`, tensor IPC, what SGLang derives at start),
`scheduler` (`Scheduler`: start, validation, generation; its knob `DEFAULT_CHUNKED_PREFILL`), the
scheduler's mixins `eagle` and `weights`, and `routed` (the routed-experts capturer).
"""

from .common import (ALL_TAGS, DEFAULT_ADAPTIVE_CONFIG, TOP_K_ALL, EmulationError, _IPC, decode_capture_sizes,
                     hf_eos_token_ids, reset_ipc, resolve_dtype)
from .scheduler import Scheduler, _Request

__all__ = ["ALL_TAGS", "DEFAULT_ADAPTIVE_CONFIG", "TOP_K_ALL", "EmulationError", "Scheduler", "_IPC", "_Request",
           "decode_capture_sizes", "hf_eos_token_ids", "reset_ipc", "resolve_dtype"]
