"""Markdown from a combined GPU results file (benchmarks/results/<date>-<gpu>.json).

    python -m benchmarks.report benchmarks/results/<date>-<gpu>.json   # docs/gpu.md's rows

Prints the environment, a condensed kernel table (GEMV at M = 1 and 16, verification
attention at T = 1 and 9, KV compaction, rejection sampling at k = 4), the end-to-end
tables and the streamed summary. `update_readme` (used by `python -m benchmarks.bench_e2e
--doc FILE`) writes the end-to-end tables between markers in a markdown file, docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks.harness import KERNEL_COLUMNS, atomic_write, markdown_table
from specdec.cli import user_errors
from specdec.errors import SpecDecError

README_BEGIN = "<!-- bench_e2e:begin -->"
README_END = "<!-- bench_e2e:end -->"

# which kernel rows the README shows, by benchmark
KERNEL_ROWS = {
    "bench_kernels": lambda shape: re.search(r" M=(1|16) ", shape) is not None,
    "bench_attention": lambda shape: "T=" not in shape or re.search(r" T=(1|9) ", shape),
    "bench_rejection": lambda shape: " k=4 " in shape,
}


def headline(e2e: dict) -> float | None:
    """The first model's (8B shape) plain decode rate with CUDA graphs, when measured."""
    models = e2e["models"]
    if not models or "error" in models[0] or not models[0]["plain"]:
        return None
    return models[0]["plain"][0]["decode_tokens_per_second"]


def invariance_label(run: dict, model: dict) -> str:
    """ ", invariance off" / ", invariance broadcast" for bench_e2e's A/B rows (runs in
    another batch-invariance mode than the model's first plain run), else ""."""
    first = model["plain"][0]
    if not first.get("batch_invariant"):
        return ""
    if run.get("batch_invariant") is False:
        return ", invariance off"
    if run.get("invariant_gemv") != first.get("invariant_gemv"):
        return f", invariance {run.get('invariant_gemv')}"
    return ""


