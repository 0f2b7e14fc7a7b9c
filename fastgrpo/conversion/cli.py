"""Checkpoint conversion: Hugging Face <-> Megatron distributed checkpoints at any TP x PP, reshard, verify,
inspect, and the draft head exported for SGLang (the command; its subcommands and arguments)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fastgrpo.trainers.megatron.layout import LayoutError
from fastgrpo.safetensors_dir import CheckpointError
from fastgrpo.conversion.files import DTYPES, parse_size
from fastgrpo.conversion.sources import layout_of, load_config, open_checkpoint
from fastgrpo.conversion.writers import dry_run, write_hf, write_megatron
from fastgrpo.conversion.checks import inspect, verify
from fastgrpo.conversion.exports import deepspeed_to_hf, export_draft
from fastgrpo.conversion.memory_bench import bench_memory


def _dtype_arg(text: str | None) -> torch.dtype | None:
    if text in (None, "keep"):
        return None
    if text not in DTYPES:
        raise CheckpointError(f"--dtype {text}: one of keep, {', '.join(DTYPES)}")
    return DTYPES[text]


def _parallel_sizes(p: argparse.ArgumentParser, expert_help: str = "expert-parallel size") -> None:
    """The target layout's sizes, named as the config names them (parallel.tensor, .pipeline, .expert,
    .expert_tensor); --tp, --pp, --ep and --etp are the same options."""
    p.add_argument("--tensor", "--tp", dest="tensor", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pipeline", "--pp", dest="pipeline", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--expert", "--ep", dest="expert", type=int, default=1, help=expert_help)
    p.add_argument("--expert-tensor", "--etp", dest="expert_tensor", type=int, default=0,
                   help="the experts' tensor-parallel size: 0 the same as --tensor, or 1 (each expert whole on "
                        "one rank, as parallel.expert_tensor=1 trains)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-megatron", help="a Hugging Face directory -> a Megatron distributed checkpoint")
    p.add_argument("--hf", type=Path, help="Hugging Face directory (safetensors)")
    p.add_argument("--config", type=Path, help="with --dry-run: a config.json alone (e.g. configs/models/llama-3-70b.json)")
    p.add_argument("--out", type=Path)
    _parallel_sizes(p, expert_help="expert-parallel size recorded (a mixture of experts; the stored form is the "
                                   "same at every EP, and loads at any)")
    p.add_argument("--dtype", default="keep")
    p.add_argument("--dry-run", action="store_true", help="list the output tensors and bytes per rank on the meta device")
    p = sub.add_parser("megatron-to-hf", help="a Megatron checkpoint (any layout, or a training step_N) -> Hugging Face")
    p.add_argument("--megatron", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--dtype", default="keep")
    p.add_argument("--tokenizer", type=Path, help="copy the tokenizer (and config) from this directory")
    p = sub.add_parser("deepspeed-to-hf", help="a checkpoint of the DeepSpeed trainer (any ZeRO stage) -> Hugging Face")
    p.add_argument("--checkpoint", type=Path, required=True, help="a training checkpoint (step_N) of trainer.backend=deepspeed")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--dtype", default="keep")
    p = sub.add_parser("reshard", help="a Megatron checkpoint -> the same at another TP x PP (model only)")
    p.add_argument("--megatron", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    _parallel_sizes(p)
    p = sub.add_parser("verify", help="compare two checkpoints of any kind tensor by tensor and by logits")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--logits-atol", type=float, default=1e-4)
    p.add_argument("--no-logits", action="store_true", help="tensors only (logits need each model in memory)")
    p = sub.add_parser("inspect", help="kind, architecture, size, layout and the manifest of a checkpoint")
    p.add_argument("path", type=Path)
    p.add_argument("--check", action="store_true", help="read every tensor and check it against the manifest")
    p.add_argument("--tensors", action="store_true", help="list every tensor's checksum")
    p = sub.add_parser("export-draft", help="the draft head as an EAGLE draft model for SGLang")
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--policy", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--format", default="sglang-eagle", choices=["sglang-eagle"])
    p.add_argument("--drop-norms", action="store_true", help="export although SGLang's EAGLE draft has no place for "
                                                             "the draft's input and final norms")
    p = sub.add_parser("bench-memory", help="peak RSS converting a random model of --size-gb (fp32) both ways")
    p.add_argument("--size-gb", type=float, default=2.5)
    p.add_argument("--output", type=Path, default=Path("bench/convert-memory.json"))
    p.add_argument("--workdir", type=Path, help="where the model is built (default: a temporary directory)")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (CheckpointError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    c = args.command
    if c == "hf-to-megatron":
        if args.dry_run:
            config = load_config(args.config or args.hf) if (args.config or args.hf) else None
            if config is None:
                raise CheckpointError("--dry-run needs --config FILE or --hf DIR")
            dry_run(config, args.tensor, args.pipeline, _dtype_arg(args.dtype), expert=args.expert,
                    expert_tensor=args.expert_tensor)
            return 0
        if not args.hf or not args.out:
            raise CheckpointError("hf-to-megatron needs --hf DIR and --out DIR (or --dry-run)")
        source = open_checkpoint(args.hf)
        if source.kind != "hf":
            raise CheckpointError(f"{args.hf} is a Megatron checkpoint, not a Hugging Face directory (use reshard, "
                                  f"or megatron-to-hf)")
        stats = write_megatron(source, args.out, layout_of(source.config, args.tensor, args.pipeline, args.expert,
                                                           args.expert_tensor), _dtype_arg(args.dtype))
    elif c == "megatron-to-hf":
        source = open_checkpoint(args.megatron)
        if source.kind != "megatron":
            raise CheckpointError(f"{args.megatron} is a Hugging Face directory, not a Megatron checkpoint")
        stats = write_hf(source, args.out, parse_size(args.max_shard_size), _dtype_arg(args.dtype), args.tokenizer)
    elif c == "deepspeed-to-hf":
        stats = deepspeed_to_hf(args.checkpoint, args.out, parse_size(args.max_shard_size), _dtype_arg(args.dtype))
    elif c == "reshard":
        source = open_checkpoint(args.megatron)
        if source.kind != "megatron":
            raise CheckpointError(f"{args.megatron} is a Hugging Face directory, not a Megatron checkpoint")
        stats = write_megatron(source, args.out, layout_of(source.config, args.tensor, args.pipeline, args.expert,
                                                           args.expert_tensor))
    elif c == "verify":
        return 0 if verify(args.a, args.b, args.atol, args.logits_atol, not args.no_logits) else 1
    elif c == "inspect":
        inspect(args.path, args.check, args.tensors)
        return 0
    elif c == "export-draft":
        stats = export_draft(args.draft, args.policy, args.out, args.drop_norms)
    elif c == "bench-memory":
        stats = bench_memory(args.size_gb, args.output, args.workdir)
    print(json.dumps(stats))
    return 0
