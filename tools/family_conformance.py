"""Each supported family computed as Hugging Face computes it, in every layer, measured on the tiny
random-weight checkpoints of fastgrpo/bench/family_checkpoints.py (fp32): the embedded engine's logits through
its KV cache, the Megatron trainer's per-token log-probabilities at TP2 x PP2, and HF -> Megatron (TP2 x
PP2) -> HF conversion. One JSON and one markdown table (BENCHMARKS.md section 11):

    python tools/family_conformance.py --output bench/families.json

The tests hold the same quantities to their bounds (tests/test_families.py, test_megatron_families.py);
this writes the figures down.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from fastgrpo.bench.family_checkpoints import FAMILY_NAMES, write_family_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def engine_vs_hf(path: Path) -> dict:
    """Max |logit diff| of the embedded engine against the HF forward over 3 x 24 tokens fed through the
    KV cache in four chunks (prefill, one decode, two blocks), and whether greedy decoding agrees."""
    from fastgrpo.engines.embedded.model import InferenceModel, KVCache
    from fastgrpo.models.policy import load_policy

    hf = load_policy(path).eval()
    cfg = hf.config
    ids = torch.randint(3, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    model = InferenceModel(cfg, 128, kernel="dense")
    model.load(hf.state_dict().items())
    cache, rows, chunks = KVCache(cfg, 3, 128), slice(0, 3), []
    for a, b in [(0, 10), (10, 11), (11, 17), (17, 24)]:
        logits, _ = model.forward(ids[:, a:b], cache, rows)
        cache.lengths[rows] += b - a
        chunks.append(logits)
    got = torch.cat(chunks, 1)
    return {"engine_max_abs_logit_diff": float((got - ref).abs().max()), "logit_scale": float(ref.abs().max()),
            "engine_argmax_agrees": bool((got.argmax(-1) == ref.argmax(-1)).all())}


def _megatron_scores(rank, world, dirs):
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.types import SamplingParams

    out = {}
    for family, path in dirs.items():
        trainer = MegatronPolicyTrainer(path, GRPOConfig(), OptimConfig(), SamplingParams(), tensor=2, pipeline=2)
        out[family] = trainer.logprobs_and_entropy(_batch(trainer.layout.vocab))[0]
        del trainer
    return out


def _batch(vocab: int):
    """Six rows of mixed lengths up to 84 tokens (past the Llama 3.1 checkpoint's original context of 64)."""
    from fastgrpo.grpo.batch import build_batch

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (6 + i,), generator=gen).tolist() for i in range(6)]
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (78, 40, 9, 60, 3, 25)]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(6))


def megatron_vs_hf(dirs: dict[str, Path], work: Path) -> dict[str, float]:
    from fastgrpo.local_world import run_world
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import token_logprobs
    from fastgrpo.types import SamplingParams

    results = run_world(_megatron_scores, 4, work, dirs, timeout_s=600)
    out = {}
    for family, path in dirs.items():
        policy = load_policy(path)
        batch = _batch(policy.config.vocab_size)
        with torch.no_grad():
            want = token_logprobs(policy, batch, SamplingParams())[0]
        real = batch.attention_mask.bool()
        real[:, 0] = False  # position 0 predicts nothing
        out[family] = max(float((r[family] - want)[real].abs().max()) for r in results)
    return out


def round_trip(path: Path, work: Path) -> dict:
    from safetensors.torch import load_file

    from fastgrpo.conversion.cli import main as convert

    assert convert(["hf-to-megatron", "--hf", str(path), "--out", str(work / "mg"), "--tensor", "2", "--pipeline", "2"]) == 0
    assert convert(["megatron-to-hf", "--megatron", str(work / "mg"), "--out", str(work / "back")]) == 0

    def tensors(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = tensors(path), tensors(work / "back")
    return {"round_trip_tensors": len(a), "round_trip_bit_exact": a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) for k in a)}


def markdown(result: dict) -> str:
    rows = ["| family | checkpoint features | engine vs HF max abs logit diff (logits up to) | engine argmax = HF | "
            "Megatron TP2 x PP2 vs HF max abs log-prob diff | HF -> Megatron TP2 x PP2 -> HF |",
            "| --- | --- | ---: | --- | ---: | --- |"]
    for family, r in result["families"].items():
        rows.append(f"| {family} | {r['features']} | {r['engine_max_abs_logit_diff']:.2e} ({r['logit_scale']:.1f}) | "
                    f"{'yes' if r['engine_argmax_agrees'] else 'NO'} | {r['megatron_max_abs_logprob_diff']:.2e} | "
                    f"{'bit-exact' if r['round_trip_bit_exact'] else 'DIFFERS'} ({r['round_trip_tensors']} tensors) |")
    return "\n".join(rows) + "\n"


FEATURES = {"llama3.1": "llama3 rope scaling, untied head, no pad token",
            "qwen2.5": "q/k/v biases, tied head, no BOS",
            "qwen3": "q/k norms, head_dim 32 (hidden 64 / 4 heads = 16), no BOS"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=ROOT / "bench" / "families.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dirs = {f: write_family_checkpoint(f, work / f) for f in FAMILY_NAMES}
        families = {f: {"features": FEATURES[f], **engine_vs_hf(d)} for f, d in dirs.items()}
        for f, diff in megatron_vs_hf(dirs, work / "world").items():
            families[f]["megatron_max_abs_logprob_diff"] = diff
        for f, d in dirs.items():
            families[f] |= round_trip(d, work / f"{f}-conv")
    result = {"command": "python tools/family_conformance.py --output " + str(args.output.relative_to(ROOT)
                                                                               if args.output.is_absolute()
                                                                               and ROOT in args.output.parents
                                                                               else args.output),
              "dtype": "float32", "torch": torch.__version__, "families": families}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    args.output.with_suffix(".md").write_text(table)
    print(table)
    ok = all(r["engine_max_abs_logit_diff"] < 1e-4 and r["megatron_max_abs_logprob_diff"] < 1e-5
             and r["round_trip_bit_exact"] for r in families.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
