"""Per weight format and row path of a compile_check JSON (sm_90, fp16/bf16 GEMV rows):
registers, and the median K-loop warp instructions per KB of packed weight over Q4_1's
median on the same path.

    python summary.py triton-3.6.json [triton-3.9.json ...]
"""

import collections
import json
import statistics
import sys

GEMV = ("_kquant_gemv_kernel", "_quant_gemv_kernel")
SHOWN = ("q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def groups(path: str) -> dict:
    out = collections.defaultdict(list)
    for r in json.load(open(path))["records"]:
        if r["kernel"] not in GEMV or r["dtype"] == "fp32" or r["arch"] != "sm_90":
            continue
        if not r.get("loop_instructions_per_kb"):
            continue
        fmt = r["example"].split()[2]
        path_ = "tensor cores" if "USE_DOT=True" in r["config"] else "M = 1"
        out[(fmt, path_)].append(r)
    return out


for f in sys.argv[1:]:
    g = groups(f)
    print(f"{f}:\n\n| format | rows | configs | registers | loop instr/KB vs Q4_1 |")
    print("|---|---|---|---|---|")
    for fmt in SHOWN:
        for path_ in ("M = 1", "tensor cores"):
            rows = g.get((fmt, path_))
            if not rows:
                continue
            regs = sorted(r["registers"] for r in rows)
            per_kb = statistics.median(r["loop_instructions_per_kb"] for r in rows)
            ref = statistics.median(r["loop_instructions_per_kb"] for r in g[("q4_1", path_)])
            print(
                f"| {fmt} | {path_} | {len(rows)} | {regs[0]}-{regs[-1]} | {per_kb / ref:.2f} |"
            )
    print()
