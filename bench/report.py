#!/usr/bin/env python3
"""Turns Google Benchmark JSON from bench/ampfuse_bench into the ratio tables
of bench/RESULTS.md and a PNG plot.

Benchmark names are <operation>/<contender>/<parameter set>[@cuda]. "ours" is
ampfuse; contenders whose name starts with "ceiling" are traffic twins, the
device-to-device copy or (Host) the object ceilings of bench/bench_host.cpp,
and are compared by bandwidth (bytes the operation must move per second, the
same for ours and the ceiling: a ratio of times); all others by time.

usage: report.py RESULTS_JSON [--md bench/RESULTS.md] [--png bench/results.png]
       [--title TEXT] [--readme README.md] [--gpu bench/gpu/h200.json]

--gpu adds the CUDA results of the last scripts/gpu-check.sh run (committed
under bench/gpu/, since this machine has no GPU) as a second part of the
Markdown and of the README's block, with their own set-up line and targets.
"""
import argparse
import collections
import datetime
import json
import sys

# (operation, parameter set, contender, minimum ratio, what the ratio is)
TARGETS = [
    ("Check", "1x64M", "ceiling_read", 0.85, "of the read-only ceiling"),
    ("Check", "10000x4096", "aten_isfinite_all", 3.0, "the speed of at::isfinite(t).all() per tensor"),
    ("Adam", "8x8M", "ceiling_twin", 0.90, "of the traffic twin"),
    ("Adam", "8x8M", "torch_optim_adam", 4.0, "the speed of torch::optim::Adam"),
    ("Adam", "10000x4096", "torch_optim_adam", 8.0, "the speed of torch::optim::Adam"),
    ("Adam", "8x8M", "aten_fused_adam", 1.0, "the speed of at::_fused_adam_"),
    ("Adam", "10000x4096", "aten_fused_adam", 1.5, "the speed of at::_fused_adam_"),
    # Where both sides run at the memory's bandwidth (8x8M on CPU), bytes per fp32 parameter bound
    # these two: ours moves 32 (check 4, step 28), PyTorch's scaled step 36 (its check writes the
    # grads back), its unscale + clip + step 48 (unscale 8, norm 4, clip 8, step 28): 1.125x and
    # 1.5x. A ratio above that comes from PyTorch's ops running below the bandwidth.
    ("AdamScaled", "8x8M", "aten_fused_adam", 1.25, "the speed of PyTorch's scaled fused step"),
    ("AdamClip", "8x8M", "aten_fused_adam", 1.5, "the speed of PyTorch's unscale + clip + fused step"),
    ("Adam8", "8x8M", "fused_adam_32bit", 1.3, "the speed of 32-bit FusedAdam (8-bit moments)"),
    ("Adam8", "8x8M", "ceiling_twin", 0.85, "of 8-bit Adam's traffic twin"),
    ("Adam8", "8x8M@cuda", "ceiling_d2d_copy", 0.85, "of the device-to-device copy of 8-bit Adam's bytes"),
    ("Adam", "1B@cuda", "ceiling_d2d_copy", 0.85, "of the device-to-device copy ceiling"),
    ("SGD", "8x8M", "ceiling_twin", 0.90, "of the traffic twin"),
    ("SGD", "10000x4096", "torch_optim_sgd", 3.0, "the speed of torch::optim::SGD"),
    ("LAMB", "8x8M", "ceiling_twin", 0.75, "of LAMB's minimum traffic (two-pass twin)"),
    ("Adagrad", "8x8M", "ceiling_twin", 0.90, "of the traffic twin"),
    ("Adagrad", "8x8M", "aten_fused_adagrad", 1.0, "the speed of at::_fused_adagrad_"),
    ("RMSprop", "8x8M", "ceiling_twin", 0.90, "of the traffic twin"),
    ("AdamSubnormal", "8x8M", "ours_normal", 0.77, "the speed of the same step on normal data (at most 1.3x its time)"),
    ("AdamScaledTiny", "8x8M", "ours_normal", 0.77,
     "the speed of the same scaled step on normal grads (at most 1.3x its time)"),
    # fp64 against the bandwidth: its twin moves the same bytes (the fp64
    # arrays read as floats). Against torch::optim no ratio follows from the
    # bytes: its ATen passes run over one 8 MB tensor at a time, and much of
    # what a pass reads is still in the last-level cache from the pass before
    # (for SGD all of it: p, g and the buffer, 24 MB; this VM reports a 300 MB L3), so its traffic to memory
    # comes near the fused step's. Those rows are reported without a target
    # (SGD measured 1.06-1.27x, Adam 2.6-3.3x, on three days).
    ("AdamF64", "8x1M", "ceiling_twin", 0.90, "of the traffic twin (fp64 params)"),
    ("AdamF64", "8x1M", "aten_fused_adam", 1.0, "the speed of at::_fused_adam_ on fp64 params"),
    ("SGDF64", "8x1M", "ceiling_twin", 0.90, "of the traffic twin (fp64 params)"),
    # Issue 14's targets for the optimizers it added.
    ("Adagrad", "8x8M", "torch_optim_adagrad", 3.0, "the speed of torch::optim::Adagrad"),
    ("Adagrad", "10000x4096", "torch_optim_adagrad", 8.0, "the speed of torch::optim::Adagrad"),
    ("RMSprop", "8x8M", "torch_optim_rmsprop", 3.0, "the speed of torch::optim::RMSprop"),
    ("RMSprop", "10000x4096", "torch_optim_rmsprop", 8.0, "the speed of torch::optim::RMSprop"),
    # Views with gaps: the GradScaler and the optimizers read and write long rows in place. On
    # parameters with gaps FusedSGD (plain) moves what torch::optim's in-place p.add_(g) moves, so
    # parity is the ceiling, as the traffic twin is elsewhere.
    ("SGDGaps", "4x4096x2048gaps", "torch_optim_sgd", 0.90,
     "the speed of torch::optim::SGD on parameters with gaps (the same bytes: parity is the ceiling)"),
    ("ScalerGaps", "4x4096x2048gaps", "pytorch_path", 1.0, "the speed of PyTorch's unscale on grads with gaps"),
]


UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}  # Google Benchmark's time units, in seconds


def load(path):
    with open(path) as f:
        data = json.load(f)
    # Per benchmark: its single run, or with repetitions its aggregates.
    found = collections.OrderedDict()
    for b in data["benchmarks"]:
        if b.get("run_type") == "iteration" and b.get("repetitions", 1) > 1:
            continue
        kind = b.get("aggregate_name") if b.get("run_type") == "aggregate" else "single"
        if kind in ("min", "median", "single"):
            found.setdefault(b["run_name"] if "run_name" in b else b["name"], {})[kind] = b
    rows = collections.OrderedDict()
    fastest = False
    for name, runs in found.items():
        # The fastest repetition where the benchmark computed it (bench/bench_engine.cpp
        # says why), else the median (older results, such as bench/gpu/*.json), else
        # the single run.
        b = runs.get("min") or runs.get("median") or runs["single"]
        median = runs.get("median", b)
        fastest |= "min" in runs
        bytes_per_second = b.get("bytes_per_second", 0.0)
        unit = UNITS[b.get("time_unit", "ns")]
        if "min" in runs and b["real_time"] > 0:
            # The min aggregate of a rate is the slowest rate. The fastest run's is
            # its bytes (bench_engine.cpp's bytes_per_call, a constant) over its
            # time; in results without that counter, the median's rate scaled by
            # the two times, exact for an odd count of repetitions only.
            if b.get("bytes_per_call"):
                bytes_per_second = b["bytes_per_call"] / (b["real_time"] * unit)
            else:
                if b.get("repetitions", 1) % 2 == 0:
                    print(f"{path}: {name}: an even count of repetitions and no bytes_per_call: its rate is "
                          f"approximate", file=sys.stderr)
                bytes_per_second = median.get("bytes_per_second", 0.0) * median["real_time"] / b["real_time"]
        parts = name.split("/")
        op, contender, pset = parts[0], parts[1], parts[2]
        rows[(op, pset, contender)] = {
            "seconds": b["real_time"] * unit,
            # The host-path budgets are medians (issue 13).
            "median_seconds": median["real_time"] * UNITS[median.get("time_unit", "ns")],
            "bytes_per_second": bytes_per_second,
            # ZeroAdam's counters: what each rank sends per step and holds as optimizer state.
            "sent_bytes_per_rank": b.get("sent_bytes_per_rank"),
            "state_bytes_per_rank": b.get("state_bytes_per_rank"),
            # Adam8's counter: optimizer state kept per parameter.
            "state_bytes_per_param": b.get("state_bytes_per_param"),
        }
    context = dict(data.get("context", {}))
    context["statistic"] = "fastest" if fastest else "other"
    return context, rows


