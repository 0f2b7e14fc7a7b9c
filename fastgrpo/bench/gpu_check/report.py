"""The gpu check's report: the markdown tables of a run's results (rewritten after every stage, and by
`--report` from a saved gpu_check.json) and the decode step set against `bench simulate`'s roofline."""

from __future__ import annotations

import json
import math
from typing import Any

from fastgrpo.bench.gpu_check.targets import targets


def finite(x: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def dumps(x: Any, depth: int = 0) -> str:
    """JSON indented by structure, with every list of plain values on one line: the per-step traces and
    the tables' columns stay one line each (indented one value a line, a run's file would be ~10x longer)."""
    pad = "  " * depth
    if isinstance(x, dict) and x:
        items = [f"{pad}  {json.dumps(str(k))}: {dumps(v, depth + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(x, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in x):
        return "[\n" + ",\n".join(f"{pad}  {dumps(v, depth + 1)}" for v in x) + f"\n{pad}]"
    return json.dumps(list(x) if isinstance(x, tuple) else x)


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return f"{x:.0f}" if abs(x) >= 10**digits else f"{x:.{digits}g}"  # 12345, not 1.23e+04
    return str(x)


def _extensions(compiled: dict[str, bool] | None) -> str:
    """The C parts the run had (none recorded: a run before the environment stage read them)."""
    if compiled is None:
        return ""
    missing = [name for name, built in compiled.items() if not built]
    return "; C extensions " + ("built" if not missing else f"missing ({', '.join(missing)}: Python equivalents ran)")


def _summary(name: str, d: dict) -> str:
    if name == "environment":
        return (f"{d.get('device_name')}; torch {d.get('torch')} CUDA {d.get('cuda')}; transformers "
                f"{d.get('transformers')}; copy {_f(d.get('copy_bandwidth_gb_s'), 4)} GB/s, spec "
                f"{_f(d.get('peak_bandwidth_gb_s'), 4)} GB/s" + _extensions(d.get("compiled_extensions")))
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
    if name == "step_bench":
        best = d.get("best") or {}
        skipped = d.get("levels_skipped_for_time")
        fused = (f"; no fused cells: {d['fused_error'][:80]}" if d.get("fused_error")
                 else f"; fused: {', '.join(d['fused_shapes'])}" if d.get("fused_shapes") else "")
        return (f"{len(d['levels'])} levels x {len(d['shapes'])} shapes, eager and static steps (graphs "
                f"{_f(d['engines']['static']['graphs'])})" + (f", levels {skipped} skipped for time" if skipped else "")
                + "; fastest static shape by level: "
                + ", ".join(f"{B}: {b.get('static')}" for B, b in best.items()) + fused)
    if name == "simulator_fit":
        held = d.get("error_held_out")
        return (f"{d['profile']} fitted to {len(d['points'])} static steps: max |error| "
                f"{_pct(d['error_before']['max_abs_error'])} before, {_pct(d['error_after']['max_abs_error'])} after"
                + (f", {_pct(held['max_abs_error'])} with each level held out" if held else ""))
    if name == "decode_8b":
        if d.get("skipped"):
            return f"skipped: {d['skipped']}"
        fused = (d.get("fused") or {}).get("batches", {})
        return (("" if d.get("full_shape") else "scaled-down shape (test size); ")
                + "; ".join(f"batch {B}: step {_f(r['step_ms'])} ms, {_f(r['step_vs_bound'])}x the bound"
                            + (f" (fused {_f(fused[B]['step_vs_bound'])}x)" if B in fused else "")
                            for B, r in d["batches"].items())
                + (f"; fused kernels failed: {d['fused']['error']}" if (d.get("fused") or {}).get("error") else "")
                + (f"; skipped for time: {_skipped_8b(d['skipped_for_time'])}" if d.get("skipped_for_time") else ""))
    if name == "rollout":
        g = d["grpo_batch"]
        skipped = d.get("levels_skipped_for_time")
        text = (f"{len(d['levels'])} levels x {len(d['modes'])} modes, {d.get('repetitions')} repetitions"
                + (f" (levels {skipped} skipped for time)" if skipped else "")
                + f"; GRPO batch off {_f(g['off_s'])} s, aware {_f(g['aware_s'])} s ({_f(g['off_s'] / g['aware_s'])}x)")
        if "aware_vs_best" in g:
            text += (f", aware / best fixed ({g['best_fixed']}) {_f(g['aware_vs_best'])}x, "
                     f"A/A {_f(g.get('aa_ratio'), 4)}")
        return text
    return ""


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _pm(median: Any, se: Any, digits: int = 3) -> str:
    """A median with its standard error: "123 ± 4"."""
    return _f(median, digits) + ("" if se is None else f" ± {_f(se, 2)}")


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
    lines += ["", "Targets (docs/gpu.md; within noise: below its line by less than twice the ratio's standard error "
              "or the A/A pair's distance from 1):", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    try:
        lines += [f"| {t.target} | {t.measured} | {t.verdict} |" for t in targets(result)]
    except Exception as e:  # (as a summary, it must not cost the report)
        lines.append(f"| (targets failed: {type(e).__name__}: {str(e)[:80]}) | | |")
    lines += _rollout_tables((stages.get("rollout") or {}).get("data"))
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
    lines += _step_tables((stages.get("step_bench") or {}).get("data"))
    lines += _fit_tables((stages.get("simulator_fit") or {}).get("data"))
    lines += _big_tables((stages.get("decode_8b") or {}).get("data"))
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


def _rollout_tables(r: dict | None) -> list[str]:
    """The sweep (median tokens/s ± standard error of each mode, the A/A pair's ratio, aware against the
    best fixed choice and plain decoding), the GRPO batch (median seconds ± standard error) and aware's
    choices in its last timed call of each workload. Rows of a run before repetitions were kept (no
    standard errors) print without them."""
    if not r:
        return []
    modes = r["modes"]
    lines = ["", f"Rollout at fixed concurrency ({r['tokens_per_sequence']} tokens per sequence, EOS ignored; "
             f"median of {r['repetitions']} after a warm-up"
             + (f", up to {r['repetitions'] + r['extra_repetitions']} while aware was within noise of its line"
                if r.get("extra_repetitions") else "")
             + ", in an order rotated every repetition, ± the standard error), tokens/s (aware's accepted length). A/A: the same static tree under a second name, its "
             "speed over the first's (the noise floor); best fixed: the fastest of "
             + ", ".join(r.get("fixed_modes") or ["off", "static", "fastgrpo"]) + ".", "",
             "| running | " + " | ".join(modes) + " | A/A | best fixed | aware / best fixed | aware / off |",
             "| ---: |" + " ---: |" * (len(modes) + 4)]
    for row in r["sweep"]:
        cells = [_pm(row[f"{mode}_tok_s"], row.get(f"{mode}_tok_s_se")) for mode in modes]
        if "aware" in modes:
            cells[modes.index("aware")] += f" ({row['aware_accept_len']:.2f})"
        lines.append(f"| {row['concurrency']} | " + " | ".join(cells) + f" | {_f(row.get('aa_ratio'), 4)} | "
                     f"{row.get('best_fixed', row.get('best'))} | {_f(row.get('aware_vs_best'))}x | "
                     f"{_f(row.get('aware_vs_off', row['aware_tok_s'] / row['off_tok_s']))}x |")
    timed = [row for row in r["sweep"] if "aware_policy_s" in row]
    if timed:
        lines += ["", "aware's own host time a call (its choices and updates, on the steps' path; medians), and "
                  "its share of the call: " + "; ".join(
                      f"{row['concurrency']} running {1e3 * row['aware_policy_s']:.1f} ms "
                      f"({100 * row['aware_policy_share']:.1f}%)" for row in timed) + "."]
    g = r.get("grpo_batch")
    if g:
        se = g.get("se_s") or {}
        lines += ["", f"GRPO batch ({r['grpo_prompts']} prompts x 8 samples, up to {r['grpo_max_new']} new "
                  "tokens), median seconds ± standard error:", "", "| " + " | ".join(g["all_s"]) + " |",
                  "|" + " ---: |" * len(g["all_s"]),
                  "| " + " | ".join(_pm(v, se.get(m)) for m, v in g["all_s"].items()) + " |"]
        if "aware_vs_best" in g:
            lines += ["", f"aware / best fixed ({g['best_fixed']}): {_f(g['aware_vs_best'])}x; aware / off: "
                      f"{_f(g['aware_vs_off'])}x; A/A ({' / '.join(r.get('aa_pair', []))}): {_f(g.get('aa_ratio'), 4)}"
                      + (f"; aware's own host time {1e3 * g['aware_policy_s']:.1f} ms a call "
                         f"({100 * g['aware_policy_share']:.1f}%)" if "aware_policy_s" in g else "") + "."]
        if pad := g.get("padding"):
            lines += ["", "Steps run static (graph replays on a GPU), and what padding costs the target's forwards "
                      "(medians over the calls): " + "; ".join(
                          f"{m} {_pct(p['static_share'])} static, {_pct(p['pad_row_share'])} of token slots in padded "
                          f"rows, {_pct(p['pad_kv_share'])} of cache positions read beyond each row's own"
                          for m, p in pad.items() if m in ("off", "aware")) + "."]
    calls = r.get("calls") or []
    timed = [c for c in calls if c["rep"] > 0]
    if timed and "captures" in timed[0]:  # a capture inside a timed call adds its eager warm-up to that call
        late = [c for c in timed if c["captures"]]
        engine = r.get("engine") or {}
        what = ("CUDA graphs captured" if engine.get("graphs") or engine.get("replays_checked") is None else
                "CUDA graphs a GPU would capture (each step key's first call, counted by the replay check here)")
        lines += ["", f"{what}: {sum(c['captures'] for c in calls)} in all, "
                  f"{sum(c['captures'] for c in timed)} of them inside {len(late)} of the {len(timed)} timed calls"
                  + (" (" + ", ".join(sorted({f"{c['workload']} {c['mode']}" for c in late})) + ")" if late else "")
                  + f"; the timed calls' seconds leave out their steps that captured ({_f(sum(c.get('capture_s', 0) for c in timed))} s"
                  " in all: each an eager run of the step and its recording, paid once per key in an engine's life)."]
    last: dict[str, dict] = {}
    for call in calls:
        if call["mode"] == "aware" and call["rep"] > 0:
            last[call["workload"]] = call
    if last:
        lines += ["", "aware's step shapes in its last timed call of each workload (steps, by running sequences):",
                  "", "| workload | shapes |", "| --- | --- |"]
        for workload, call in last.items():
            shapes = "; ".join(f"{bucket}: " + ", ".join(f"{c} {n}" for c, n in counts.items())
                               for bucket, counts in (call.get("configs") or {}).items())
            lines.append(f"| {workload} | {shapes} |")
    return lines


def _step_tables(d: dict | None) -> list[str]:
    """step_bench: each level and shape, eager against static steps (median ms ± standard error)."""
    if not d or not d.get("cells"):
        return []
    graphs = d["engines"]["static"]["graphs"]
    lines = ["", f"Decode steps alone ({d['tokens_per_sequence']} tokens a row a call, {d['repetitions']} calls in "
             f"rotated order, the first {d['warmup_steps']} steps of each left out; median of the calls' median "
             f"steps ± standard error). Static: fixed shapes, {'replayed from CUDA graphs' if graphs else 'run eagerly (no graphs here)'}; "
             "tokens/s: what steps like these emit (rows x tokens a row-step / step).", "",
             "| running | shape | eager ms | static ms | eager / static | fused ms | static / fused "
             "| tokens a row-step (static) | static tokens/s | graphs captured / replayed "
             "| hybrid ms (tokens a row-step; host ms a step, of it hidden) | hybrid tokens/s |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = {(r["level"], r["shape"], r["engine"]): r for r in d["cells"]}
    for B in d["levels"]:
        for shape in d["shapes"]:
            e, s, f = by.get((B, shape, "eager")), by.get((B, shape, "static")), by.get((B, shape, "fused"))
            h = by.get((B, shape, "hybrid"))
            if not e or not s:
                continue
            em, sm = e["step_ms"], s["step_ms"]
            fm = f["step_ms"] if f else {"median": None, "se": None}
            hybrid = (f"{_pm(h['step_ms']['median'], h['step_ms']['se'])} ({_f(h.get('tokens_per_row_step'))}; "
                      f"{_f(h.get('host_ms'))}, {_f(h.get('host_hidden_ms'))}) | {_f(h.get('tok_s'))}" if h else "- | -")
            lines.append(f"| {B} | {shape} | {_pm(em['median'], em['se'])} | {_pm(sm['median'], sm['se'])} | "
                         f"{_f(_ratio(em['median'], sm['median']))}x | {_pm(fm['median'], fm['se']) if f else '-'} | "
                         f"{_f(_ratio(sm['median'], fm['median'])) + 'x' if f else '-'} | "
                         f"{_f(s.get('tokens_per_row_step'))} | {_f(s.get('tok_s'))} | "
                         f"{s.get('captures', 0)} / {s.get('replays', 0)} | {hybrid} |")
    kernels = d.get("step_kernels") or {}
    if kernels.get("error"):
        lines += ["", f"Kernels a step: not counted ({kernels['error']})."]
    elif kernels:
        lines += ["", "Kernels one step launches at 1 row (" + ("device operations a graph replay runs, by the profiler"
                  if graphs else "kernel-launching ops, by the profiler on this CPU") + "): "
                  + "; ".join(f"{e}: " + ", ".join(f"{s} {_f(n)}" for s, n in by.items()) for e, by in kernels.items())
                  + "."]
    if d.get("fused_error"):
        lines += ["", f"Fused: no fused cells ({d['fused_error']})."]
    elif d.get("fused_first_calls_s"):
        lines += ["", "Fused: the static engine with its pointwise regions compiled (engine.fused); its first calls "
                  f"(compiles, at 1 and 2 rows: {', '.join(d.get('fused_shapes', []))}) took "
                  + ", ".join(f"{x:.3g}" for x in d["fused_first_calls_s"]) + " s."]
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fit_tables(d: dict | None) -> list[str]:
    """simulator_fit: the constants before and after, the errors, each step priced before and after."""
    if not d:
        return []
    b, a = d["before"], d["after"]
    lines = ["", f"`bench simulate`'s GPU price ({d['profile']} roofline) fitted to the static steps above "
             "(fit.py: the roofline's scale and its overheads)" + (f"; {d['note']}" if d.get("note") else "") + ":",
             "", "| constant | before | after |", "| --- | ---: | ---: |"]
    for k in b:
        scale = 1000 if k.endswith("_s") else 1
        lines.append(f"| {k.removesuffix('_s') + (' ms' if scale > 1 else '')} | {_f(b[k] * scale)} | {_f(a[k] * scale)} |")
    held = d.get("error_held_out") or {}
    lines += ["", "| error (simulated / measured - 1) | before | after | each level held out |",
              "| --- | ---: | ---: | ---: |",
              f"| max abs | {_pct(d['error_before']['max_abs_error'])} | {_pct(d['error_after']['max_abs_error'])} | "
              f"{_pct(held.get('max_abs_error'))} |",
              f"| median abs | {_pct(d['error_before']['median_abs_error'])} | "
              f"{_pct(d['error_after']['median_abs_error'])} | {_pct(held.get('median_abs_error'))} |",
              "", "| running | shape | measured ms | simulated before ms | after ms | held out error |",
              "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for p in d["points"]:
        lines.append(f"| {p['level']} | {p['shape']} | {_f(p['measured_ms'])} | {_f(p['before_ms'])} | "
                     f"{_f(p['after_ms'])} | {_pct(p.get('error_held_out'))} |")
    return lines


def _big_tables(d: dict | None) -> list[str]:
    """decode_8b: the 8B shape's static step against its bandwidth bound, or why it did not run."""
    if not d:
        return []
    if d.get("skipped"):
        return ["", f"Llama-3.1-8B shape ({d['config']}): skipped, {d['skipped']}."]
    m = d["model"]
    lines = ["", f"{'Llama-3.1-8B shape' if d.get('full_shape') else 'A scaled-down Llama-3.1-8B structure'} "
             f"({d['config']}: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} / {m['kv_heads']} heads, "
             f"vocab {m['vocab']}; {_f(d['parameters'] / 1e9)}B parameters, random weights, {d['dtype']}), plain decode "
             f"steps of the static engine (graphs {_f(d['engine']['graphs'])}) against the memory-bandwidth bound "
             f"({d['bandwidth_gb_s']:.0f} GB/s, {d['bandwidth_source']}; weights {_f(d['weight_bytes'] / 1e9)} GB):", "",
             "| batch | step ms | bound ms | step / bound | bound at the padded context ms | tokens/s "
             "| graphs captured / replayed | fused: step ms | fused: step / bound | first call s (fused) "
             "| device ops a forward (fused) | device busy ms (fused) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fused = d.get("fused") or {}
    for B in sorted(d["batches"].keys() | fused.get("batches", {}).keys(), key=int):
        row, f = d["batches"].get(B, {}), fused.get("batches", {}).get(B, {})
        lines.append(f"| {B} | {_f(row.get('step_ms'))} | {_f(row.get('bound_ms', f.get('bound_ms')))} | "
                     f"{_f(row.get('step_vs_bound'))}{'x' if row else ''} | "
                     f"{_f(row.get('bound_padded_ms', f.get('bound_padded_ms')))} | {_f(row.get('tok_s'))} | "
                     f"{row.get('captures', '-')} / {row.get('replays', '-')} | "
                     f"{_f(f.get('step_ms'))} | {_f(f.get('step_vs_bound'))}{'x' if f else ''} | "
                     f"{_f(row.get('first_call_s'))} ({_f(f.get('first_call_s'))}) | "
                     f"{_f(row.get('forward_device_ops'))} ({_f(f.get('forward_device_ops'))}) | "
                     f"{_f(row.get('forward_device_busy_ms'))} ({_f(f.get('forward_device_busy_ms'))}) |")
    lines += ["", "Fused: the layers' pointwise regions compiled into one kernel each (engine.fused, models/fused.py); "
              "a first call captures its graphs, and fused, compiles the regions."]
    if fused.get("error"):
        lines += ["", f"The fused kernels failed: {fused['error']}"]
    if d.get("skipped_for_time"):
        lines += ["", f"Skipped for time (the stages after this one kept their plans): {_skipped_8b(d['skipped_for_time'])}."]
    return lines


def _skipped_8b(skipped: list[dict]) -> str:
    return ", ".join(f"batch {s['batch']}{' fused' if s['fused'] else ' op by op'}" for s in skipped)


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