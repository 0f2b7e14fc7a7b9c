"""`fastgrpo bench shapes`: what a speculative step costs for policies of the same size but different depth.

A draft is one decoder layer, so its cost next to the target's falls as the target gets deeper; but on
a CPU every layer also carries a fixed cost (kernel launches, norms, RoPE, cache writes), so a deeper
target of the same parameter count is slower per token. This measures both, with random weights (the
timing does not depend on them), through the same calibration `aware` uses.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path

import torch
from transformers import LlamaConfig

from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config
from fastgrpo.engines.embedded.model import InferenceModel
from fastgrpo.models.policy import load_policy, new_policy, num_parameters
from fastgrpo.engines.embedded.calibrate import calibrate
from fastgrpo.models.draft import DraftHead

DEPTHS = (1, 2, 3, 4)  # multiples of the configured policy's layer count
TREE = (4, 4, 12)  # the reference tree step: depth, top-k, tokens verified


def same_size_shapes(base: LlamaConfig) -> list[LlamaConfig]:
    """Deeper, narrower variants of `base` with about its parameter count (width scaled by 1/sqrt(depth))."""
    head_dim = base.hidden_size // base.num_attention_heads
    out = []
    for m in DEPTHS:
        heads = max(1, round(base.num_attention_heads / math.sqrt(m)))
        hidden = heads * head_dim
        cfg = LlamaConfig(**{**base.to_dict(), "num_hidden_layers": base.num_hidden_layers * m, "hidden_size": hidden,
                             "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
                             "intermediate_size": base.intermediate_size * hidden // base.hidden_size})
        out.append(cfg)
    return out


def bench_shapes(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None) -> dict:
    base = load_policy(cfg.model.path).config
    d, k, n = TREE
    rows = []
    for shape in same_size_shapes(base):
        policy = new_policy(shape, seed=0)
        model = InferenceModel(shape, 1024)
        model.load(policy.state_dict().items())
        draft = DraftHead(shape)
        draft.bind_target(model.embed, model.lm_head)
        draft.pack()
        costs = calibrate(model, draft, reps=3 if quick else 9, sweep=(1, 4, 8, 16), rounds=1 if quick else 2,
                          further=())
        one = costs.target(1)
        tree_step = costs.draft(4) + (d - 1) * costs.draft(k) + costs.target(n)  # catch-up, levels, verify
        row = {"layers": shape.num_hidden_layers, "hidden": shape.hidden_size, "parameters": num_parameters(policy),
               "target_ms": {t: 1000 * costs.target(t) for t in (1, 4, 8, 16)},
               "draft_ms": {t: 1000 * costs.draft(t) for t in (1, 4)},
               "draft_over_target": costs.draft(1) / one,
               "tree_step_break_even": tree_step / one}
        rows.append(row)
        print(f"{row['layers']:3d} layers x {row['hidden']:4d}: target {row['target_ms'][1]:.1f} ms, draft "
              f"{row['draft_ms'][1]:.2f} ms ({row['draft_over_target']:.3f}x), a d{d}k{k}n{n} step breaks even at "
              f"{row['tree_step_break_even']:.2f} tokens", flush=True)
    result = {"meta": {"date": datetime.date.today().isoformat(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "quick": quick, "tree": list(TREE)},
              "rows": rows}
    publish(result, output, command_line("shapes", quick, output, extra), markdown)
    return result


def markdown(result: dict, command: str) -> str:
    m = result["meta"]
    d, k, n = m["tree"]
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['threads']} CPU threads, torch {m['torch']}; random weights, fp32, batch 1.", "",
             "| layers x width | parameters | target ms, 1 / 4 / 8 / 16 tokens | draft ms, 1 / 4 tokens | draft / target "
             f"| d{d}k{k}n{n} step, in plain steps |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        t, dr = r["target_ms"], r["draft_ms"]
        lines.append(f"| {r['layers']} x {r['hidden']} | {r['parameters'] / 1e6:.1f}M | "
                     + " / ".join(f"{t[x]:.1f}" for x in t) + " | " + " / ".join(f"{dr[x]:.2f}" for x in dr)
                     + f" | {r['draft_over_target']:.3f} | {r['tree_step_break_even']:.2f} |")
    return "\n".join(lines)


# -- `fastgrpo bench shapes`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench shapes`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_shapes(cfg, args.quick, args.output, extra=args.extra)
