"""The `fastgrpo` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from fastgrpo.config import Config, ConfigError, load_config

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


def _config(args: argparse.Namespace) -> Config:
    path = args.config
    if path is None and Path(DEFAULT_CONFIG).is_file():
        path = DEFAULT_CONFIG
    return load_config(path, args.overrides)


def cmd_train(args: argparse.Namespace) -> None:
    run_train(_config(args), resume=args.resume)


def run_train(cfg: Config, resume: bool = False) -> None:
    """This process's part of a GRPO run: a rank of a torchrun world's reserved draft slice serves the
    engines' draft learning; every other rank (the only one, outside torchrun) runs the loop."""
    from fastgrpo.distributed import init_world, is_draft_rank, launched_rank
    from fastgrpo.train import train

    if is_draft_rank(cfg.parallel.draft_ranks):
        from fastgrpo.device import resolve
        from fastgrpo.draft_learning.async_learner import serve_draft_slice
        from fastgrpo.run_setup import check_layout

        check_layout(cfg)
        resolve(cfg)  # a device or precision this machine lacks fails here, before any work
        serve_draft_slice(cfg, init_world(cfg.parallel.draft_ranks))
        # its receiving threads stay blocked in the store's C++ receive; an interpreter exit that
        # destroys them can abort the rank ("terminate called without an active exception", seen
        # under load): its work is done and saved, so it leaves at once
        _leave()
    train(cfg, resume)
    if cfg.trainer.backend == "deepspeed" and launched_rank() > 0:
        # the same abort at the interpreter's exit hit a ZeRO-3 DP2 policy rank (twice in a row in the
        # suite under load) after its last checkpoint: rank 0 writes what is left, the others leave.
        # DeepSpeed runs only: under Slurm with the other trainers, a rank leaving early held up the
        # job's end by ~45 s (a 2-step job: 85 s -> 181 s), and they never showed the abort
        _leave()