OP_ORDER = ["Check", "CheckNorm", "Scale", "Scaler", "ScalerClip", "ScalerGaps", "Adam", "AdamScaled", "AdamClip", "Adam8",
            "SGD", "SGDGaps", "LAMB",
            "Adagrad", "RMSprop", "AdamSubnormal", "AdamScaledTiny", "AdamF64", "SGDF64", "Host", "HostMovedGrads",
            "HostGradsComeAndGo", "HostLAMB", "HostSGD", "HostAdagrad", "HostRMSprop", "HostScaler", "HostScalerMovedGrads",
            "HostScalerGradsComeAndGo", "HostGroups", "ZeroAdam",
            "ZeroAdam8"]

# (operation, parameter set, most nanoseconds per parameter, what is timed): host-path budgets.
TIME_TARGETS = [
    ("Host", "10000x1", 30.0, "FusedAdam::step"),
    ("HostScaler", "10000x1", 30.0, "scaler.step(FusedAdam) + scaler.update()"),
    # (A step that made its plan again for every grad that came or went took 1,040 ns here.)
    ("HostGradsComeAndGo", "10000x1", 300.0, "FusedAdam::step with a tenth of the grads gone, another tenth each step"),
]


def num_params(pset):
    """Parameters of a set named <tensors>x<numel>[@cuda], e.g. 10000x1 -> 10000."""
    count, _, numel = pset.split("@")[0].partition("x")
    try:
        return int(count) * (int(numel) if numel.isdigit() else 1)
    except ValueError:
        return 0


def sort_key(key):
    op, pset = key
    base = pset.split("@")[0]
    return (OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER), op, "@" in pset, base)


def ratios(rows):
    """{(op, set): [(contender, seconds, GB/s, ratio, kind)]}, ratio > 1 means ours is better
    (speedup for contenders; fraction of the ceiling for ceilings)."""
    groups = collections.OrderedDict()
    for (op, pset, contender), r in rows.items():
        groups.setdefault((op, pset), {})[contender] = r
    out = collections.OrderedDict()
    for key in sorted(groups, key=sort_key):
        group = groups[key]
        ours = group.get("ours")
        if ours is None:
            continue
        lines = []
        for contender in sorted(group, key=lambda c: (c.startswith("ceiling"), c)):
            r = group[contender]
            if contender == "ours":
                continue
            if contender.startswith("ceiling"):
                ratio = ours["bytes_per_second"] / r["bytes_per_second"] if r["bytes_per_second"] else float("nan")
                kind = "ceiling"
            else:
                ratio = r["seconds"] / ours["seconds"]
                kind = "speedup"
            lines.append((contender, r["seconds"], r["bytes_per_second"] / 1e9, ratio, kind, r))
        out[key] = (ours, lines)
    return out


