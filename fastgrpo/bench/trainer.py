"""`fastgrpo bench trainer`: one GRPO train step of the torch, Megatron and DeepSpeed trainers, where
the distributed trainers' extra time goes, and the weight push from each layout to its engines.

Every layout trains on the same batch (random token sequences of rollout-like lengths, random
advantages: the step's cost depends on shapes, not on what the tokens say) in a world of its own
processes on this machine (gloo); each rank times `train_step` after a warm-up step, and the time
spent inside torch.distributed collectives and pipeline point-to-point transfers is measured by
wrapping them (a transfer's time is from its start to the end of its `wait`), so compute = step -
communication. Communication time includes waiting for a peer that is still computing (a pipeline
stage waits out the other stage's share of the micro-batches: the pipeline bubble). On 2 cores a
world of 2 or 4 is not expected to be faster than a world of 1: the point is the overhead, measured.
Each rank also reports the bytes its optimizer holds beyond the model's weights (Adam's moments,
master copies where it steps copies): what TP and PP shard with the model, and what megatron's
distributed optimizer and ZeRO shard over the data-parallel ranks (1/DP).

`--moe` times a mixture of experts instead: a Qwen3-MoE at the bench policy's sizes (8 experts, top-2,
random weights) written for the run, on the torch trainer, Megatron with and without expert parallelism
(EP2: each rank holds half the experts, and the push gathers them from their ranks) and DeepSpeed ZeRO-3.

The weight push is the run's own (`bridge.WeightBridge` from `export_weights` into an embedded
engine on each replica's leading rank, checksummed and committed), timed after a warm-up push, and
set against the memcpy bound: the time to copy the same tensors once in memory on that rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config
from fastgrpo.local_world import run_world

# backend, world, tensor, pipeline, expert (data parallelism: what remains of the world; expert-parallel ranks
# split it); deepspeed-zN: ZeRO stage N;
# megatron-distopt: megatron with its distributed optimizer (trainer.distributed_optimizer); a -bf16 suffix:
# trainer.precision=bf16 (native on a CPU with AVX512-BF16, which this machine has; emulated, slowly, elsewhere)
LAYOUTS = (("torch", 1, 1, 1, 1), ("torch-bf16", 1, 1, 1, 1), ("megatron", 1, 1, 1, 1), ("megatron-bf16", 1, 1, 1, 1),
           ("megatron", 2, 2, 1, 1), ("megatron", 2, 1, 1, 1),
           ("megatron-distopt", 2, 1, 1, 1), ("megatron", 4, 2, 2, 1), ("megatron-distopt", 4, 1, 1, 1),
           ("deepspeed-z2", 1, 1, 1, 1), ("deepspeed-z2", 2, 1, 1, 1), ("deepspeed-z3", 1, 1, 1, 1),
           ("deepspeed-z3", 2, 1, 1, 1))
MOE_LAYOUTS = (("torch", 1, 1, 1, 1), ("megatron", 1, 1, 1, 1), ("megatron", 2, 1, 1, 1), ("megatron", 2, 1, 1, 2),
               ("deepspeed-z3", 2, 1, 1, 1))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier")


def _batch(vocab: int, sequences: int, seed: int = 0):
    from fastgrpo.grpo.batch import build_batch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (24,), generator=gen, device="cpu").tolist() for _ in range(sequences)]
    responses = [torch.randint(3, vocab, (32 + 8 * (i % 5),), generator=gen, device="cpu").tolist()
                 for i in range(sequences)]
    return build_batch(prompts, responses, [[-1.0] * len(r) for r in responses],
                       torch.randn(sequences, generator=gen, device="cpu"), pad_id=0)


def _timed_collectives() -> dict[str, float]:
    """Wrap torch.distributed's collectives (what megatron's TP and DDP call) and batched point-to-point
    transfers (megatron's pipeline schedules) to add up their time."""
    import torch.distributed as dist

    spent = {"seconds": 0.0}

    class TimedWork:
        def __init__(self, work, started: float):
            self.work, self.started = work, started

        def wait(self, *args, **kwargs):
            try:
                return self.work.wait(*args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - self.started
                self.started = time.perf_counter()  # a second wait() adds only its own time

        def __getattr__(self, name):
            return getattr(self.work, name)

    batch_isend_irecv = dist.batch_isend_irecv

    def timed_p2p(ops):
        started = time.perf_counter()
        return [TimedWork(w, started) for w in batch_isend_irecv(ops)]
    dist.batch_isend_irecv = timed_p2p
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def timed(*args, _original=original, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - t
        setattr(dist, name, timed)
    return spent


def _rank(rank: int, world: int, backend: str, tensor: int, pipeline: int, expert: int, cfg: Config, sequences: int,
          reps: int) -> dict:
    from fastgrpo.types import SamplingParams

    from fastgrpo.device import Compute

    sampling = SamplingParams.of(cfg.rollout)
    spent = _timed_collectives()
    backend, bf16 = backend.removesuffix("-bf16"), backend.endswith("-bf16")
    compute = Compute(torch.device("cpu"), torch.bfloat16 if bf16 else torch.float32)
    if backend == "torch":
        from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
        from fastgrpo.models.policy import load_policy

        trainer = TorchPolicyTrainer(load_policy(cfg.model.path), cfg.grpo, cfg.optim, sampling, compute=compute)
        vocab = trainer.model.config.vocab_size
    elif backend.startswith("deepspeed"):
        from fastgrpo.trainers.deepspeed_trainer import DeepSpeedPolicyTrainer
        from fastgrpo.config import DeepSpeedConfig

        trainer = DeepSpeedPolicyTrainer(cfg.model.path, cfg.grpo, cfg.optim, sampling,
                                         DeepSpeedConfig(zero_stage=int(backend[-1])), compute=compute)
        vocab = trainer.hf_config.vocab_size
    else:
        from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer

        trainer = MegatronPolicyTrainer(cfg.model.path, cfg.grpo, cfg.optim, sampling, tensor=tensor, pipeline=pipeline,
                                        seed=cfg.seed, distributed_optimizer=backend == "megatron-distopt",
                                        compute=compute, expert=expert)
        vocab = trainer.layout.vocab
    batch = _batch(vocab, sequences)
    batch.engine_logprobs = trainer.logprobs(batch) * batch.response_mask
    trainer.train_step(batch)  # warm-up
    steps, comms = [], []
    for _ in range(reps):
        spent["seconds"] = 0.0
        t = time.perf_counter()
        trainer.train_step(batch)
        steps.append(time.perf_counter() - t)
        comms.append(spent["seconds"])
    return ({"step_s": statistics.median(steps), "comm_s": statistics.median(comms),
             "optimizer_bytes": _optimizer_bytes(trainer)} | _time_push(trainer, cfg, reps, bf16))


def _optimizer_bytes(trainer) -> int:
    """What this rank's optimizer holds beyond the model's own weights, after a step (Adam's state
    exists from the first one): Adam's moments, and master copies of the weights where the optimizer
    steps copies (bf16 masters; DeepSpeed's fp32 partitions). Megatron's trainer counts its own
    (`optimizer_bytes`); elsewhere the torch optimizer inside is walked."""
    if hasattr(trainer, "optimizer_bytes"):
        return trainer.optimizer_bytes()
    opt = trainer.optimizer
    while not isinstance(opt, torch.optim.Optimizer):  # DeepSpeed's ZeRO optimizer wraps a torch one
        opt = opt.optimizer
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters() if p.numel()}
    # what it steps: its groups' parameters, and the keys of its state (ZeRO-3 puts its fp32 partitions
    # in the groups only while it steps)
    held = {id(p): p for group in opt.param_groups for p in group["params"]} | {id(p): p for p in opt.state}
    total = 0
    for p in held.values():
        if p.untyped_storage().data_ptr() not in weights:
            total += p.numel() * p.element_size()
        total += sum(t.numel() * t.element_size() for k, t in opt.state.get(p, {}).items()
                     if k != "step" and isinstance(t, torch.Tensor))
    return total


def _time_push(trainer, cfg: Config, reps: int, bf16: bool = False) -> dict:
    """The weight push into this replica's engine (on its leading rank; the others take part in the
    gathers), and on a leading rank the memcpy bound of the same bytes."""
    from transformers import AutoConfig

    from fastgrpo.bridge import WeightBridge
    from fastgrpo.device import Compute
    from fastgrpo.engines.embedded.build import build_engine
    from fastgrpo.models.tokenizer import load_text_format

    engine = None
    if trainer.placement().leads_replica:
        # the engine holds the weights in the trainer's precision, as a run's does (bf16 emulated where this
        # CPU lacks it, as the trainer's is here)
        compute = Compute(torch.device("cpu"), torch.bfloat16 if bf16 else torch.float32)
        engine = build_engine(cfg, AutoConfig.from_pretrained(cfg.model.path), load_text_format(cfg.model.path, cfg.task),
                              speculation="off", compute=compute)
    bridge = WeightBridge([engine] if engine is not None else [])
    bridge.push(trainer.export_weights(), version=0)  # warm-up
    pushes = [bridge.push(trainer.export_weights(), version=v) for v in range(1, reps + 1)]
    out = {"sync_s": statistics.median(p.seconds for p in pushes), "sync_bytes": pushes[0].bytes}
    if engine is not None:
        held = [t for _, t in engine.model.named_weights()]
        sources = [t.clone() for t in held]
        copies = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for dst, src in zip(held, sources):
                dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        out |= {"memcpy_s": statistics.median(copies), "memcpy_bytes": sum(t.numel() * t.element_size() for t in held)}
    return out


def moe_policy(directory: Path, cfg: Config, seed: int = 0) -> Path:
    """A Qwen3-MoE policy at the bench policy's sizes (hidden 512, 6 layers, 8 heads), each layer's MLP 8
    experts of 768 (top-2: half the dense MLP's 1536 a token), random weights and a tokenizer of its own:
    what `--moe` trains and pushes (the time depends on the shapes, not the values)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from fastgrpo.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([f"{a} + {b} = \\boxed{{{a + b}}}" for a in range(40) for b in range(40)])
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=64, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=768, intermediate_size=1536, norm_topk_prob=True,
                            tie_word_embeddings=False, max_position_embeddings=cfg.model.max_context,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def bench_trainer(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None,
                  layouts: tuple[tuple[str, int, int, int, int], ...] | None = None, moe: bool = False) -> dict:
    """`layouts`: LAYOUTS, or with `moe` MOE_LAYOUTS, unless given."""
    if moe:
        with tempfile.TemporaryDirectory() as policy:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(moe_policy(Path(policy), cfg))))
            return _bench(cfg, quick, output, extra, layouts or MOE_LAYOUTS, moe=True)
    return _bench(cfg, quick, output, extra, layouts or LAYOUTS)


def _bench(cfg: Config, quick: bool, output: Path, extra: list[str] | None,
           layouts: tuple[tuple[str, int, int, int, int], ...], moe: bool = False) -> dict:
    reps, sequences = (2, 16) if quick else (5, 32)
    t0 = time.perf_counter()
    rows = []
    for backend, world, tensor, pipeline, expert in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_world(_rank, world, Path(tmp), backend, tensor, pipeline, expert, cfg, sequences, reps,
                              timeout_s=1800.0, threads=max(1, torch.get_num_threads() // world))
        step = max(r["step_s"] for r in ranks)  # the step ends when the slowest rank does
        comm = statistics.median(r["comm_s"] for r in ranks)
        sync = max(r["sync_s"] for r in ranks)  # every engine holds the version when the slowest push ends
        leaders = [r for r in ranks if "memcpy_s" in r]
        memcpy = statistics.median(r["memcpy_s"] for r in leaders)
        name = _layout_name(backend, world, tensor, pipeline, expert)
        rows.append({"layout": name, "world": world, "step_s": step, "comm_s": comm, "sync_s": sync,
                     "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),  # per rank: the largest
                     "sync_bytes": ranks[0]["sync_bytes"], "engines": len(leaders), "memcpy_s": memcpy,
                     "sync_gb_s": ranks[0]["sync_bytes"] / sync / 1e9,
                     "memcpy_gb_s": leaders[0]["memcpy_bytes"] / memcpy / 1e9,
                     "sync_share": sync / (step + sync)})
        print(f"{name}: step {step:.3f} s, collectives {comm:.3f} s, optimizer {rows[-1]['optimizer_bytes'] / 1e6:.2f} "
              f"MB per rank; weight push {sync:.3f} s "
              f"({rows[-1]['sync_gb_s']:.2f} GB/s, memcpy {rows[-1]['memcpy_gb_s']:.2f} GB/s)", flush=True)
    base = rows[0]["step_s"]
    for r in rows:
        r["vs_torch"] = r["step_s"] / base
    result = {"meta": {"date": datetime.date.today().isoformat(), "quick": quick, "cores": torch.get_num_threads(),
                       "torch": torch.__version__, "sequences": sequences,
                       "policy": "a random-weight Qwen3-MoE (bench.trainer.moe_policy)" if moe else cfg.model.path,
                       "minibatches": cfg.grpo.minibatches, "repetitions": reps, "seconds": time.perf_counter() - t0},
              "rows": rows}
    publish(result, output, command_line("trainer", quick, output, (["--moe"] if moe else []) + list(extra or [])),
            markdown)
    return result


def _layout_name(backend: str, world: int, tensor: int, pipeline: int, expert: int = 1) -> str:
    """"megatron", "megatron TP2", "megatron DP2", "megatron TP2xPP2", "megatron DP2xEP2", "megatron DP2
    distributed optimizer", "deepspeed ZeRO-3 DP2", ..."""
    backend, bf16 = backend.removesuffix("-bf16"), backend.endswith("-bf16")
    data = world // (tensor * pipeline)
    parts = [f"{k}{n}" for k, n in (("TP", tensor), ("PP", pipeline), ("DP", data), ("EP", expert)) if n > 1]
    name = f"deepspeed ZeRO-{backend[-1]}" if backend.startswith("deepspeed") else backend.removesuffix("-distopt")
    return (name + (" " + "x".join(parts) if parts else "") + (" distributed optimizer" if backend.endswith("-distopt") else "")
            + (" bf16" if bf16 else ""))


def markdown(r: dict, command: str) -> str:
    m = r["meta"]
    lines = [f"Command: `{command}`  ",
             f"Date {m['date']}, {m['cores']} threads in all (shared by a world's ranks), torch {m['torch']}; policy "
             f"`{m['policy']}`; one GRPO step of {m['sequences']} sequences in {m['minibatches']} minibatches, median of "
             f"{m['repetitions']} after a warm-up.", "",
             "Collectives: TP/DP/PP all-reduces, broadcasts and pipeline transfers, waiting for peers included. "
             "Optimizer: what a rank's optimizer holds beyond the model's weights (Adam's moments; master copies "
             "where it steps copies), the largest rank's.", "",
             "| trainer | ranks | step s | in collectives s | compute s | step / torch | optimizer MB per rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        lines.append(f"| {row['layout']} | {row['world']} | {row['step_s']:.3f} | {row['comm_s']:.3f} | "
                     f"{row['step_s'] - row['comm_s']:.3f} | {row['vs_torch']:.2f}x | "
                     f"{row.get('optimizer_bytes', 0) / 1e6:.2f} |")
    lines += ["", "The weight push after the step, into an embedded engine on each replica's leading rank (median "
              "of as many pushes; bytes are the Hugging Face tensors of one copy), against the memcpy bound (the "
              "same tensors copied once in memory on that rank); share: push / (train step + push).", "",
              "| trainer | engines | MB pushed | push s | push GB/s | memcpy GB/s | push / memcpy time | share of step |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        lines.append(f"| {row['layout']} | {row['engines']} | {row['sync_bytes'] / 1e6:.1f} | {row['sync_s']:.3f} | "
                     f"{row['sync_gb_s']:.2f} | {row['memcpy_gb_s']:.2f} | {row['sync_s'] / row['memcpy_s']:.1f}x | "
                     f"{100 * row['sync_share']:.1f}% |")
    return "\n".join(lines)


# -- `fastgrpo bench trainer`: its sub-parser (fastgrpo/bench/command.py) --
class _MoE(argparse.Action):
    """--moe: set, and tell `fastgrpo bench` to build the config alone (the run writes its own policy)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        namespace.needs = "config"


def add_arguments(parser) -> None:
    """`fastgrpo bench trainer`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.add_argument("--moe", action=_MoE, nargs=0, default=False,
                        help="time a mixture of experts (a random-weight Qwen3-MoE written for the run, with and "
                             "without expert parallelism): no policy or draft is built")
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_trainer(cfg, args.quick, args.output, extra=args.extra, moe=args.moe)
