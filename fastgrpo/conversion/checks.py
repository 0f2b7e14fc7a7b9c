"""Verifying two checkpoints against each other (tensors and logits), inspecting one, and scaled-down
configs for tests."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import Tensor

from fastgrpo.safetensors_dir import CheckpointError, checksum
from fastgrpo.conversion.files import _dtype_name
from fastgrpo.conversion.sources import open_checkpoint


PROMPTS = torch.randint(3, 100, (3, 16), generator=torch.Generator().manual_seed(0))


def _logits(source, prompts: Tensor) -> Tensor:
    """The logits of a checkpoint's model on `prompts` (Hugging Face's implementation, fp32)."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.families import checkpoint_tensors

    model = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32).eval()
    # under a checkpoint's names: a mixture of experts' stacked experts as views of each expert's matrices
    params = dict(checkpoint_tensors(model.state_dict().items()))
    for name in source.names():
        for hf, t in source.hf_group(name).items():
            params[hf].copy_(t)
    with torch.no_grad():
        return model(prompts % source.layout.vocab).logits.float()


def verify(a: Path, b: Path, atol: float = 0.0, logits_atol: float = 1e-4, logits: bool = True,
           out=None) -> bool:
    """Tensor-by-tensor (names mapped through the layout) and logits comparison of two checkpoints of
    any kind; True if they match."""
    out = out or sys.stdout
    sa, sb = open_checkpoint(a), open_checkpoint(b)
    from fastgrpo.trainers.megatron.checkpoint import checkpoint_identity

    ia, ib = checkpoint_identity(sa.config, sa.layout), checkpoint_identity(sb.config, sb.layout)
    if ia != ib:
        print(f"MISMATCH: different models: {a}: {ia}, {b}: {ib}", file=out)
        return False
    worst, worst_name, ok, count = 0.0, None, True, 0
    for name in sa.names():
        ga, gb = sa.hf_group(name), sb.hf_group(name)
        if set(ga) != set(gb):
            print(f"MISMATCH: {name}: tensors {sorted(ga)} vs {sorted(gb)}", file=out)
            return False
        for hf in ga:
            x, y = ga[hf], gb[hf]
            count += 1
            if x.shape != y.shape:
                print(f"MISMATCH: {hf}: shape {tuple(x.shape)} vs {tuple(y.shape)}", file=out)
                ok = False
                continue
            d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            if x.dtype != y.dtype:
                print(f"note: {hf}: dtype {x.dtype} vs {y.dtype}", file=out)
            if d > worst or worst_name is None:
                worst, worst_name = d, hf
            if d > atol:
                ok = False
    print(f"tensors: {count} compared; largest difference {worst:.3g} ({worst_name}); "
          f"{'equal' if worst == 0 else 'within' if ok else 'BEYOND'} tolerance {atol:g}", file=out)
    if logits:
        la, lb = _logits(sa, PROMPTS), _logits(sb, PROMPTS)
        d = (la - lb).abs().max().item()
        print(f"logits on {PROMPTS.shape[0]} fixed prompts of {PROMPTS.shape[1]} tokens: largest difference {d:.3g} "
              f"({'within' if d <= logits_atol else 'BEYOND'} tolerance {logits_atol:g})", file=out)
        ok = ok and d <= logits_atol
    print("OK: the checkpoints match" if ok else "MISMATCH", file=out)
    return ok


def inspect(path: Path, check: bool = False, tensors: bool = False, out=None) -> dict:
    """What a checkpoint is, from headers and metadata (no tensor read unless `check`)."""
    out = out or sys.stdout
    src = open_checkpoint(path)
    shapes, dtypes = {}, set()
    for name in src.names():
        for hf, t in src.hf_meta(name).items():
            shapes[hf] = (tuple(t.shape), t.dtype)
            dtypes.add(_dtype_name(t.dtype))
    params = sum(math.prod(s) for s, _ in shapes.values())
    disk = sum(f.stat().st_size for f in src.files)
    info = {"path": str(path), "kind": src.kind, "architecture": (getattr(src.config, "architectures", None) or
                                                                  [src.config.model_type])[0],
            "parameters": params, "dtype": sorted(dtypes), "size_on_disk": disk, "files": len(src.files)}
    if src.kind == "megatron":
        info["layout"] = {"tensor": src.layout.tensor, "pipeline": src.layout.pipeline}
        if src.layout.experts:
            info["layout"].update(expert=src.layout.expert, expert_tensor=src.layout.expert_tp)
        info["training_checkpoint"] = src.info.get("optimizer", True)
        info["updates"] = src.info.get("updates")
    manifest = src.check.manifest
    info["manifest"] = None if manifest is None else f"{len(manifest)} tensors, sha256"
    if manifest is not None and set(manifest) != set(shapes):
        raise CheckpointError(f"{path}: its manifest lists other tensors than the checkpoint holds: "
                              f"{sorted(set(manifest) ^ set(shapes))[:5]}")
    if check:
        sums = {}
        for name in src.names():
            for hf, t in src.hf_group(name).items():
                sums[hf] = checksum(t)
        info["checked"] = "against the manifest" if manifest is not None else "no manifest: checksums computed"
        manifest = manifest or {k: {"shape": list(shapes[k][0]), "dtype": _dtype_name(shapes[k][1]), "sha256": v}
                                for k, v in sums.items()}
    for k, v in info.items():
        print(f"{k:<20} {v}", file=out)
    if tensors and manifest:
        for k, v in manifest.items():
            print(f"  {k:<56} {'x'.join(map(str, v['shape'])):<14} {v['dtype']:<9} {v['sha256'][:16]}", file=out)
    return info


# -- model configs ----------------------------------------------------------------------------------
def scaled_config(config, layers: int = 2, head_dim: int = 8, kv_heads: int = 2, ffn_per_hidden: float | None = None,
                  vocab: int | None = None, experts: int = 8):
    """The same architecture scaled down for tests: the real GQA ratio (heads per KV head), biases,
    tying and norm/rope settings, with few layers, `kv_heads` KV heads of `head_dim`, the real MLP
    width ratio, and a vocabulary (not a multiple of 128, so padding is exercised). A mixture of
    experts keeps its routing (top-k normalisation) and its experts' width ratio, with `experts`
    experts of which 2 per token (a real model's 8 of 128 would be all of them)."""
    raw = config.to_dict()
    ratio = config.num_attention_heads // config.num_key_value_heads
    heads = kv_heads * ratio
    hidden = heads * head_dim
    ffn = ffn_per_hidden or config.intermediate_size / config.hidden_size
    raw.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               hidden_size=hidden, intermediate_size=int(round(hidden * ffn / 4)) * 4,
               vocab_size=vocab or config.vocab_size // 512, max_position_embeddings=128)
    if getattr(config, "num_experts", 0):
        # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, its attribute_map's name)
        raw["num_local_experts" if "num_local_experts" in raw else "num_experts"] = experts
        raw.update(num_experts_per_tok=min(2, config.num_experts_per_tok),
                   moe_intermediate_size=int(round(hidden * config.moe_intermediate_size / config.hidden_size / 4)) * 4)
    raw.pop("max_window_layers", None)
    raw.pop("layer_types", None)
    raw.pop("transformers_version", None)
    return type(config).from_dict(raw)


# -- the command line --------------------------------------------------------------------------------
