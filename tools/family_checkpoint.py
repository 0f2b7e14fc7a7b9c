"""A random-weight Hugging Face checkpoint of a served family at the bench policy's size: the family's
config class, special tokens, chat template and generation_config stop ids (fastgrpo/bench/family_checkpoints.py),
with a byte-level BPE vocabulary trained on the arithmetic task. It is the starting point of `fastgrpo sft`
with `sft.init` for benchmarks in a real family's format (configs/tiny_cpu_qwen2.5.yaml, BENCHMARKS.md
section 3c):

    python tools/family_checkpoint.py qwen2.5 artifacts/qwen2.5-bench-init
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastgrpo.bench.family_checkpoints import FAMILY_NAMES, write_family_checkpoint
from fastgrpo.models.policy import SIZES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=FAMILY_NAMES)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--size", default="bench", choices=sorted(SIZES), help="the shape of fastgrpo's policy of this size")
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.directory.exists():
        parser.error(f"{args.directory} exists: remove it first (a checkpoint is written whole)")
    shape = SIZES[args.size]
    write_family_checkpoint(args.family, args.directory, seed=args.seed, **shape,
                            head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                            layer_types=["full_attention"] * shape["num_hidden_layers"],
                            max_position_embeddings=args.max_context, initializer_range=0.02)
    print(f"wrote a random-weight {args.family} checkpoint of the {args.size} shape to {args.directory}")


if __name__ == "__main__":
    main()