def _leave() -> None:
    """Exit this rank now, without the interpreter's teardown (its work is done and saved)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_sft(args: argparse.Namespace) -> None:
    from fastgrpo.sft import build_policy

    cfg = _config(args)
    if args.if_missing and (Path(cfg.model.path) / "config.json").is_file():
        print(f"policy already at {cfg.model.path}; skipping SFT")
        return
    build_policy(cfg)


def cmd_draft_pretrain(args: argparse.Namespace) -> None:
    from fastgrpo.engines.embedded.build import draft_dir
    from fastgrpo.draft_learning.pretrain import pretrain_draft
    from fastgrpo.engines.embedded.draft import DRAFT_WEIGHTS

    cfg = _config(args)
    if args.if_missing and (draft_dir(cfg) / DRAFT_WEIGHTS).is_file():
        print(f"draft already at {draft_dir(cfg)}; skipping")
        return
    pretrain_draft(cfg)


def ensure_policy_and_draft(cfg: Config, draft: bool = True) -> None:
    """Benchmarks and speculative training build what they need: the policy (SFT), then its draft
    (unless `draft` is false: a benchmark without speculation)."""
    from fastgrpo.engines.embedded.build import draft_dir
    from fastgrpo.draft_learning.pretrain import pretrain_draft
    from fastgrpo.sft import build_policy
    from fastgrpo.engines.embedded.draft import DRAFT_WEIGHTS

    if not (Path(cfg.model.path) / "config.json").is_file():
        print(f"no policy at {cfg.model.path}: building it (fastgrpo sft)")
        build_policy(cfg)
    if draft and not (draft_dir(cfg) / DRAFT_WEIGHTS).is_file():
        print(f"no draft at {draft_dir(cfg)}: building it (fastgrpo draft-pretrain)")
        pretrain_draft(cfg)


def cmd_plan(args: argparse.Namespace) -> int:
    """Exit 0 when the layout fits, 1 when it does not (a config error exits 2, in `main`)."""
    from fastgrpo.plan import make_plan, render

    cfg = _config(args)
    c = cfg.cluster
    nodes = args.nodes if args.nodes is not None else c.nodes
    per_node = args.gpus_per_node if args.gpus_per_node is not None else c.gpus_per_node
    memory = args.gpu_memory_gb if args.gpu_memory_gb is not None else c.gpu_memory_gb
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", per_node), ("--gpu-memory-gb", memory)):
        if value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    plan = make_plan(cfg, nodes, per_node, memory)
    print(render(plan, cfg, nodes, per_node, memory))
    return 0 if plan.fits else 1


def _thread_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts such as 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return counts


def cmd_bench(args: argparse.Namespace) -> int | None:
    if args.what == "gpu-check":  # its own config and stages (the policy and draft are two of them, timed)
        from fastgrpo.bench.gpu_check import main as gpu_check

        if args.config:
            raise ValueError("bench gpu-check builds its own config: give key=value overrides, not --config")
        return gpu_check([*(["--out", args.output] if args.output else []), *(["--size", "test"] if args.quick else []),
                          *args.overrides])
    from fastgrpo.bench.draft_fit import bench_draft
    from fastgrpo.bench.e2e import bench_e2e
    from fastgrpo.bench.engines import bench_engines
    from fastgrpo.bench.forward import bench_forward
    from fastgrpo.bench.guarantee import bench_guarantee
    from fastgrpo.bench.learning import bench_learning
    from fastgrpo.bench.noise import bench_noise
    from fastgrpo.bench.trainer import bench_trainer
    from fastgrpo.bench.rollout import bench_rollout
    from fastgrpo.bench.shapes import bench_shapes
    from fastgrpo.bench.sglang_tiers import bench_sglang_tiers
    from fastgrpo.bench.simulate import bench_simulate

    modes = args.modes.split(",") if args.modes else None
    benches = {"rollout": bench_rollout, "e2e": bench_e2e, "forward": bench_forward, "shapes": bench_shapes,
               "draft": lambda cfg, quick, output, extra: bench_draft(cfg, quick, output, args.policy, extra=extra),
               "learning": lambda cfg, quick, output, extra: bench_learning(cfg, quick, output, args.seeds,
                                                                            args.steps, args.every, modes, extra=extra),
               "noise": lambda cfg, quick, output, extra: bench_noise(cfg, quick, output, args.batches, extra=extra),
               "trainer": bench_trainer, "engines": bench_engines,
               "simulate": lambda cfg, quick, output, extra: bench_simulate(cfg, quick, output, extra, args.repetitions),
               "sglang-tiers": bench_sglang_tiers,
               "guarantee": lambda cfg, quick, output, extra: bench_guarantee(cfg, quick, output, args.runs,
                                                                              args.threads, extra=extra)}
    if args.what not in benches:
        raise ValueError(f"unknown benchmark {args.what!r}; available: {', '.join(benches)}")
    if args.policy and args.what != "draft":
        raise ValueError(f"--policy is for `bench draft`, not `bench {args.what}`")
    for flag, owner in (("seeds", "learning"), ("steps", "learning"), ("every", "learning"), ("modes", "learning"),
                        ("batches", "noise"), ("runs", "guarantee"), ("threads", "guarantee"),
                        ("repetitions", "simulate")):
        if getattr(args, flag) is not None and args.what != owner:
            raise ValueError(f"--{flag} is for `bench {owner}`, not `bench {args.what}`")
        if flag not in ("modes", "threads") and getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    cfg = _config(args)
    if args.what != "sglang-tiers":  # simulated only: no policy runs
        ensure_policy_and_draft(cfg, draft=args.what != "engines")
    extra = [*(["--config", args.config] if args.config else []), *args.overrides,
             *(["--policy", args.policy] if args.policy else [])]
    benches[args.what](cfg, args.quick, Path(args.output or f"bench/{args.what}.json"), extra=extra)


def cmd_eval(args: argparse.Namespace) -> None:
    from fastgrpo.engines import build_engine
    from fastgrpo.grpo.evaluate import evaluate
    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.families import check_checkpoint
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.tasks.rewards import load_reward
    from fastgrpo.tasks.source import encode_problems, load_task
    from fastgrpo.types import SamplingParams

    cfg = _config(args)
    reward = load_reward(cfg.task)  # a reward that cannot be imported fails before any work
    path = Path(args.checkpoint) if args.checkpoint else Path(cfg.model.path)
    policy_dir = path / "policy" if (path / "policy" / "config.json").is_file() else path
    check_checkpoint(policy_dir)
    policy, text = load_policy(policy_dir), load_text_format(policy_dir, cfg.task)
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="off")
    _, evals = load_task(cfg.task, cfg.eval.split)
    result = evaluate(engine, text, encode_problems(evals, text, cfg.model.max_context, "eval"),
                      cfg.eval.samples, SamplingParams.of(cfg.rollout), reward, seed=cfg.seed)
    sampling = {k: getattr(cfg.rollout, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens")}
    print(json.dumps({"checkpoint": str(policy_dir), "split": cfg.eval.split, "problems": len(evals),
                      "sampling": sampling} | result, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastgrpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help: str, before: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        if before:  # a positional that must come before the overrides
            p.add_argument(before)
        p.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG} if present)")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.steps=4")
        p.set_defaults(fn=fn)
        return p

    add("train", cmd_train, "GRPO training").add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
    add("sft", cmd_sft, "build the tokenizer and warm-start the policy on worked solutions").add_argument(
        "--if-missing", action="store_true", help="do nothing if model.path already holds a policy")
    add("draft-pretrain", cmd_draft_pretrain, "warm-start the draft on the policy's states over the SFT corpus"
        ).add_argument("--if-missing", action="store_true", help="do nothing if the draft already exists")
    add("eval", cmd_eval, "accuracy of a checkpoint on the eval split").add_argument(
        "--checkpoint", help="checkpoint or HF policy directory (default: model.path)")

    plan = add("plan", cmd_plan, "check a layout before launching it: divisibility, the rank map, per-GPU memory")
    plan.add_argument("--nodes", type=int, help="default: cluster.nodes")
    plan.add_argument("--gpus-per-node", type=int, help="default: cluster.gpus_per_node")
    plan.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (default: cluster.gpu_memory_gb)")

    bench = add("bench", cmd_bench, "benchmarks: `rollout` (speculation modes compared in one process), "
                "`e2e` (the same GRPO run without speculation, with a frozen draft, with online draft learning) "
                "`forward` (the policy forward by batch, tokens per sequence and matmul kernel) "
                "`shapes` (draft and target costs for deeper, narrower policies of the same size) "
                "`draft` (how well drafts fit a policy, on its own samples, with fixed trees) "
                "`learning` (held-out accuracy curves of GRPO over seeds, with and without speculation) "
                "`noise` (how much of one GRPO update is signal: the gradient noise scale) "
                "`trainer` (one GRPO step of the torch and Megatron trainers at world 1, 2 and 4) "
                "`engines` (a GRPO batch's rollout in a world of two ranks on one engine or two) "
                "`guarantee` (aware against plain decoding, paired, over runs and thread counts) "
                "`simulate` (rollout at GPU scale, simulated, validated against this CPU's engine) "
                "`sglang-tiers` (aware on SGLang's adaptive EAGLE against SGLang's own speculation, simulated) "
                "or `gpu-check` (the GPU path in one run: SFT and draft of a ~308M policy, Megatron against torch, "
                "the weight push, the decode step against its bandwidth bound, rollout; --output is its directory, "
                "--quick its toy size, device=cpu runs it without a GPU)",
                before="what")
    bench.add_argument("--quick", action="store_true", help="smaller workloads (minutes, not tens of minutes)")
    bench.add_argument("--output", help="JSON results, default bench/<what>.json (a PNG plot is written beside it)")
    bench.add_argument("--policy", help="bench draft: the policy to fit, e.g. a checkpoint's policy/ (default: "
                       "model.path); a checkpoint's own online draft is scored too")
    bench.add_argument("--seeds", type=int, help="bench learning: run seeds 0..N-1 (default 3; 2 with --quick)")
    bench.add_argument("--steps", type=int, help="bench learning: GRPO steps per run (default grpo.steps)")
    bench.add_argument("--every", type=int, help="bench learning: eval every N steps (default steps // 3)")
    bench.add_argument("--modes", help="bench learning: speculation policies to run, comma-separated "
                       "(default: the config's own and off)")
    bench.add_argument("--batches", type=int, help="bench noise: independent rollout batches (default 8; 3 with --quick)")
    bench.add_argument("--runs", type=int, help="bench guarantee: runs per thread count (default 5; 2 with --quick)")
    bench.add_argument("--threads", type=_thread_counts, help="bench guarantee: torch thread counts, comma-separated "
                       "(default 1,2)")
    bench.add_argument("--repetitions", type=int, help="bench simulate: the validation's repetitions R (default 3): "
                       "a fixed-concurrency workload of B sequences runs max(2R, 16R/B) times, the GRPO batch 2R, "
                       "and the profile's passes amid them scale with R")

    # key=value overrides may come anywhere on the line, also after options (argparse alone would
    # take them only right after the command's positionals)
    args, rest = parser.parse_known_args(argv)
    stray = [r for r in rest if r.startswith("-") or "=" not in r]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        status = args.fn(args)
    except ConfigError as e:
        print(f"fastgrpo: config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"fastgrpo: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from fastgrpo.distributed import is_peer_failure

        if not is_peer_failure(e):
            raise
        # another rank failed and prints its own error; this one only says why it stops
        print(f"fastgrpo: rank {os.environ.get('RANK', '0')}: stopping, the world failed "
              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})", file=sys.stderr)
        return 1
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
