"""The gpu check's report: the markdown tables of a run's results (rewritten after every stage, and by
`--report` from a saved gpu_check.json) and the decode step set against `bench simulate`'s roofline."""

from __future__ import annotations

import math
from typing import Any


def finite(x: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}g}"
    return str(x)


def _summary(name: str, d: dict) -> str:
    if name == "environment":
        return (f"{d.get('device_name')}; torch {d.get('torch')} CUDA {d.get('cuda')}; transformers "
                f"{d.get('transformers')}; copy {_f(d.get('copy_bandwidth_gb_s'), 4)} GB/s, spec "
                f"{_f(d.get('peak_bandwidth_gb_s'), 4)} GB/s")
    if name == "sft":
        return (f"{_f(d['parameters'] / 1e6)}M parameters, {d['steps']} of {d['planned_steps']} steps of "
                f"{d['batch_size']} ({_f(d['steps_per_s'])} steps/s), loss {_f(d['train_loss'])}, greedy pass@1 "
                f"{_f(d.get('pass1_greedy'))}, mean accuracy {_f(d.get('mean_accuracy'))}")
    if name == "draft":
        return (f"{d['steps']:.0f} steps ({_f(d['steps_per_s'])}/s), held-out top-1 {_f(d['eval_top1'])}, "
                f"loss {_f(d['eval_loss'])}; online round on {d.get('online_device')}: {_f(d.get('online_steps'))} "
                f"steps in {_f(d.get('online_train_s'))} s, version {d.get('online_version')}")
    if name == "train_step":
        return (f"torch {_f(d['torch_step_s'])} s, megatron {_f(d['megatron_step_s'])} s "
                f"({d.get('megatron_backend')}, {d.get('layer_spec')} layers); loss diff {_f(d['loss_relative_diff'])}, grad norm diff "
                f"{_f(d['grad_norm_relative_diff'])} (relative), log-prob max diff {_f(d['logprob_max_abs_diff'])}"
                + (f"; against fp32 weights, mean log-prob diff torch {_f(d['torch_vs_fp32_logprob_mean_abs_diff'])}, "
                   f"megatron {_f(d['megatron_vs_fp32_logprob_mean_abs_diff'])}"
                   if "torch_vs_fp32_logprob_mean_abs_diff" in d else ""))
    if name == "weight_push":
        return (f"{d['bytes'] / 1e6:.0f} MB in {d['push_s'] * 1000:.1f} ms ({_f(d['push_gb_s'])} GB/s, "
                f"{_f(d['push_vs_memcpy'])}x a device copy); corrupted tensor refused: "
                f"{_f(d['corrupted_push_refused'])}")
    if name == "decode_bound":
        return "; ".join(f"batch {B}: step {_f(r['step_ms'])} ms, {_f(r['step_vs_bound'])}x the bound"
                         for B, r in d["batches"].items())
    if name == "rollout":
        g = d["grpo_batch"]
        skipped = d.get("levels_skipped_for_time")
        return (f"{len(d['levels'])} levels x {len(d['modes'])} modes"
                + (f" (levels {skipped} skipped for time)" if skipped else "")
                + f"; GRPO batch off {_f(g['off_s'])} s, aware {_f(g['aware_s'])} s ({_f(g['off_s'] / g['aware_s'])}x)")
    return ""


