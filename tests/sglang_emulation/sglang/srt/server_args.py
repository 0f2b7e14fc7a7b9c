"""sglang/srt/server_args.py: the ServerArgs fields the emulation models (a subset of SGLang's,
same names and defaults); any other keyword fails as an unknown field would."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class ServerArgs:
    model_path: str
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: Optional[float] = None
    context_length: Optional[int] = None
    max_running_requests: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    random_seed: Optional[int] = None
    dtype: str = "auto"
    skip_tokenizer_init: bool = False
    log_level: str = "info"
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_return_hidden_states: bool = False
    enable_return_routed_experts: bool = False
    enable_deterministic_inference: bool = False
    sampling_mask_max_tokens: int = 4096
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_adaptive: bool = False
    speculative_adaptive_config: Optional[str] = None
    cuda_graph_max_bs_decode: Optional[int] = None
