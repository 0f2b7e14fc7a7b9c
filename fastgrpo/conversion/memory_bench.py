"""`bench-memory`: the peak memory of a conversion against the model's size."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from fastgrpo.safetensors_dir import CheckpointError
from fastgrpo.conversion.files import SafetensorsWriter, atomic_dir, parse_size
from fastgrpo.conversion.sources import HFSource
from fastgrpo.conversion.writers import MetaSource


def bench_memory(size_gb: float, output: Path, workdir: Path | None) -> dict:
    """Peak RSS of hf-to-megatron (TP2 x PP2) and megatron-to-hf on a random Llama model of about
    `size_gb` GB in fp32, each in a fresh process, against the model's and its largest tensor's size.
    The model is written tensor by tensor (this process never holds it either)."""
    import platform
    import subprocess
    import time

    from transformers import LlamaConfig

    layers = max(2, round((size_gb * 1e9 / 4 - 2 * 32000 * 2048) / (3 * 2048 * 2048 + 3 * 2048 * 5632)))
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
    work = Path(workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    hf, mg, back = work / "hf", work / "mg", work / "back"
    for d in (hf, mg, back):
        shutil.rmtree(d, ignore_errors=True)
    meta = MetaSource(config)
    plan = [(k, tuple(v.shape), torch.float32) for k, v in meta.state.items()]
    gen = torch.Generator().manual_seed(0)
    with atomic_dir(hf) as tmp:
        writer = SafetensorsWriter(tmp, plan, parse_size("1GB"))
        for name, shape, dtype in plan:
            writer.write(name, torch.randn(shape, generator=gen, dtype=dtype) * 0.02)
        writer.close()
        config.save_pretrained(tmp)
    model_bytes = writer.total
    largest = max(math.prod(s) * 4 for _, s, _ in plan)
    runs = {}
    for name, argv in (("hf-to-megatron TP2xPP2", ["hf-to-megatron", "--hf", str(hf), "--out", str(mg), "--tensor", "2", "--pipeline", "2"]),
                       ("megatron-to-hf", ["megatron-to-hf", "--megatron", str(mg), "--out", str(back)])):
        code = ("import resource, runpy, sys, time; sys.argv = ['convert_checkpoint'] + sys.argv[1:]; t = time.time()\n"
                "try:\n    runpy.run_module('fastgrpo.conversion', run_name='__main__')\n"
                "except SystemExit as e:\n    assert not e.code, e.code\n"
                "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.time() - t)")
        t = time.time()
        res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
        if res.returncode:
            raise CheckpointError(f"bench {name} failed: {res.stderr[-2000:]}")
        peak = int(next(l for l in res.stdout.splitlines() if l.startswith("PEAK")).split()[1])
        runs[name] = {"peak_rss_bytes": peak, "seconds": round(time.time() - t, 1),
                      "peak_over_model": round(peak / model_bytes, 3), "peak_over_largest_tensor": round(peak / largest, 2)}
    baseline = subprocess.run([sys.executable, "-c", "import resource, sys; sys.argv = ['x', '--help']\n"
                               "import fastgrpo.conversion.cli, megatron.core.models.gpt, transformers\n"
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                              capture_output=True, text=True)
    result = {"command": f"python tools/convert_checkpoint.py bench-memory --size-gb {size_gb}",
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
              f"{platform.system()} {platform.release()}", "model": {"layers": layers, "hidden": 2048, "ffn": 5632,
              "vocab": 32000, "parameters": model_bytes // 4, "bytes_fp32": model_bytes, "largest_tensor_bytes": largest},
              "imports_only_rss_bytes": int(baseline.stdout.strip() or 0), "runs": runs,
              "verified_bit_exact": None}
    if not workdir:
        back_src, hf_src = HFSource(back), HFSource(hf)
        result["verified_bit_exact"] = all(
            all(torch.equal(t, hf_src.hf_group(n)[k]) for k, t in back_src.hf_group(n).items()) for n in hf_src.names())
        shutil.rmtree(work, ignore_errors=True)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    return result
