"""Tune the quantized GEMV's launch configuration on this GPU and write a table for it.

    python -m benchmarks.tune_gemv              # Llama-3-8B shapes, int4 / q4_1 / q8_0,
                                                # one row (m1) and 8 rows (dot), ~2-3 min
    python -m benchmarks.tune_gemv --models llama-3-8b qwen2.5-0.5b --formats int4 --paths m1
    python -m benchmarks.tune_gemv --budget-s 150 --jobs 12
                                                # stop timing after 150 s; 12 compile processes
    python -m benchmarks.tune_gemv --table FILE # where the table goes (default
                                                # benchmarks/results/gemv-<device>.json)
    python -m benchmarks.tune_gemv --ab FILE    # only the A/B: step times of a random
                                                # Llama-3-8B-shape int4 model, heuristic vs FILE
    python -m benchmarks.tune_gemv --models smollm2-135m --formats q4_1 q8_0 \
        --merge specdec/kernels/configs/gemv-nvidia-h200.json --ab-model smollm2-135m \
        --ab-format q4_1                        # add SmolLM2's shapes to a shipped table
    python -m benchmarks.tune_gemv --quick      # CPU: the interpreter, a tiny shape, two
                                                # candidates (the plumbing, not a tuning)

`quant_gemv.gemv_config` picks tiles from the shapes alone (`tiled_gemv_config`); this script
measures what the chip prefers. For each weight shape, format and row path it:

1. compiles every candidate (block_n x block_k x num_warps x num_stages, tiles of 2-16 K
   elements for one row, up to 32 K for tl.dot) in --jobs parallel processes, which fill
   Triton's on-disk cache (compiling dominates the cost, timing does not);
2. times each candidate at the heuristic's split-K, then the best four at every split-K:
   each time is the median of 5 replays of a CUDA graph of 24 (or more) launches that cycle
   through up to 64 copies of the weight (256 MB), to stream past the L2 cache (as a real forward does, layer
   after layer), the split-K reduction included;
3. checks the winner's output against the heuristic's on the same input (poisoned output
   buffers), and keeps it only if it is at least 3% faster.

The table (JSON, `specdec.kernels.gemv_tuning`) is written atomically, with each entry's time
and the heuristic's, and a side-by-side table printed. Ship it as
specdec/kernels/configs/gemv-<device>.json (or point SPECDEC_GEMV_TUNING at it); --ab then
compares decode / verification / draft steps of a whole model with and without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU smoke run needs the interpreter before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import (  # noqa: E402
    MODEL_SHAPES,
    RESULTS_DIR,
    atomic_write,
    environment,
    graph_ms,
)
from benchmarks.models import QUANT_FORMATS, random_weight  # noqa: E402
from specdec.errors import SpecDecError  # noqa: E402
from specdec.kernels import gemv_tuning  # noqa: E402
from specdec.kernels.quant_gemv import GemvConfig, gemv_config, launch_quant_gemv  # noqa: E402
from specdec.kernels.utils import cdiv, target_of  # noqa: E402

log = logging.getLogger(__name__)

FORMATS = ("int4", "q4_1", "q8_0")
ROWS = {"m1": 1, "dot": 8}  # the rows each path is timed at (dot: 2..16 behave alike)
L2_STREAM_BYTES = 256 << 20  # weight copies per case: at least this many bytes, up to 64
GRAPH_LAUNCHES = 24  # launches per timed graph (at least one per weight copy)
KEEP_IF_FASTER = 0.97


@dataclass(frozen=True)
class Case:
    model: str
    layer: str
    fmt: str
    n: int
    k: int
    path: str


@dataclass(frozen=True)
class Candidate:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def cases_for(models, formats, paths) -> list[Case]:
    out = []
    for name in models:
        cfg = MODEL_SHAPES[name]
        shapes = {
            "q_proj/o_proj": (cfg.q_dim, cfg.dim),
            "k_proj/v_proj": (cfg.kv_dim, cfg.dim),
            "gate/up_proj": (cfg.ffn_dim, cfg.dim),
            "down_proj": (cfg.dim, cfg.ffn_dim),
            "lm_head": (cfg.vocab_size, cfg.dim),
        }
        for fmt, (layer, (n, k)), path in itertools.product(formats, shapes.items(), paths):
            out.append(Case(name, layer, fmt, n, k, path))
    return out  # format by format: a spent budget leaves whole formats untuned


def candidates(fmt: str, path: str, quick: bool) -> list[Candidate]:
    bits, group, _, _ = QUANT_FORMATS[fmt]
    min_k = max(32, group or 32) if bits == 4 else 32
    if quick:
        return [Candidate(32, max(min_k, 64), 4, 3), Candidate(16, max(min_k, 128), 4, 1)]
    if path == "m1":
        block_ns, max_tile = (8, 16, 32, 64), 16384
        block_ks = (128, 256, 512) if bits == 4 else (64, 128, 256)
        warps, stages = (2, 4, 8), (1, 2, 3, 4)
    else:
        block_ns, max_tile = (16, 32, 64, 128), 32768
        block_ks = (64, 128, 256, 512) if bits == 4 else (64, 128, 256)
        warps, stages = (4, 8), (2, 3, 4)
    out = []
    for bn, bk, nw, ns in itertools.product(block_ns, block_ks, warps, stages):
        if bk >= min_k and 2048 <= bn * bk <= max_tile:
            out.append(Candidate(bn, bk, nw, ns))
    return out


def make_config(case: Case, w, cand: Candidate | None, split_k: int | None, device):
    """The GemvConfig of a candidate (None: the shape heuristic's own; a tuned table this
    device may already have is not consulted)."""
    target = replace(target_of(device), device="")  # no device name: no tuned table
    m = ROWS[case.path]
    if cand is None:
        return gemv_config(m, w, torch.bfloat16, target, split_k=split_k)
    cfg = gemv_config(
        m, w, torch.bfloat16, target, block_n=cand.block_n, block_k=cand.block_k, split_k=split_k
    )
    return replace(cfg, num_warps=cand.num_warps, num_stages=cand.num_stages)


def _inputs(case: Case, device):
    """([one random weight], x [rows of the path, K] bf16)."""
    gen = torch.Generator(device=device).manual_seed(case.n * 7919 + case.k)
    w = random_weight(case.fmt, case.n, case.k, device, gen)
    x = torch.randn(ROWS[case.path], case.k, device=device, generator=gen).to(torch.bfloat16)
    return [w], x


# -- 1. parallel compilation ------------------------------------------------------------------
def _compile_worker(items: list[tuple[Case, Candidate]]) -> list[str]:
    """Launch each candidate once (fills Triton's cache); the errors, as text."""
    logging.disable(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    errors, inputs = [], {}
    for case, cand in items:
        key = (case.fmt, case.n, case.k, case.path)
        if key not in inputs:
            inputs[key] = _inputs(case, device)
        (w,), x = inputs[key]
        try:
            cfg = make_config(case, w, cand, None, device)
            out = torch.empty(x.shape[0], case.n, dtype=x.dtype, device=device)
            launch_quant_gemv(x, w, None, out, cfg)
        except Exception as e:  # noqa: BLE001 (a candidate that does not compile is dropped)
            errors.append(f"{case.fmt} {case.path} {cand}: {type(e).__name__}: {e}"[:300])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return errors


def precompile(work: list[tuple[Case, Candidate]], jobs: int) -> list[str]:
    """Compile every candidate once per format and path (the shapes share the binaries:
    their sizes and strides are all multiples of 16)."""
    seen, unique = set(), []
    for case, cand in work:
        key = (case.fmt, case.path, cand)
        if key not in seen:
            seen.add(key)
            unique.append((case, cand))
    if jobs <= 1 or not torch.cuda.is_available():
        return _compile_worker(unique)
    chunks = [unique[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        return [e for errs in pool.map(_compile_worker, chunks) for e in errs]


# -- 2. timing --------------------------------------------------------------------------------
def time_config(case: Case, ws, x, cfg: GemvConfig, device) -> float:
    """Median ms per launch (split-K reduction included), weights cycling through `ws`."""
    outs = [torch.empty(x.shape[0], case.n, dtype=x.dtype, device=device) for _ in range(2)]
    work = torch.empty(cfg.split_k * x.shape[0] * case.n, dtype=torch.float32, device=device)

    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            launch_quant_gemv(x, ws[0], None, outs[0], cfg, work)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    copies = itertools.cycle(range(len(ws)))

    def one():  # each call reads the next weight copy
        i = next(copies)
        launch_quant_gemv(x, ws[i], None, outs[i % 2], cfg, work)

    return graph_ms(one, launches=max(GRAPH_LAUNCHES, len(ws)))


def weight_bytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.mins) if t is not None)


def split_choices(case: Case, cand: Candidate, w) -> list[int]:
    k_tiles = cdiv(w.k_padded, cand.block_k)
    return sorted({s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if s <= k_tiles})


def tune_case(case: Case, cands: list[Candidate], device, deadline: float) -> dict | None:
    ws, x = _inputs(case, device)
    if device.type == "cuda":  # more copies of the weight, to stream past L2
        copies = max(1, min(64, L2_STREAM_BYTES // weight_bytes(ws[0])))
        ws += [random_weight(case.fmt, case.n, case.k, device) for _ in range(copies - 1)]
    base_cfg = make_config(case, ws[0], None, None, device)
    base_ms = time_config(case, ws, x, base_cfg, device)

    def timed_run(cand: Candidate, split: int | None):
        """(ms, candidate, split-K), or None if it cannot run (dropped, logged)."""
        try:
            cfg = make_config(case, ws[0], cand, split, device)
            if split is not None and cfg.split_k != split:  # rounds to another choice
                return None
            return time_config(case, ws, x, cfg, device), cand, cfg.split_k
        except Exception as e:  # noqa: BLE001 (a candidate that cannot run is dropped)
            log.info("%s %s split %s: %s", case, cand, split, str(e)[:200])
            return None

    timed = []
    for cand in cands:
        if time.monotonic() > deadline:
            break
        timed.append(timed_run(cand, None))
    timed = sorted((t for t in timed if t is not None), key=lambda t: t[0])
    best = list(timed[:1])
    for _, cand, _ in timed[:4]:
        for split in split_choices(case, cand, ws[0]):
            if time.monotonic() > deadline:
                break
            best.append(timed_run(cand, split))
    best = [t for t in best if t is not None]
    if not best:
        return None
    ms, cand, split = min(best, key=lambda t: t[0])
    cfg = make_config(case, ws[0], cand, split, device)
    # the winner computes what the heuristic computes (sums in another order)
    ref = torch.full((x.shape[0], case.n), float("nan"), dtype=x.dtype, device=device)
    got = torch.full_like(ref, float("nan"))
    launch_quant_gemv(x, ws[0], None, ref, base_cfg)
    launch_quant_gemv(x, ws[0], None, got, cfg)
    ok = bool(torch.isfinite(got).all()) and torch.allclose(
        got.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.float().abs().mean())
    )
    nbytes = weight_bytes(ws[0]) + x.numel() * 2 + ref.numel() * 2
    return {
        **asdict(case),
        "heuristic": {
            "block_n": base_cfg.block_n,
            "block_k": base_cfg.block_k,
            "split_k": base_cfg.split_k,
            "num_warps": base_cfg.num_warps,
            "num_stages": base_cfg.num_stages,
        },
        "heuristic_ms": base_ms,
        "best": {**asdict(cand), "split_k": split},
        "ms": ms,
        "speedup": base_ms / ms,
        "gbps": nbytes / (ms * 1e-3) / 1e9,
        "heuristic_gbps": nbytes / (base_ms * 1e-3) / 1e9,
        "candidates_timed": len(timed),
        "copies": len(ws),
        "output_matches": ok,
        "kept": ok and ms <= KEEP_IF_FASTER * base_ms,
    }


def table_entries(results: list[dict]) -> list[dict]:
    entries = []
    for r in results:
        if not r["kept"]:
            continue
        bits, group, mins, _ = QUANT_FORMATS[r["fmt"]]
        entries.append(
            {
                "format": gemv_tuning.format_key(bits, group or r["k"], mins),
                "n": r["n"],
                "k": r["k"],
                "path": r["path"],
                **{
                    f: r["best"][f]
                    for f in ("block_n", "block_k", "split_k", "num_warps", "num_stages")
                },
                "ms": round(r["ms"], 5),
                "heuristic_ms": round(r["heuristic_ms"], 5),
                "gbps": round(r["gbps"], 1),
            }
        )
    return entries


def print_table(results: list[dict]) -> None:
    print(
        "| model | layer | format | path | heuristic (bn/bk/split/w/s) | ms | GB/s | "
        "tuned (bn/bk/split/w/s) | ms | GB/s | speedup | kept |"
    )
    print("|---|---|---|---|---|---:|---:|---|---:|---:|---:|---|")
    for r in results:
        h, b = r["heuristic"], r["best"]
        hs = "/".join(
            str(h[f]) for f in ("block_n", "block_k", "split_k", "num_warps", "num_stages")
        )
        bs = "/".join(
            str(b[f]) for f in ("block_n", "block_k", "split_k", "num_warps", "num_stages")
        )
        kept = "yes" if r["kept"] else ("no (output differs)" if not r["output_matches"] else "no")
        print(
            f"| {r['model']} | {r['layer']} | {r['fmt']} | {r['path']} | {hs} | "
            f"{r['heuristic_ms']:.4f} | {r['heuristic_gbps']:.0f} | {bs} | {r['ms']:.4f} | "
            f"{r['gbps']:.0f} | {r['speedup']:.2f}x | {kept} |"
        )


# -- 3. whole-model A/B -----------------------------------------------------------------------
def load_merge_table(path: Path, device: str) -> list[dict]:
    """The entries of the table to merge into (--merge), read and checked before any tuning:
    a file that cannot be read, is not a valid table or is for another device is an error."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecDecError(f"cannot read the table to merge {path}: {e}") from e
    gemv_tuning.parse_table(data, str(path))
    if data.get("device") != device:
        raise SpecDecError(f"{path} is for {data.get('device')!r}, not {device!r}")
    return data["entries"]


def merge_entries(new: list[dict], old: list[dict]) -> list[dict]:
    """`new` entries plus the `old` ones for the shapes and paths `new` does not cover: a
    run tuning other formats adds to a shipped table."""
    key = ("format", "n", "k", "path")
    have = {tuple(e[f] for f in key) for e in new}
    return [e for e in old if tuple(e[f] for f in key) not in have] + new


def ab(
    table: Path | None, repeats: int = 2, shape_name: str = "llama-3-8b", fmt: str = "int4"
) -> list[dict]:
    """Step times (CUDA graphs) of a random `shape_name`-shape model in `fmt` with the heuristic
    ('off') and with `table`, interleaved `repeats` times in this process."""
    from benchmarks.models import random_model, shape, step_ms
    from specdec.models.cuda_graphs import graphs_for

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = shape(shape_name, cuda)  # tiny on CPU
    model = random_model(cfg, fmt, device)
    exit_layers = list(range(cfg.n_layers // 4))
    steps = {
        "decode T=1": (1, None),
        "verify T=5": (5, None),
        "verify T=9": (9, None),
        "early-exit draft T=1": (1, exit_layers),
    }
    settings = {"heuristic": "off", "tuned": str(table) if table else "off"}
    times: dict = {(s, st): [] for s in settings for st in steps}
    old = os.environ.get(gemv_tuning.ENV)
    try:
        for _ in range(repeats):
            for label, value in settings.items():
                os.environ[gemv_tuning.ENV] = value
                gemv_tuning.clear_cache()
                graphs_for(model).drop()
                for st, (T, layers) in steps.items():
                    times[label, st].append(step_ms(model, T, graphs=cuda, layers=layers))
    finally:
        if old is None:
            os.environ.pop(gemv_tuning.ENV, None)
        else:
            os.environ[gemv_tuning.ENV] = old
        gemv_tuning.clear_cache()
        graphs_for(model).drop()
    rows = []
    print(f"\n{cfg.name}, {fmt}, {model.dtype}, CUDA graphs: step ms, heuristic vs tuned table")
    print("| step | heuristic ms | tuned ms | tuned / heuristic |")
    print("|---|---:|---:|---:|")
    for st in steps:
        h = statistics.median(times["heuristic", st])
        t = statistics.median(times["tuned", st])
        rows.append({"step": st, "heuristic_ms": h, "tuned_ms": t, "ratio": t / h})
        print(f"| {st} | {h:.3f} | {t:.3f} | {t / h:.2f}x |")
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["llama-3-8b"], choices=sorted(MODEL_SHAPES))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--paths", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--budget-s", type=float, default=180.0, help="stop timing after this")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--table", type=Path, default=None, help="output table (JSON)")
    p.add_argument("--ab", type=Path, default=None, help="only the A/B against this table")
    p.add_argument("--no-ab", action="store_true", help="skip the A/B after tuning")
    p.add_argument(
        "--merge", type=Path, default=None, help="keep this table's entries the run does not tune"
    )
    p.add_argument("--ab-model", default="llama-3-8b", choices=sorted(MODEL_SHAPES))
    p.add_argument("--ab-format", default="int4", choices=FORMATS)
    p.add_argument("--quick", action="store_true", help="CPU smoke: tiny shape, 2 candidates")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.ab is not None:
        ab(args.ab, shape_name=args.ab_model, fmt=args.ab_format)
        return 0
    if not cuda and not args.quick:
        print("tune_gemv needs a CUDA GPU (use --quick for the CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    env = environment(device)
    merge = []
    if args.merge is not None:
        try:
            merge = load_merge_table(args.merge, env.get("device"))
        except SpecDecError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    cases = cases_for(args.models, args.formats, args.paths)
    if args.quick:
        cases = [Case("tiny", "proj", f, 48, 256, p) for f in args.formats[:1] for p in ROWS]
    work = [(c, cand) for c in cases for cand in candidates(c.fmt, c.path, args.quick)]
    errors = precompile(work, 1 if args.quick else args.jobs)
    log.info(
        "compiled %d candidate configurations in %.0f s (%d failed)",
        len({(c.fmt, c.path, cand) for c, cand in work}),
        time.monotonic() - t0,
        len(errors),
    )
    for e in errors[:10]:
        log.info("  %s", e)
    results = []
    for case in cases:
        if time.monotonic() > deadline:
            log.info("budget spent: %s and later cases not tuned", case)
            break
        r = tune_case(case, candidates(case.fmt, case.path, args.quick), device, deadline)
        if r is not None:
            results.append(r)
            log.info(
                "%s %s %s %s: %.4f -> %.4f ms (%.2fx)%s",
                case.model,
                case.layer,
                case.fmt,
                case.path,
                r["heuristic_ms"],
                r["ms"],
                r["speedup"],
                "" if r["output_matches"] else " OUTPUT DIFFERS",
            )
    print_table(results)
    table = {
        "version": gemv_tuning.TABLE_VERSION,
        "device": env.get("device"),
        "triton": env.get("triton"),
        "torch": env.get("torch"),
        "date": env.get("date"),
        "commit": env.get("commit"),
        "entries": merge_entries(table_entries(results), merge),
    }
    gemv_tuning.parse_table(table, "(new)")  # what we write must load
    slug = gemv_tuning.device_slug(env.get("device") or "cpu")
    path = args.table or (RESULTS_DIR / f"gemv-{slug}.json")
    atomic_write(path, json.dumps(table, indent=1) + "\n")
    full = path.with_name(path.stem + "-runs.json")
    atomic_write(full, json.dumps({"env": env, "results": results, "errors": errors}, indent=1))
    print(
        f"\n{len(table['entries'])} of {len(results)} tuned entries kept -> {path} "
        f"(all runs: {full}); {time.monotonic() - t0:.0f} s"
    )
    if not args.no_ab and table["entries"]:
        ab(path, shape_name=args.ab_model, fmt=args.ab_format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