def e2e_tables(e2e: dict) -> str:
    """Decode rates and step times as Markdown."""
    hf = {h["model"]: h for h in e2e.get("hf", [])}
    models = [m for m in e2e["models"] if "error" not in m]
    lines = [
        "| model | weights | decoding | CUDA graphs | tok/s | speedup | alpha | tokens/round "
        "| bytes/token | % copy BW |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        w = f"{m['format']} / {m['dtype']}"
        base = m["plain"][0]["decode_tokens_per_second"]
        for p in m["plain"]:
            graphs = "on" if p["cuda_graphs"] else "off"
            graphs += invariance_label(p, m)  # the A/Bs against the batch-invariant default
            lines.append(
                f"| {m['model']} | {w} | plain | {graphs} | "
                f"{p['decode_tokens_per_second']:.1f} | {p['decode_tokens_per_second'] / base:.2f}x"
                f" | - | 1.00 | {p['bytes_per_token'] / 2**20:.0f} MiB | "
                f"{100 * p['fraction_of_copy_bandwidth']:.0f}% |"
            )
        for s in m["speculative"]:
            graphs = "on" if s["cuda_graphs"] else "off"
            if s["cuda_graphs"] and s.get("chain_graphs") is False:
                graphs = "on, chain off"  # a graph replay per draft step (A/B)
            graphs += invariance_label(s, m)
            # over plain decoding in the same mode (bench_e2e's "speedup"; older results: the
            # first plain row)
            speedup = s.get("speedup", s["decode_tokens_per_second"] / base)
            lines.append(
                f"| {m['model']} | {w} | {s['drafter']} k={s['k']} | "
                f"{graphs} | {s['decode_tokens_per_second']:.1f} | "
                f"{speedup:.2f}x | {s['alpha']:.2f} | "
                f"{s['mean_accepted_tokens']:.2f} | - | - |"
            )
        h = hf.get(m["model"])
        if h and "decode_tokens_per_second" in h:
            lines.append(
                f"| {m['model']} | HF {h['dtype']} | plain (transformers) | off | "
                f"{h['decode_tokens_per_second']:.1f} | "
                f"{h['decode_tokens_per_second'] / base:.2f}x | - | 1.00 | - | - |"
            )
    lines += [
        "",
        "| model | decode step ms (graph) | decode step ms (eager) | verify ms (T) | "
        "verify / decode | draft step ms |",
        "|---|---:|---:|---|---|---|",
    ]
    for m in models:
        st = m["steps"]
        ver = ", ".join(f"{v['ms']:.3f} ({v['T']})" for v in st["verify"])
        ratio = ", ".join(f"{v['ratio_to_decode']:.2f}x (T={v['T']})" for v in st["verify"])
        drafts = ", ".join(f"{k} {v:.3f}" for k, v in st["draft_step_ms"].items())
        lines.append(
            f"| {m['model']} | {st['decode_ms']:.3f} | {st['decode_eager_ms']:.3f} | {ver} | "
            f"{ratio} | {drafts} |"
        )
    phases = round_phases(models)
    if phases:
        lines += ["", *phases]
    return "\n".join(lines)


def round_phases(models: list[dict]) -> list[str]:
    """Where a speculative round's time went (CUDA graph rows): ms per round drafting,
    verifying and the rest (acceptance, rollback, bookkeeping), against the model time the
    step benchmarks predict (k draft forwards + one verification of k + 1 tokens)."""
    lines = [
        "| model | decoding | ms / round | draft | verify | other | k x draft step + verify "
        "| overhead |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        st = m["steps"]
        verify = {v["T"]: v["ms"] for v in st["verify"]}
        n_new = m["plain"][0].get("new_tokens") if m["plain"] else None
        for s in m["speculative"]:
            t = s.get("time_s") or {}
            rounds, approx = s.get("rounds"), ""
            if not rounds and n_new:  # results from before bench_e2e recorded the rounds
                rounds, approx = (n_new - 1) / s["mean_accepted_tokens"], "~"
            if not s["cuda_graphs"] or not rounds or not {"draft", "verify", "other"} <= set(t):
                continue
            ms = {key: 1000 * t[key] / rounds for key in ("draft", "verify", "other")}
            total = sum(ms.values())
            step = st["draft_step_ms"].get(s["drafter"])
            model_ms = None
            if step is not None and s["k"] + 1 in verify:
                model_ms = s["k"] * step + verify[s["k"] + 1]
            chain = ", chain off" if s.get("chain_graphs") is False else ""
            chain += invariance_label(s, m)
            lines.append(
                f"| {m['model']} | {s['drafter']} k={s['k']}{chain} | {approx}{total:.2f} | "
                f"{ms['draft']:.2f} | {ms['verify']:.2f} | {ms['other']:.2f} | "
                + ("- | - |" if model_ms is None else f"{model_ms:.2f} | {total - model_ms:.2f} |")
            )
    return lines if len(lines) > 2 else []


def kernel_table(data: dict) -> str:
    rows = [
        r
        for name, records in data.get("kernels", {}).items()
        for r in records
        if KERNEL_ROWS.get(name, lambda shape: True)(r["shape"])
    ]
    return markdown_table(rows, KERNEL_COLUMNS)


def streamed_table(streamed: dict) -> str:
    rows = [
        {"decoding": "plain", **streamed["plain"], "speedup": 1.0},
        *({"decoding": f"early_exit k={s['k']}", **s} for s in streamed["speculative"]),
    ]
    columns = [
        ("decoding", "decoding", ""),
        ("tokens_per_second", "tok/s", ".2f"),
        ("speedup", "speedup", ".2f"),
        ("predicted_speedup", "cost model", ".2f"),
        ("alpha", "alpha", ".2f"),
        ("mean_accepted_tokens", "tokens/round", ".2f"),
    ]
    h2d = streamed["h2d"]
    return (
        f"{streamed['model']}: host-to-device {h2d['gbps']:.1f} GB/s "
        f"({h2d['chunked_gbps']:.1f} GB/s in layer-sized copies), "
        f"{streamed['streamed_bytes_per_forward'] / 2**30:.2f} GiB streamed per forward, "
        f"c = {streamed['c']:.4f}\n\n" + markdown_table(rows, columns)
    )


def report(data: dict) -> str:
    env = data.get("environment", {})
    parts = [
        f"{data.get('gpu', '?')}, {data.get('date', '?')}, commit {env.get('commit', '?')}, "
        f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}; copy bandwidth "
        f"{data.get('copy_bandwidth_gbps', float('nan')):.0f} GB/s"
    ]
    if data.get("kernels"):
        parts.append(kernel_table(data))
    if "e2e" in data:
        parts.append(e2e_tables(data["e2e"]))
    if "streamed" in data:
        parts.append(streamed_table(data["streamed"]))
    return "\n\n".join(parts)


def readme_section(data: dict) -> str:
    e2e = data["e2e"]
    return "\n".join(
        [
            README_BEGIN,
            f"End-to-end decode, batch 1, greedy, random-weight models "
            f"(`python -m benchmarks.bench_e2e`): {data.get('gpu', e2e['gpu'])}, "
            f"{data.get('date', '?')}, commit {e2e.get('commit', '?')}. "
            f"Copy bandwidth {e2e['copy_bandwidth_gbps']:.0f} GB/s; speculative rows use "
            f"controlled acceptance (alpha target {e2e['alpha_target']}); speedups are over "
            "plain decoding with CUDA graphs.",
            "",
            e2e_tables(e2e),
            README_END,
        ]
    )


def update_readme(readme: Path, data: dict) -> None:
    """Replace the marked section of `readme` with the results' tables; without markers,
    insert it at the top of a "## Results" section, or append one."""
    if "e2e" not in data:
        raise SpecDecError("the results file has no end-to-end (bench_e2e) results")
    text = readme.read_text() if readme.exists() else ""
    section = readme_section(data)
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + section + rest.split(README_END, 1)[1]
    elif "\n## Results\n" in text:
        head, rest = text.split("\n## Results\n", 1)
        text = f"{head}\n## Results\n\n{section}\n{rest}"
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "")
        text += "## Results\n\n" + section + "\n"
    atomic_write(readme, text)


def load_results(path: Path | str) -> dict:
    """A combined results file; a missing or unreadable one is a SpecDecError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecDecError(f"cannot read results file {path}: {e}") from e
    if not isinstance(data, dict):
        raise SpecDecError(f"results file {path} does not hold a JSON object")
    return data


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="benchmarks/results/<date>-<gpu>.json")
    args = parser.parse_args(argv)
    print(report(load_results(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
