"""Exports: the draft head as SGLang's EAGLE draft, and a DeepSpeed checkpoint as a Hugging Face directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fastgrpo.safetensors_dir import CheckpointError, read_safetensor, read_safetensors_header
from fastgrpo.conversion.files import SafetensorsWriter, atomic_dir
from fastgrpo.conversion.sources import load_config
from fastgrpo.conversion.writers import _cast, _copy_non_weights
from fastgrpo.paths import DRAFT_CONFIG, DRAFT_WEIGHTS, checkpoint_policy, draft_weights, has_draft, is_policy


def export_draft(draft: Path, policy: Path, out: Path, drop_norms: bool = False) -> dict:
    """Our draft head (fastgrpo/models/draft.py) as SGLang's EAGLE Llama draft model
    (fastgrpo/models/draft.py `sglang_eagle_tensors`: the names, and the norms SGLang's class has no place for). A draft whose
    norms would be dropped computes another function there: refused unless `drop_norms` (SGLang's
    verification keeps sampling lossless; acceptance may drop)."""
    from fastgrpo.models.draft import SGLANG_EAGLE_ARCHITECTURE, sglang_eagle_config, sglang_eagle_tensors

    draft, policy = Path(draft), Path(policy)
    if not has_draft(draft):
        raise CheckpointError(f"{draft} is not a draft directory ({DRAFT_WEIGHTS} missing; `fastgrpo draft-pretrain` "
                              f"writes one)")
    config = load_config(policy)
    header, start = read_safetensors_header(draft_weights(draft))
    w = {k: read_safetensor(draft_weights(draft), e, start) for k, e in header.items()}
    try:
        tensors, dropped = sglang_eagle_tensors(w, config)
    except ValueError as e:
        raise CheckpointError(f"{draft}: {e} (policy at {policy})") from e
    if dropped and not drop_norms:
        raise CheckpointError(
            f"SGLang's EAGLE Llama draft ({SGLANG_EAGLE_ARCHITECTURE}, llama_eagle.py) has no input norm in its layer "
            f"and no final norm, so this draft's {', '.join(dropped)} cannot be carried over; pass --drop-norms to "
            f"export without them (verification stays lossless, acceptance may drop)")
    with atomic_dir(out) as tmp:
        writer = SafetensorsWriter(tmp, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], 2**62)
        for n, t in tensors.items():
            writer.write(n, t)
        writer.close()
        # SGLang runs the draft in the dtype its config names: the policy's (bfloat16 unless it says)
        dtype = str(getattr(config, "dtype", None) or "bfloat16").removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(sglang_eagle_config(config, dtype), indent=2))
        meta = json.loads((draft / DRAFT_CONFIG).read_text()) if (draft / DRAFT_CONFIG).is_file() else {}
        (tmp / "fastgrpo-export.json").write_text(json.dumps(
            {"format": "sglang-eagle", "sglang_class": SGLANG_EAGLE_ARCHITECTURE,
             "sglang_source": "python/sglang/srt/models/llama_eagle.py (sglang 0.5.23)", "dropped": dropped,
             "draft": meta}, indent=1))
    return {"tensors": len(tensors), "dropped": dropped}


def deepspeed_to_hf(checkpoint: Path, out: Path, max_shard: int, dtype: torch.dtype | None = None) -> dict:
    """The DeepSpeed trainer's checkpoint (`<checkpoint>/deepspeed`, every rank's ZeRO partitions) as a
    Hugging Face directory, consolidated by DeepSpeed's own `zero_to_fp32` (which holds the whole fp32
    model in memory: a tool for one machine with enough of it); config and tokenizer from the
    checkpoint's `policy/`."""
    from fastgrpo.trainers.deepspeed_trainer import CHECKPOINT_TAG

    checkpoint = Path(checkpoint)
    ds_dir, policy = checkpoint / "deepspeed", checkpoint_policy(checkpoint)
    if not (ds_dir / "fastgrpo.json").is_file():
        raise CheckpointError(f"{checkpoint} holds no DeepSpeed checkpoint ({ds_dir / 'fastgrpo.json'} missing)")
    if not is_policy(policy):
        raise CheckpointError(f"{checkpoint} has no policy/config.json to name the model")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=CHECKPOINT_TAG)
    if load_config(policy).tie_word_embeddings:
        state.pop("lm_head.weight", None)
    plan = [(name, tuple(t.shape), dtype or t.dtype) for name, t in state.items()]
    with atomic_dir(out) as tmp:
        writer = SafetensorsWriter(tmp, plan, max_shard)
        for name, t in state.items():
            writer.write(name, _cast(t, dtype))
        writer.close()
        _copy_non_weights(policy, tmp)
    return {"tensors": len(plan), "bytes": writer.total, "files": len(writer.files)}
