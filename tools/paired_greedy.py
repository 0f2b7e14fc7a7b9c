"""Greedy pass@1 of a starting policy and of later policies on the same held-out problems, paired.

The change a run makes to greedy pass@1 is better measured on the same problems than from two
separate accuracies: per problem it is +1, 0 or -1, and its standard error over problems is the
paired one (most problems do not change), several times smaller than either accuracy's.

    python tools/paired_greedy.py --config configs/tiny_cpu.yaml --output bench/learning-demo-greedy.json \\
        RUN_DIR/checkpoints/step_00000030/policy ...

The start is the config's `model.path`; decoding is greedy, without speculation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path


def paired(config: str | None, policies: list[str], overrides: list[str]) -> dict:
    """The start (`model.path` of `config` with `overrides`) and each of `policies`, greedy on the same
    held-out problems: each policy's accuracy, its change from the start with the paired standard
    error, and how many problems it gained and lost."""
    from fastgrpo.config import load_config
    from fastgrpo.engines import build_engine
    from fastgrpo.grpo.evaluate import greedy, scores
    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.tasks.rewards import load_reward
    from fastgrpo.tasks.source import encode_problems, load_task
    from fastgrpo.types import SamplingParams

    cfg = load_config(config, ["speculation.policy=off", "draft.online=off", *overrides])
    text = load_text_format(cfg.model.path, cfg.task)
    _, evals = load_task(cfg.task, cfg.eval.split)
    problems = encode_problems(evals, text, cfg.model.max_context, "eval")

    def correct(path: str) -> list[float]:
        policy = load_policy(path)
        engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="off")
        return [r[0] for r in scores(engine, text, problems, greedy(SamplingParams.of(cfg.rollout)),
                                     reward=load_reward(cfg.task))]

    start = correct(cfg.model.path)
    n = len(start)
    result = {"date": datetime.date.today().isoformat(), "config": config, "overrides": overrides,
              "start_policy": cfg.model.path, "problems": n, "eval_split": cfg.eval.split,
              "start": sum(start) / n, "policies": []}
    for path in policies:
        diff = [b - a for a, b in zip(start, correct(path))]
        mean = sum(diff) / n
        se = math.sqrt(sum((d - mean) ** 2 for d in diff) / (n - 1) / n)
        row = {"policy": path, "end": result["start"] + mean, "change": mean, "change_se": se,
               "gained": sum(d > 0 for d in diff), "lost": sum(d < 0 for d in diff)}
        result["policies"].append(row)
        print(f"{path}: greedy pass@1 {result['start']:.3f} -> {row['end']:.3f}, change {mean:+.3f} ± {se:.3f} "
              f"(paired; {row['gained']} problems gained, {row['lost']} lost)", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--output", help="JSON results")
    p.add_argument("policies", nargs="+", help="later policies (Hugging Face directories)")
    p.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    args = p.parse_args()
    result = paired(args.config, args.policies, args.set)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