def gpu_setup_line(context):
    return (f"Measured by `scripts/gpu-check.sh` on {context.get('date', '?')[:10]} on "
            f"{context.get('gpu', 'GPU')} ({context.get('runs', 'one run')}). Host: "
            f"{context.get('num_cpus', '?')} CPUs, {context.get('threads', '?')} threads for every contender; "
            f"LibTorch {context.get('torch_version', '?')}. Each contender timed with CUDA events, for the "
            f"minimum time in its benchmark name, without repetitions.")


def markdown(context, table, title, setup=None):
    # When the benchmarks ran (their JSON's date), not when this report was written.
    try:
        ran = datetime.datetime.fromisoformat(context["date"]).astimezone(datetime.timezone.utc)
    except (KeyError, ValueError):
        ran = datetime.datetime.now(datetime.timezone.utc)
    when = ran.strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# {title}", "",
          setup or f"Measured by `scripts/bench.sh` on {when}. Host: {context.get('host_name', '?')}"
          f"{' (' + context['cpu_model'] + ')' if context.get('cpu_model') else ''}, "
          f"{context.get('num_cpus', '?')} CPUs at {context.get('mhz_per_cpu', '?')} MHz; "
          f"every contender ran with **{context.get('threads', '?')} threads** "
          f"(`torch::set_num_threads`), CPU kernels on **{context.get('cpu_isa', '?')}**; "
          f"LibTorch {context.get('torch_version', '?')}." +
          (" Each time is the fastest of its interleaved repetitions (scripts/bench.sh says why)."
           if context.get("statistic") == "fastest" else ""), "",
          "Speedup = contender time / ampfuse time (higher is better for ampfuse). "
          "Ceiling = ampfuse bandwidth / ceiling bandwidth, the ceiling measured in the same "
          "process on the same bytes (a traffic twin on CPU, a device-to-device copy on CUDA; for Host, "
          "ceiling_objects: one pass reading only the objects a step must check per parameter, then updating "
          "through kept pointers, see bench/bench_host.cpp)." +
          ("" if setup else " The Host rows ran in a process of their own (scripts/bench.sh)."), ""]
    for (op, pset), (ours, lines) in table.items():
        md.append(f"## {op} — {pset}")
        md.append("")
        md.append("| contender | time (ms) | GB/s | ampfuse vs it |")
        md.append("| --- | ---: | ---: | ---: |")
        md.append(f"| **ampfuse** | {ours['seconds'] * 1e3:.2f} | {ours['bytes_per_second'] / 1e9:.1f} | |")
        for contender, sec, gbs, ratio, kind, _ in lines:
            shown = f"{ratio * 100:.0f}% of ceiling" if kind == "ceiling" else f"{ratio:.2f}x"
            md.append(f"| {contender} | {sec * 1e3:.2f} | {gbs:.1f} | {shown} |")
        md.append("")
        if op.startswith("Host") and num_params(pset):
            # Per parameter: medians, as the host budgets are set (TIME_TARGETS).
            per = [f"ampfuse: {ours['median_seconds'] * 1e9 / num_params(pset):.0f} ns per parameter"]
            per += [f"{c}: {r['median_seconds'] * 1e9 / num_params(pset):.0f} ns" for c, _, _, _, kind, r in lines
                    if kind == "ceiling"]
            md.append("; ".join(per) + (" (medians)." if len(per) > 1 else " (median)."))
            md.append("")
        if op.startswith("ZeroAdam"):
            md += zero_lines(op, ours, lines) + [""]
        if op == "Adam8" and adam8_state(ours, lines):
            m = adam8_state(ours, lines)
            md += [f"Optimizer state: {m[0]:.3f} bytes per parameter with 8-bit moments against {m[1]:.3f} with "
                   f"32-bit ones.", ""]
    return md


