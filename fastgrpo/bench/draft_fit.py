"""`fastgrpo bench draft`: how well drafts fit a policy, scored on that policy's own samples.

Rollout's accepted length mixes draft quality with the trees the aware policy picked (small ones at
16 running sequences, deep ones at 1), so two GRPO runs' `accept_len` can differ because their
choices did. Here every draft drafts the same fixed trees for the same prompts and seeds against the
same policy: held-out loss and top-1 on the policy's captured states, and accepted length at 16
running sequences. A last row scores the first draft after some online steps on more of this
policy's samples (at `draft.online_lr`): what online learning could gain here.
"""

from __future__ import annotations

import copy
import datetime
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.engines.embedded.build import build_engine
from fastgrpo.types import SamplingParams, Request
from fastgrpo.bench.report import command_line, publish
from fastgrpo.bench.rollout import timed_generate
from fastgrpo.config import Config
from fastgrpo.draft_learning.online import OnlineDraftLearner, training_rows
from fastgrpo.draft_learning.trainer import evaluate_draft
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.models.draft import DraftHead
from fastgrpo import paths
from fastgrpo.paths import draft_dir
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.tasks.source import held_out_prompt_ids

TREES = (SpecConfig(4, 4, 12), SpecConfig(2, 2, 4))
RUNNING = 16  # sequences decoded together when measuring acceptance: the tail where speculation runs
DEEP = 4  # held-out top-1 is also scored fed the draft's own predictions, as a depth-4 node is


def checkpoint_draft(policy_dir: Path) -> Path | None:
    """A training checkpoint keeps its online draft beside the policy (`<step>/policy`, `<step>/draft`)."""
    d = paths.checkpoint_draft(policy_dir.parent)
    return d if paths.has_draft(d) else None


def fit_drafts(cfg: Config, policy_dir: Path, drafts: dict[str, Path], quick: bool, adapt_steps: int = 0) -> dict:
    """Score each draft against the policy in `policy_dir`; with `adapt_steps`, also the first draft
    after that many online steps on two more rollouts of the policy."""
    policy, text = load_policy(policy_dir), load_text_format(policy_dir, cfg.task)
    policy.eval()
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="static")
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    group, n_prompts, seeds = (4, 8, 1) if quick else (cfg.rollout.group_size, 16, 3)
    if len(prompts) < 3 * n_prompts + RUNNING:
        raise ValueError(f"bench draft needs {3 * n_prompts + RUNNING} eval prompts; "
                         f"task.eval_size gives {len(prompts)}")
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=cfg.rollout.max_new_tokens)

    def rollout(first: int, seed: int) -> list:
        """The policy's own samples with their captured target states (the rows online learning sees)."""
        ps = [p for p in prompts[first: first + n_prompts] for _ in range(group)]
        engine.set_speculation(Static(TREES[0]))
        out = engine.generate([Request(p) for p in ps], sampling, seed=seed, capture=True)
        return training_rows(ps, out)

    held_out = rollout(0, seed=1)
    accept_requests = [Request(p) for p in prompts[3 * n_prompts: 3 * n_prompts + RUNNING]]

    def score(draft: DraftHead) -> dict[str, float]:
        fit = evaluate_draft(draft, held_out)
        row = {"heldout_loss": fit["draft_loss"], "heldout_top1": fit["draft_top1"],
               f"heldout_top1_{DEEP}": evaluate_draft(draft, held_out, unroll=DEEP)[f"draft_top1_{DEEP}"]}
        engine.update_draft(draft.state_dict().items(), version=1)
        for tree in TREES:
            engine.set_speculation(Static(tree))
            row[f"accept_{tree.name}"] = statistics.mean(
                timed_generate(engine, accept_requests, sampling, seed=100 + seed)["accept_len"]
                for seed in range(seeds))
        return row

    loaded = {}
    for name, path in drafts.items():
        loaded[name] = DraftHead.load(path, policy.config, cfg.model.max_context)
        loaded[name].bind_target(policy.model.embed_tokens.weight, policy.lm_head.weight)
    result: dict = {"policy": str(policy_dir), "drafts": {name: str(p) for name, p in drafts.items()},
                    "heldout_sequences": len(held_out), "heldout_tokens": sum(t.shape[0] for _, t, _ in held_out),
                    "running": RUNNING, "seeds": seeds, "scores": {name: score(d) for name, d in loaded.items()}}
    if adapt_steps:
        first = next(iter(loaded))
        learner = OnlineDraftLearner(copy.deepcopy(loaded[first]), cfg.draft, engines=[], seed=cfg.seed)
        learner.buffer(rollout(n_prompts, seed=2) + rollout(2 * n_prompts, seed=3), policy_version=0)
        learner.trainer.train(adapt_steps)
        result["adapted_from"], result["adapt_steps"] = first, adapt_steps
        result["scores"][f"{first} + {adapt_steps} online steps"] = score(learner.draft)
    return result


