"""The `fastgrpo` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from fastgrpo.bench.command import BenchUsageError, add_bench_parsers, unknown_arguments
from fastgrpo.config import Config, ConfigError, load_config
from fastgrpo.paths import draft_dir, has_draft, is_policy, policy_in

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


def _config(args: argparse.Namespace) -> Config:
    path = args.config
    if path is None and Path(DEFAULT_CONFIG).is_file():
        path = DEFAULT_CONFIG
    return load_config(path, args.overrides)


def cmd_train(args: argparse.Namespace) -> None:
    run_train(_config(args), resume=args.resume)


def run_train(cfg: Config, resume: bool = False) -> None:
    """This process's part of a GRPO run, by its role, decided here once: a rank of a torchrun world's
    reserved draft slice serves the engines' draft learning; every other rank (the only one, outside
    torchrun) is a policy rank and runs the loop. Each role runs the pre-flight checks once
    (`run_setup.preflight`: the layout, the device) before any work: the draft rank here, a policy rank
    in `train.train`."""
    from fastgrpo.distributed import is_draft_rank, launched_rank
    from fastgrpo.train import train

    if is_draft_rank(cfg.parallel.draft_ranks):
        serve_draft_rank(cfg)
    train(cfg, resume)
    if cfg.trainer.backend == "deepspeed" and launched_rank() > 0:
        # the same abort at the interpreter's exit hit a ZeRO-3 DP2 policy rank (twice in a row in the
        # suite under load) after its last checkpoint: rank 0 writes what is left, the others leave.
        # DeepSpeed runs only: under Slurm with the other trainers, a rank leaving early held up the
        # job's end by ~45 s (a 2-step job: 85 s -> 181 s), and they never showed the abort
        _leave()


def serve_draft_rank(cfg: Config) -> None:
    """A draft rank's whole life: the pre-flight checks, then the draft slice until the run ends; it
    leaves the process at once (it does not return)."""
    from fastgrpo.distributed import init_world
    from fastgrpo.draft_learning.async_learner import serve_draft_slice
    from fastgrpo.run_setup import preflight

    preflight(cfg)
    serve_draft_slice(cfg, init_world(cfg.parallel.draft_ranks))
    # its receiving threads stay blocked in the store's C++ receive; an interpreter exit that
    # destroys them can abort the rank ("terminate called without an active exception", seen
    # under load): its work is done and saved, so it leaves at once
    _leave()


def _leave() -> None:
    """Exit this rank now, without the interpreter's teardown (its work is done and saved)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_sft(args: argparse.Namespace) -> None:
    from fastgrpo.sft import build_policy

    cfg = _config(args)
    if args.if_missing and is_policy(cfg.model.path):
        print(f"policy already at {cfg.model.path}; skipping SFT")
        return
    build_policy(cfg)


def cmd_draft_pretrain(args: argparse.Namespace) -> None:
    from fastgrpo.draft_learning.pretrain import pretrain_draft

    cfg = _config(args)
    if args.if_missing and has_draft(draft_dir(cfg)):
        print(f"draft already at {draft_dir(cfg)}; skipping")
        return
    pretrain_draft(cfg)


def ensure_policy_and_draft(cfg: Config, draft: bool = True) -> None:
    """Benchmarks and speculative training build what they need: the policy (SFT), then its draft
    (unless `draft` is false: a benchmark without speculation)."""
    from fastgrpo.draft_learning.pretrain import pretrain_draft
    from fastgrpo.sft import build_policy

    if not is_policy(cfg.model.path):
        print(f"no policy at {cfg.model.path}: building it (fastgrpo sft)")
        build_policy(cfg)
    if draft and not has_draft(draft_dir(cfg)):
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


def cmd_bench(args: argparse.Namespace) -> int | None:
    """`fastgrpo bench <name>`: its sub-parser (its module's `add_arguments`) set `run` and `needs`; the
    config, the policy and the draft are built here where the benchmark needs them."""
    if args.needs is None:  # its own config (gpu-check: the policy and draft are two of its timed stages)
        return args.run(args, None)
    cfg = _config(args)
    needs = args.needs_of(args, cfg) if getattr(args, "needs_of", None) else args.needs  # (flags may say less)
    if needs in ("policy", "draft"):
        ensure_policy_and_draft(cfg, draft=needs == "draft")
    args.output = Path(args.output or f"bench/{args.what}.json")
    args.extra = [*(["--config", args.config] if args.config else []), *args.overrides]  # the command line, recorded
    args.run(args, cfg)


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
    policy_dir = policy_in(path)
    check_checkpoint(policy_dir)
    policy, text = load_policy(policy_dir), load_text_format(policy_dir, cfg.task)
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="off")
    _, evals = load_task(cfg.task, cfg.eval.split)
    result = evaluate(engine, text, encode_problems(evals, text, cfg.model.max_context, "eval"),
                      cfg.eval.samples, SamplingParams.of(cfg.rollout), reward, seed=cfg.seed)
    sampling = {k: getattr(cfg.rollout, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens")}
    print(json.dumps({"checkpoint": str(policy_dir), "split": cfg.eval.split, "problems": len(evals),
                      "sampling": sampling} | result, indent=2))


def build_parser() -> argparse.ArgumentParser:
    """The `fastgrpo` command's parser: a sub-command each, `bench` with a sub-parser per benchmark."""
    parser = argparse.ArgumentParser(prog="fastgrpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
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

    bench = sub.add_parser("bench", help="benchmarks (fastgrpo bench --help lists them)",
                           description="Benchmarks, each with its own flags: fastgrpo bench BENCH --help.")
    bench.set_defaults(fn=cmd_bench)
    add_bench_parsers(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come anywhere on the line, also after options (argparse alone would
    # take them only right after the command's positionals)
    try:
        args, rest = parser.parse_known_args(argv)
    except BenchUsageError as e:  # a benchmark's flags refused, by its own parser
        print(f"fastgrpo: error: {e}", file=sys.stderr)
        return 1
    stray = [r for r in rest if r.startswith("-") or "=" not in r]
    if stray and args.fn is cmd_bench:
        print(f"fastgrpo: error: {unknown_arguments(args.what, stray)}", file=sys.stderr)
        return 1
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


def run() -> None:
    """The `fastgrpo` command (and `python -m fastgrpo`, what torchrun starts): `main`, then the end
    of the process through `end_process`, so that a rank whose work is done cannot fail at exit."""
    from fastgrpo.process_exit import end_process

    end_process(main())


if __name__ == "__main__":
    run()