def zero_memory(ours, lines):
    """(ours, replicated) optimizer-state MB per rank and MB each rank sends per step, or None."""
    rep = [l for l in lines if l[0] == "replicated"]
    if not rep or ours.get("state_bytes_per_rank") is None or rep[0][5] is None:
        return None
    r = rep[0][5]
    return (ours["state_bytes_per_rank"] / 2**20, r["state_bytes_per_rank"] / 2**20,
            ours["sent_bytes_per_rank"] / 2**20, r["sent_bytes_per_rank"] / 2**20)


def adam8_state(ours, lines):
    """(8-bit, 32-bit) optimizer-state bytes per parameter, or None."""
    ref = [l for l in lines if l[0] == "fused_adam_32bit"]
    if not ref or ours.get("state_bytes_per_param") is None or ref[0][5] is None:
        return None
    return ours["state_bytes_per_param"], ref[0][5]["state_bytes_per_param"]


def zero_lines(op, ours, lines):
    m = zero_memory(ours, lines)
    if m is None:
        return []
    adam = "FusedAdam with 8-bit moments" if op == "ZeroAdam8" else "FusedAdam"
    return [f"Ranks are threads of one process over Gloo (loopback), one intra-op thread each. Optimizer state "
            f"per rank: {m[0]:.1f} MB (ZeroOptimizer over {adam}) against {m[1]:.1f} MB (replicated {adam}). "
            f"Sent per rank per step (ring algorithms): {m[2]:.1f} MB against {m[3]:.1f} MB (on CPU ZeroOptimizer "
            f"all-reduces the grads and broadcasts the shards, Gloo's fastest collectives; with NCCL it "
            f"reduce-scatters and all-gathers, as much as one all-reduce)."]


def target_lines(table):
    md = ["## Targets", "", "| target | measured | met |", "| --- | ---: | :---: |"]
    ok_all = True
    for op, pset, contender, minimum, what in TARGETS:
        entry = table.get((op, pset))
        found = [l for l in entry[1] if l[0] == contender] if entry else []
        if not found:
            continue
        ratio = found[0][3]
        ok = ratio >= minimum
        ok_all &= ok
        shown = f"{ratio * 100:.0f}%" if found[0][4] == "ceiling" else f"{ratio:.2f}x"
        want = f"{minimum * 100:.0f}%" if found[0][4] == "ceiling" else f"{minimum:g}x"
        md.append(f"| {op} {pset}: at least {want} {what} | {shown} | {'yes' if ok else 'no'} |")
    for op, pset, most_ns, what in TIME_TARGETS:
        entry = table.get((op, pset))
        if not entry or not num_params(pset):
            continue
        ns = entry[0]["median_seconds"] * 1e9 / num_params(pset)
        ok = ns <= most_ns
        ok_all &= ok
        md.append(f"| {op} {pset}: {what} at most {most_ns:g} ns per parameter (median) | {ns:.0f} ns | "
                  f"{'yes' if ok else 'no'} |")
    md.append("")
    return md, ok_all


BEGIN, END = "<!-- ratios:begin -->", "<!-- ratios:end -->"


def readme_rows(table):
    rows = []
    for (op, pset), (ours, lines) in table.items():
        cells = []
        if op.startswith("Host") and num_params(pset):
            cells.append(f"{ours['median_seconds'] * 1e9 / num_params(pset):.0f} ns per parameter (median)")
        if op.startswith("ZeroAdam") and zero_memory(ours, lines):
            m = zero_memory(ours, lines)
            cells.append(f"optimizer state {m[0]:.0f} MB per rank (replicated: {m[1]:.0f} MB), sent {m[2]:.0f} MB "
                         f"per rank per step (replicated: {m[3]:.0f} MB)")
        if op == "Adam8" and adam8_state(ours, lines):
            cells.append(f"{adam8_state(ours, lines)[0]:.2f} bytes of state per parameter "
                         f"(32-bit: {adam8_state(ours, lines)[1]:.0f})")
        for contender, _, _, ratio, kind, _ in lines:
            cells.append(f"{ratio * 100:.0f}% of {contender}" if kind == "ceiling" else f"{ratio:.2f}x {contender}")
        rows.append(f"| {op} | {pset} | {'; '.join(cells)} |")
    return rows


