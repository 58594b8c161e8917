"""Turns a profile's kernel trace into ms per pipeline stage for kda_opt and FLA (per kernel for
FlashKDA, whose two kernels do not split along our stages), and writes
profiles/<tag>_stages.txt and that shape's table in profiles/README.md (other shapes' sections and the
notes under each table kept). Used by scripts/profile.sh.

Kernels belong to a system by the NVTX range `kda_opt/profile/<system>` their start falls in (or by a
System column, from the torch.profiler fallback), and to a stage by their name.
"""
import argparse
import csv
import datetime
import os
import re
from collections import defaultdict


# Kernel-name fragments → stage, first match wins. Ours carry their stage in the name; FLA's
# 0.6.0 forward: gate+cumsum, intra (Aqk, Akk, solve inside), W/U recompute, state pass, output.
STAGES = {
    "kda_opt": [("chunk_offsets", "seqs"), ("chunk_indices", "seqs"), ("gate_cumsum", "gate"),
                ("intra", "intra + solve"), ("wuso", "wuso")],
    "fla": [("delta_rule_fwd_kernel_h", "state pass"), ("fwd_kernel_o", "output"), ("recompute_w_u", "W/U"),
            ("inter_solve", "inter + solve"), ("solve_tril", "inter + solve"), ("intra", "intra"),
            ("kda_gate", "gate + cumsum"), ("cumsum", "gate + cumsum")],
}


def shape_args(argv):
    """Split profile.sh's arguments into run_profile's own and the scripts/test.py shape options."""
    from kda_bench.bench import case_from_args, gpu_tag, parse_args
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-fla", action="store_true")
    own, rest = p.parse_known_args(argv)
    c = case_from_args(parse_args(rest))
    return own, f"{gpu_tag()}_{c.tag}", c


def stage_of(system, name):
    """The stage a kernel belongs to; a system without a stage map (FlashKDA) is listed per kernel."""
    if system not in STAGES:
        return name.split("<")[0][:40]
    for fragment, stage in STAGES[system]:
        if fragment in name:
            return stage
    return "other"


def read_kernels(trace_csv, ranges_csv):
    """[(system, name, duration ns)] for every kernel of the capture."""
    rows = list(csv.DictReader(open(trace_csv)))
    spans = []
    if ranges_csv:
        for r in csv.DictReader(open(ranges_csv)):
            if "kda_opt/profile/" in r["Name"]:
                spans.append((int(r["Start (ns)"]), int(r["End (ns)"]), r["Name"].rsplit("/", 1)[1]))
    kernels = []
    for r in rows:
        if "System" in r:
            system = r["System"]
        else:
            start = int(r["Start (ns)"])
            system = next((s for a, b, s in spans if a <= start <= b), None)
            if system is None or "[CUDA mem" in r["Name"]:
                continue
        kernels.append((system, r["Name"], int(r["Duration (ns)"])))
    return kernels


def per_stage(kernels, iters):
    """{system: {stage: ms per forward}}, {system: {kernel name: (launches per forward, ms)}}."""
    stages, names = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for system, name, ns in kernels:
        stages[system][stage_of(system, name)] += ns / 1e6 / iters
        entry = names[system][name]
        entry[0] += 1
        entry[1] += ns / 1e6 / iters
    return stages, names


def stage_table(stages, names, iters):
    lines = []
    for system in stages:
        total = sum(stages[system].values())
        lines.append(f"{system}: {total:.3f} ms per forward (sum of kernel times, mean of {iters})")
        lines.append(f"  {'stage':<16}{'ms':>8}{'share':>8}")
        for stage, ms in stages[system].items():
            lines.append(f"  {stage:<16}{ms:>8.3f}{100 * ms / total:>7.1f}%")
        lines.append(f"  {'kernel':<72}{'per fwd':>8}{'ms':>8}")
        for name, (count, ms) in sorted(names[system].items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {name[:72]:<72}{count / iters:>8.1f}{ms:>8.3f}")
        lines.append("")
    return "\n".join(lines)


def kernel_summary(kernels, iters):
    """The torch.profiler fallback's stand-in for nsys's cuda_gpu_kern_sum."""
    total = defaultdict(lambda: [0, 0])
    for _, name, ns in kernels:
        total[name][0] += 1
        total[name][1] += ns
    lines = [f"{'Total Time (ns)':>16} {'Instances':>9} {'Avg (ns)':>12}  Name"]
    for name, (n, ns) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{ns:>16} {n:>9} {ns // n:>12}  {name}")
    return "\n".join(lines) + "\n"


def readme_text(old, heading, stamp, table, source):
    """profiles/README.md's text with the section `## {heading}` set to stamp and table: replaced where
    it exists (the notes after its table kept), else added; the other sections left as they were."""
    preamble = (f"# Profiles\n\nPer-stage GPU time of one forward, from `bash scripts/profile.sh` ({source}); "
                f"kernel and NVTX summaries beside this file as `<gpu>_<shape>_{{kern,nvtx,stages}}.txt`.\n\n")
    section = f"## {heading}\n\n{stamp}\n\n```\n{table}```\n"
    parts = re.split(r"(?m)^(?=## )", old or preamble)
    for i, part in enumerate(parts[1:], 1):
        if part.splitlines()[0] == f"## {heading}":
            table_end = part.index("```\n", part.index("```\n") + 4) + 4
            parts[i] = section + part[table_end:]
            break
    else:
        parts.append(("" if parts[-1].endswith("\n\n") else "\n") + section)
    return preamble + "".join(parts[1:])


def write_readme(tag, case, table, source):
    import torch
    import triton
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    try:
        import fla
        versions += f", fla-core {fla.__version__}"
    except ImportError:
        pass
    path = "profiles/README.md"
    old = open(path).read() if os.path.exists(path) else None
    stamp = f"{datetime.date.today()}, {torch.cuda.get_device_name()}, {versions}."
    with open(path, "w") as f:
        f.write(readme_text(old, f"{case.label}, {tag}", stamp, table, source))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="other options: profile.sh's (--iters, --no-fla, shape options)")
    p.add_argument("--print", choices=["tag", "iters"], help="print the file tag or --iters, then exit")
    p.add_argument("--trace", help="kernel trace CSV (nsys cuda_gpu_trace, or run_profile --torch-trace)")
    p.add_argument("--ranges", help="nsys nvtx_pushpop_trace CSV")
    p.add_argument("--source", default="nsys")
    p.add_argument("--kern-out", help="also write a kernel summary here (torch.profiler fallback)")
    args, rest = p.parse_known_args()
    own, tag, case = shape_args(rest)
    if args.print:
        print(tag if args.print == "tag" else own.iters)
        return
    kernels = read_kernels(args.trace, args.ranges)
    stages, names = per_stage(kernels, own.iters)
    table = stage_table(stages, names, own.iters)
    with open(f"profiles/{tag}_stages.txt", "w") as f:
        f.write(table)
    if args.kern_out:
        with open(args.kern_out, "w") as f:
            f.write(kernel_summary(kernels, own.iters))
    write_readme(tag, case, table, args.source)
    print(table)


if __name__ == "__main__":
    main()