def markdown(result: dict) -> str:
    m, stages = result["meta"], result["stages"]
    env = (stages.get("environment") or {}).get("data") or {}
    failed = [n for n, s in stages.items() if s["status"] == "failed"]
    running = [n for n, s in stages.items() if s["status"] == "running"]
    budget = m.get("budget_s")
    lines = [f"# GPU check ({m['size']} size, {m['device']}, {m['dtype']})", "",
             f"Command: `{m['command']}`  ", f"Date {m['date']}; {env.get('device_name', '?')}; torch "
             f"{env.get('torch', '?')}; whole run {m.get('seconds', 0):.0f} s"
             + (f" of a {budget:.0f} s budget" if budget else "")
             + (f"; FAILED: {', '.join(failed)}" if failed else "")
             + (f"; cut short in: {', '.join(running)} (what it had finished is below)" if running else "")
             + ("" if failed or running else "; every stage ok") + ".", "",
             "| stage | status | seconds | planned s | peak GPU memory GB | result |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, s in stages.items():
        if s["status"] == "running":
            text = "cut short; partial results below"
        elif s["status"] == "ok":
            try:
                text = _summary(name, s["data"])
            except Exception as e:  # a summary must not cost the report
                text = f"(summary failed: {type(e).__name__})"
        else:
            text = s["error"].splitlines()[0][:200].replace("|", "/")
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.1f} | {_f(s.get('planned_s'))} | "
                     f"{_f(s.get('peak_memory_gb'))} | {text} |")
    r = (stages.get("rollout") or {}).get("data")
    if r:
        modes = r["modes"]
        lines += ["", f"Rollout at fixed concurrency ({r['tokens_per_sequence']} tokens per sequence, EOS ignored; "
                  f"median of {r['repetitions']} after a warm-up), tokens/s (aware's accepted length):", "",
                  "| running | " + " | ".join(modes) + " | best / off |", "| ---: |" + " ---: |" * (len(modes) + 1)]
        for row in r["sweep"]:
            cells = [f"{row[f'{mode}_tok_s']:.0f}" for mode in modes]
            cells[modes.index("aware")] += f" ({row['aware_accept_len']:.2f})"
            lines.append(f"| {row['concurrency']} | " + " | ".join(cells)
                         + f" | {row['best_vs_off']:.2f}x ({row['best']}) |")
        g = r.get("grpo_batch")
        if g:
            lines += ["", f"GRPO batch ({r['grpo_prompts']} prompts x 8 samples, up to {r['grpo_max_new']} new "
                      "tokens), seconds:", "", "| " + " | ".join(g["all_s"]) + " |", "|" + " ---: |" * len(g["all_s"]),
                      "| " + " | ".join(f"{s:.2f}" for s in g["all_s"].values()) + " |"]
    d = (stages.get("decode_bound") or {}).get("data")
    if d:
        lines += ["", f"Plain decode step against its memory-bandwidth bound ({d['bandwidth_gb_s']:.0f} GB/s, "
                  f"{d['bandwidth_source']}; weights {_f(d['weight_bytes'] / 1e6)} MB {d['dtype']}; CUDA graphs "
                  f"{d['graphs']}). Measured: step, forward, device ops and busy time (profiler), matmuls alone; "
                  f"estimated: bound, launch overhead (ops x {_f(d.get('launch_us'))} us measured per launch).", "",
                  "| batch | step ms | bound ms (est.) | step / bound | forward ms | step - forward ms | device ops "
                  "| device busy ms | launch overhead ms (est.) | matmuls alone ms (graph) | matmul GB/s |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for B, row in d["batches"].items():
            lines.append(f"| {B} | {_f(row['step_ms'])} | {_f(row['bound_ms'])} | {_f(row['step_vs_bound'])}x | "
                         f"{_f(row['forward_ms'])} | {_f(row.get('outside_forward_ms'))} | "
                         f"{_f(row.get('forward_device_ops'))} | "
                         f"{_f(row.get('forward_device_busy_ms'))} | {_f(row.get('launch_overhead_est_ms'))} | "
                         f"{_f(row.get('matmul_chain_graph_ms', row['matmul_chain_ms']))} | {_f(row['matmul_gb_s'])} |")
    sim = against_simulator(result)
    if sim:
        lines += ["", f"Against `bench simulate`'s profile of this GPU ({sim['profile']}, the roofline of "
                  "speculation/roofline.py priced for this policy's shape; estimates, set beside the measured):", "",
                  "| batch | measured step ms (eager) | simulated step ms | measured / simulated | measured matmuls in a "
                  "graph ms | simulated weight-bytes term ms | measured / simulated |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for B, row in sim["batches"].items():
            lines.append(f"| {B} | {_f(row['step_ms'])} | {_f(row['simulated_step_ms'])} | {_f(row['step_ratio'])}x | "
                         f"{_f(row['matmuls_graph_ms'])} | {_f(row['simulated_bytes_ms'])} | {_f(row['bytes_ratio'])}x |")
    t = (stages.get("train_step") or {}).get("data")
    if t:
        lines += ["", f"One GRPO step ({t['sequences']} sequences, {t['minibatches']} minibatches, {t['dtype']}), "
                  "the same batch and weights:", "",
                  "| trainer | first step s | warm step s | loss | grad norm |", "| --- | ---: | ---: | ---: | ---: |"]
        for name in ("torch", "megatron"):
            mm = t[f"{name}_metrics"]
            lines.append(f"| {name} | {_f(t[f'{name}_first_step_s'])} | {_f(t[f'{name}_step_s'])} | "
                         f"{_f(mm['loss'], 6)} | {_f(mm['grad_norm'], 6)} |")
    return "\n".join(lines) + "\n"


def against_simulator(result: dict) -> dict | None:
    """How far `bench simulate`'s roofline for this GPU (by its name) is from the decode step measured
    here, for the same policy shape, batch and context: the whole step (the simulator assumes a
    CUDA-graph engine: its fixed overheads stand for launch costs) and its weight-bytes term alone (the
    weights over `bw_eff` x spec bandwidth) against the forward's matmuls replayed as a CUDA graph. None
    without a measured decode step on a GPU."""
    from fastgrpo.speculation.roofline import ModelShape, Roofline, accelerator_named

    d = (result["stages"].get("decode_bound") or {}).get("data") or {}
    env = (result["stages"].get("environment") or {}).get("data") or {}
    if not d.get("model") or "cuda" not in str(env.get("device", "")):
        return None
    hw = accelerator_named(env.get("device_name", ""))
    m = d["model"]
    shape = ModelShape("policy", m["layers"], m["hidden"], m["intermediate"], m["heads"], m["kv_heads"], m["vocab"])
    roof = Roofline(hw, shape)
    out: dict[str, Any] = {"profile": f"{hw.name}, HBM efficiency {hw.bw_eff}", "batches": {}}
    for B, row in d["batches"].items():
        ctx_sum = int(B) * row["context"]
        simulated = roof.decode_step(int(B), int(row["context"]), ctx_sum)
        params = shape.layers * shape.layer_params + shape.lm_head_params  # the weights the matmuls read
        bytes_s = params * shape.bytes_per_param / (hw.hbm_bytes_s * hw.bw_eff)
        graph_ms = row.get("matmul_chain_graph_ms")
        out["batches"][B] = {"step_ms": row["step_ms"], "simulated_step_ms": 1000 * simulated,
                             "step_ratio": row["step_ms"] / (1000 * simulated), "matmuls_graph_ms": graph_ms,
                             "simulated_bytes_ms": 1000 * bytes_s,
                             "bytes_ratio": None if graph_ms is None else graph_ms / (1000 * bytes_s)}
    return out