def update_readme(path, context, table, gpu=None):
    """Rewrites the compact ratio tables between the README's markers."""
    head_row = ["| operation | parameter set | ampfuse vs contenders |", "| --- | --- | --- |"]
    lines = [BEGIN, "",
             f"{context.get('threads', '?')} threads for every contender, CPU kernels on "
             f"{context.get('cpu_isa', '?')}" +
             ("; each time the fastest of its interleaved repetitions" if context.get("statistic") == "fastest" else "") +
             "; full tables in [bench/RESULTS.md](bench/RESULTS.md).", ""]
    lines += head_row + readme_rows(table)
    if gpu:
        gpu_context, gpu_table = gpu
        lines += ["", f"On a {gpu_context.get('gpu', 'GPU')}, from `scripts/gpu-check.sh` on "
                      f"{gpu_context.get('date', '?')[:10]} (CUDA events; same file, second part):", ""]
        lines += head_row + readme_rows(gpu_table)
    lines += ["", END]
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        print(f"{path}: no {BEGIN} ... {END} block; not updated", file=sys.stderr)
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(head + "\n".join(lines) + tail)


def plot(table, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k in table.keys() if table[k][0]["bytes_per_second"]]  # rows timed without bytes (ZeroAdam) are not plotted
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.2 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ours, lines = table[key]
        names = ["ampfuse"] + [l[0] for l in lines]
        values = [ours["bytes_per_second"] / 1e9] + [l[2] for l in lines]
        colors = ["tab:green"] + ["tab:gray" if l[0].startswith("ceiling") else "tab:blue" for l in lines]
        ax.barh(names, values, color=colors)
        ax.set_title(f"{key[0]} — {key[1]}", fontsize=9)
        ax.set_xlabel("GB/s (bytes the operation must move)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_all(paths):
    context, rows = {}, collections.OrderedDict()
    statistics = set()
    for path in paths:
        c, r = load(path)
        statistics.add(c["statistic"])
        context = context or c
        rows.update(r)
    # "Fastest" in the set-up line only where every file's times are.
    context = dict(context, statistic="fastest" if statistics == {"fastest"} else "other")
    if len(statistics) > 1:
        print("report.py: some files hold the fastest repetitions and some do not: the set-up line names neither",
              file=sys.stderr)
    return context, ratios(rows)


def part(context, table, title, setup=None):
    """One part of the Markdown: title, set-up, legend, targets, tables."""
    md = markdown(context, table, title, setup)
    tl, _ = target_lines(table)
    intro = md.index("") + 1  # after the title
    intro = md.index("", intro + 1) + 1  # after the set-up paragraph
    intro = md.index("", intro + 1) + 1  # after the legend
    md[intro:intro] = tl
    return md


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--md")
    ap.add_argument("--png")
    ap.add_argument("--title", default="ampfuse benchmark results")
    ap.add_argument("--readme", help="README whose ratios block (between markers) is rewritten")
    ap.add_argument("--gpu", nargs="*", default=[], help="JSON of the last GPU check (bench/gpu/)")
    ap.add_argument("--gpu-setup", action="store_true",
                    help="the positional JSON is a GPU check's (scripts/gpu-check.sh): its set-up line")
    args = ap.parse_args()
    context, table = load_all(args.json)
    md = part(context, table, args.title, gpu_setup_line(context) if args.gpu_setup else None)
    gpu = None
    if args.gpu:
        gpu = load_all(args.gpu)
        md += part(gpu[0], gpu[1], f"On a GPU: {gpu[0].get('gpu', '?')}", gpu_setup_line(gpu[0]))
    text = "\n".join(md) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.png:
        plot(table, args.png)
    if args.readme:
        update_readme(args.readme, context, table, gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