def bench_draft(cfg: Config, quick: bool, output: Path, policy_dir: str | None = None,
                extra: list[str] | None = None, others: dict[str, Path] | None = None) -> dict:
    """Score the warm-start draft (and a checkpoint's own online draft, if `policy_dir` is a
    checkpoint's policy, and `others`: named draft directories) on the policy's samples, plus the warm
    start after online steps."""
    policy_path = Path(policy_dir or cfg.model.path)
    drafts = {"warm start": draft_dir(cfg)}
    if (own := checkpoint_draft(policy_path)) is not None:
        drafts["checkpoint's online draft"] = own
    for name, path in (others or {}).items():
        if name in drafts:
            raise ValueError(f"--draft {name}=...: the name {name!r} is taken (a draft the benchmark scores anyway)")
        if not paths.has_draft(Path(path)):
            raise FileNotFoundError(f"--draft {name}={path}: no draft there (`fastgrpo draft-pretrain draft.path=...` makes one)")
        drafts[name] = Path(path)
    t0 = time.perf_counter()
    result = fit_drafts(cfg, policy_path, drafts, quick, adapt_steps=10 if quick else 60)
    result["meta"] = {"date": datetime.date.today().isoformat(), "quick": quick, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "temperature": cfg.rollout.temperature,
                      "seconds": time.perf_counter() - t0}
    publish(result, output, command_line("draft", quick, output, extra), markdown)
    return result


def markdown(result: dict, command: str) -> str:
    m = result.get("meta", {})
    trees = [k.removeprefix("accept_") for k in next(iter(result["scores"].values())) if k.startswith("accept_")]
    lines = [f"Command: `{command}`", ""] if command else []
    if m:
        lines += [f"Date {m['date']}; {m['threads']} CPU threads, torch {m['torch']}; "
                  f"temperature {m['temperature']}.", ""]
    lines += [f"Policy `{result['policy']}`; held out: {result['heldout_sequences']} of its own samples "
              f"({result['heldout_tokens']} tokens); accepted length at {result['running']} running sequences, "
              f"fixed trees, mean over {result['seeds']} seed(s).", "",
              f"| draft | held-out loss | held-out top-1 | held-out top-1 at depth {DEEP} | "
              + " | ".join(f"accept len {t}" for t in trees) + " |",
              "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in trees) + " |"]
    for name, s in result["scores"].items():
        deep = s.get(f"heldout_top1_{DEEP}")
        lines.append(f"| {name} | {s['heldout_loss']:.4f} | {s['heldout_top1']:.3f} | "
                     + (f"{deep:.3f}" if deep is not None else "-") + " | "
                     + " | ".join(f"{s[f'accept_{t}']:.2f}" for t in trees) + " |")
    return "\n".join(lines)


# -- `fastgrpo bench draft`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench draft`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.add_argument("--policy", help="the policy to fit, e.g. a checkpoint's policy/ (default: model.path); a "
                        "checkpoint's own online draft is scored too")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=PATH",
                        help="another draft directory to score beside the warm start, under NAME (repeatable)")
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    others = {}
    for item in args.draft:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"bench draft: --draft takes NAME=PATH, got {item!r}")
        others[name] = Path(path)
    return bench_draft(cfg, args.quick, args.output, args.policy, others=others,
                       extra=[*args.extra, *(["--policy", args.policy] if args.policy else []),
                              *(f"--draft {d}" for d in args.draft)])
