"""Checkpoint conversion: Hugging Face <-> Megatron distributed checkpoints at any TP x PP, reshard,
verify, inspect, and the draft head exported for SGLang.

    python tools/convert_checkpoint.py SUBCOMMAND --help     (or: python -m fastgrpo.conversion ...)

Why it looks the way it does:
- One name/layout mapping: every tensor goes through `fastgrpo.trainers.megatron.layout.Layout`, the
  one the Megatron trainer loads and exports with; nothing here knows a parameter name of its own.
- Streaming: a 70B model never fits a login node's memory, so tensors are read and written one
  Megatron parameter at a time (the Hugging Face tensors it is made of, the full tensor, one rank's
  piece). Safetensors are read with plain file reads (no mmap that would keep every page touched
  resident) and written by a streaming writer (the shard's header is known from the plan before any
  data), Megatron's torch_dist checkpoints through torch.distributed.checkpoint with a planner that
  materialises each piece only when the writer asks for it and reads one layer's slice at a time.
- Safety: safetensors only (a `.bin` is refused, never unpickled); a Megatron checkpoint's
  `.metadata` is read by an unpickler that admits only torch.distributed.checkpoint's metadata
  classes, and its tensors with `weights_only`; no `trust_remote_code`. Every output is written to a
  temporary directory next to it and renamed at the end, with a manifest of per-tensor sha256
  checksums (`fastgrpo-manifest.json`, keyed by Hugging Face names whatever the kind) that every
  command checks when it reads the checkpoint back.

The parts: `fastgrpo.safetensors_dir` (below this package, shared with the Megatron trainer: safetensors
read one tensor at a time, checksums and manifests checked), `files` (dtypes, manifests and safetensors
written, atomic outputs), `sources`
(Hugging Face and Megatron checkpoints read one parameter at a time), `writers` (Hugging Face and
Megatron written at any TP x PP; the dry run), `checks` (verify, inspect), `exports` (the SGLang EAGLE
draft, DeepSpeed to Hugging Face), `memory_bench` (bench-memory), and `cli` (the command).
"""

from fastgrpo.safetensors_dir import (  # noqa: F401
    INDEX, MANIFEST, ST_DTYPES, Checker, CheckpointError, SafetensorsDir, checksum, read_manifest, read_safetensor,
    read_safetensors_header)
from fastgrpo.conversion.files import (  # noqa: F401
    DTYPES, HF_NON_WEIGHT, ST_NAMES, SafetensorsWriter, atomic_dir, parse_size, write_manifest)
from fastgrpo.conversion.sources import (  # noqa: F401
    HFSource, MegatronSource, dcp_reader, keys_map, layout_of, load_config, open_checkpoint)
from fastgrpo.conversion.writers import (  # noqa: F401
    MetaSource, dry_run, megatron_plan, write_hf, write_megatron)
from fastgrpo.conversion.checks import (  # noqa: F401
    PROMPTS, inspect, scaled_config, verify)
from fastgrpo.conversion.exports import (  # noqa: F401
    deepspeed_to_hf, export_draft)
from fastgrpo.conversion.memory_bench import (  # noqa: F401
    bench_memory)
from fastgrpo.conversion.cli import (  # noqa: F401
    main)
