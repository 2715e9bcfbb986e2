"""Compile every kernel configuration the launchers pick for real model shapes, for a GPU
this machine does not need to have, and check registers, spills, shared memory and the
width of the weight / KV loads.

    python -m benchmarks.compile_check [--arch sm_80 sm_90] [--kernel gemv] [--formats q4_k]
                                       [--quick] [--device "NVIDIA H200"]
                                       [--kquant-layout halves|elements]

The launchers run unchanged on meta tensors inside `specdec.kernels.utils.recording`, which
records each launch (kernel, grid, arguments, constexprs, warps, stages) instead of running
it, as if on the target GPU's SM count (and, with --device, with that GPU's tuned GEMV table:
`specdec.kernels.gemv_tuning`). Each distinct configuration is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`, with the argument
specialisation Triton applies at launch (ints equal to 1 become constants, 16-divisible ints
and 16-byte aligned pointers get a divisibility hint). `ptxas -v` (shipped in the triton
wheel) gives registers and spills, the compiled metadata the shared memory, and the SASS
the width of every global load, attributed (by line info) to the source lines that load
from the packed weights or the KV cache. `nvdisasm` gives the SASS instructions of the
kernel's largest loop (a GEMV's K loop: `loop_instructions`, per thread and iteration) and,
for GEMV rows, the warp instructions that loop issues per KB of packed weight it reads
(`loop_instructions_per_kb`), the decoding cost a format adds over another.

Exit code 1 on a compile failure, spills in a fp16/bf16 configuration, shared memory above
the architecture's per-block limit, or packed-weight loads narrower than the format allows.
Writes benchmarks/results/compile_check.json / .csv (or --out DIR) and prints a table.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.compile_cases import CASES
from benchmarks.harness import MODEL_SHAPES, environment, markdown_table, save_results

# per-architecture limits: SMs of the reference part, shared memory per block (opt-in max)
# and per SM, registers per SM, warps per SM
ARCHS = {
    "sm_80": dict(cc=80, sms=108, smem_block=166912, smem_sm=167936, regs=65536, warps=64),
    "sm_86": dict(cc=86, sms=84, smem_block=101376, smem_sm=102400, regs=65536, warps=48),
    "sm_89": dict(cc=89, sms=128, smem_block=101376, smem_sm=102400, regs=65536, warps=48),
    "sm_90": dict(cc=90, sms=132, smem_block=232448, smem_sm=233472, regs=65536, warps=64),
}
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}
# kernel arguments that point at the bulk data whose load width matters
BULK_ARGS = {"K", "V"}


def import_kernel_modules() -> None:
    """Import every module of specdec.kernels: a kernel file registers its formats itself."""
    import specdec.kernels

    for info in pkgutil.iter_modules(specdec.kernels.__path__):
        importlib.import_module(f"specdec.kernels.{info.name}")


# ---------------------------------------------------------------------------------------
# launches -> compile jobs


def specialise(launch) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher would specialise these arguments."""
    fn = launch.kernel
    names = list(fn.arg_names)
    runtime = [n for n in names if n not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise ValueError(f"{fn.__name__}: {len(launch.args)} arguments for {len(runtime)}")
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for name, arg in zip(runtime, launch.args):
        i = names.index(name)
        if isinstance(arg, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[arg.dtype]
            if arg.storage_offset() * arg.element_size() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int):
            if arg == 1:
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            if arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(arg, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: cannot specialise {type(arg).__name__}")
    for name in constexprs:
        signature[name] = "constexpr"
    return {n: signature[n] for n in names}, constexprs, attrs


@dataclass(frozen=True)
class Job:
    module: str
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    arch: str
    bulk_args: tuple[str, ...]

    def key(self) -> tuple:
        return (
            self.kernel,
            self.arch,
            tuple(self.signature.items()),
            tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
            tuple(sorted(self.attrs)),
            tuple(sorted(self.options.items())),
        )


def job_for(launch, arch: str, bulk_names: set[str] = frozenset()) -> Job:
    """The compile job of one recorded launch for `arch`; `bulk_names`: the arguments whose
    load width the check reports (those that are tensors in this launch)."""
    signature, constexprs, attrs = specialise(launch)
    runtime = [a for a in launch.kernel.arg_names if a not in launch.constexprs]
    bulk = tuple(
        a
        for a, value in zip(runtime, launch.args)
        if a in bulk_names and isinstance(value, torch.Tensor)
    )
    fn = launch.kernel.fn
    return Job(fn.__module__, fn.__name__, signature, constexprs, attrs, launch.options, arch, bulk)


def collect(args: argparse.Namespace) -> tuple[dict[tuple, dict], int]:
    """Distinct compile jobs (with the cases that launch them) and the number of launches."""
    from specdec.kernels.utils import WEIGHT_FORMATS, recording

    jobs: dict[tuple, dict] = {}
    n_launches = 0
    for name, make_cases in CASES.items():
        if args.kernel and name not in args.kernel:
            continue
        extra = (args.formats,) if name == "gemv" else ()
        for case in make_cases(args.models, args.quick, *extra):
            packed = set(WEIGHT_FORMATS[case.fmt].packed_args) if case.fmt else set()
            for arch in args.arch:
                with recording(ARCHS[arch]["sms"], args.device) as launches:
                    case.run()
                for launch in launches:
                    n_launches += 1
                    job = job_for(launch, arch, packed | BULK_ARGS)
                    entry = jobs.setdefault(job.key(), {"job": job, "cases": [], "grids": set()})
                    entry["cases"].append(case)
                    entry["grids"].add(launch.grid)
    return jobs, n_launches


# ---------------------------------------------------------------------------------------
# compile + inspect (runs in worker processes)


def tool(name: str) -> str:
    """A CUDA tool from the triton wheel (triton >= 3.6 ships ptxas, nvdisasm, cuobjdump)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    path = bin_dir / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found in {bin_dir}")
    return str(path)


def ptxas_log(ptx: str, workdir: Path) -> str:
    """`ptxas -v` output for this PTX, from the first ptxas of the wheel that accepts its
    PTX version (triton 3.9 compiles with ptxas-blackwell, 3.6 ships one ptxas)."""
    gpu_name = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    path = workdir / "k.ptx"
    path.write_text(ptx)
    errors = []
    for name in ("ptxas-blackwell", "ptxas"):
        try:
            exe = tool(name)
        except FileNotFoundError:
            continue
        cmd = [exe, "-v", f"--gpu-name={gpu_name}", str(path), "-o", str(workdir / "k.o")]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode == 0:
            return run.stdout + run.stderr
        errors.append(f"{name}: {run.stderr.strip().splitlines()[-1:]}")
    raise RuntimeError(f"no ptxas accepted the PTX: {errors}")


def bulk_load_lines(fn, bulk_args: tuple[str, ...]) -> set[tuple[str, int]]:
    """(source file, line) of the tl.load calls whose pointer derives from `bulk_args`: names
    assigned from them are followed through the kernel body and into the `@triton.jit`
    helpers it passes them to."""
    import triton

    lines, start = inspect.getsourcelines(fn)
    src_file = inspect.getsourcefile(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    tainted = set(bulk_args)
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    changed = True
    while changed:
        changed = False
        for node in assigns:
            if names_in(node.value) & tainted:
                for target in node.targets:
                    new = names_in(target) - tainted
                    tainted |= new
                    changed |= bool(new)
    out: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if (
            isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and node.args
            and names_in(node.args[0]) & tainted
        ):
            out.update(
                (src_file, n) for n in range(node.lineno + start - 1, node.end_lineno + start)
            )
        helper = fn.__globals__.get(node.func.id) if isinstance(node.func, ast.Name) else None
        if isinstance(helper, triton.runtime.JITFunction):
            params = helper.arg_names
            hot = [p for p, a in zip(params, node.args) if names_in(a) & tainted]
            if hot:
                out |= bulk_load_lines(helper.fn, tuple(hot))
    return out


def names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


LOC_RE = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
FILE_RE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', re.M)
LOAD_RE = re.compile(r"\b(ld\.global|cp\.async\.c[ag]\.shared\.global)\S*")


def load_width(text: str) -> int:
    """Bytes moved by one PTX global load (ld.global[.v2|.v4].bN, or cp.async's cp-size)."""
    if "cp.async" in text:
        return int(text.rstrip().rstrip(";").split(",")[2].strip(), 0)
    op = LOAD_RE.search(text).group(0)
    bits = int(re.search(r"\.[bsuf](\d+)\b", op).group(1))
    vec = re.search(r"\.v(\d)\b", op)
    return bits // 8 * (int(vec.group(1)) if vec else 1)


def bulk_load_widths(ptx: str, lines: set[tuple[str, int]]) -> list[int]:
    """Widths of the global loads whose line info (`.loc`, file and line) is in `lines`. The
    PTX is read rather than the SASS: ptxas moves line info onto the loads' consumers, but
    keeps the vector widths (LDG.E.128 for ld.global.v4.b32, LDGSTS.128 for cp.async 16)."""
    files = {int(i): path for i, path in FILE_RE.findall(ptx)}
    widths, group, last = [], [], (None, None)
    for text in ptx.splitlines():
        m = LOC_RE.match(text)
        if m:
            last = (files.get(int(m.group(1))), int(m.group(2)))
            group.append(last)
        elif LOAD_RE.search(text):
            # Triton's inline-asm loads carry one .loc per `mov` that zeroes an output
            # register (line, line + 1, ...): the group's first .loc is the load's
            f, line = group[0] if group else last
            if (f, line) in lines:
                widths.append(load_width(text))
            group = []
        elif text.strip() and not text.strip().startswith(("mov", "//")):
            group = []
    return widths


SASS_INSTRUCTION = re.compile(
    r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[0-7T]\s+)?([A-Z][A-Z0-9_]*)\S*\s*([^;]*);"
)
SASS_LABEL = re.compile(r"^(\.L_x_\d+):")


def largest_loop(sass: str) -> int | None:
    """Instructions in the largest loop of an `nvdisasm -c` listing: the span from a label
    to a branch back to it (a GEMV's K loop, software pipelining's steady state included);
    None for straight-line code."""
    addrs, labels, pending, branches = [], {}, [], []
    for line in sass.splitlines():
        label = SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        ins = SASS_INSTRUCTION.match(line)
        if not ins:
            continue
        addr = int(ins.group(1), 16)
        labels.update((name, addr) for name in pending)
        pending = []
        addrs.append(addr)
        target = re.search(r"\((\.L_x_\d+)\)", ins.group(3)) if ins.group(2) == "BRA" else None
        if target:
            branches.append((addr, target.group(1)))
    sizes = [  # a branch to itself is the trap after EXIT, not a loop
        sum(labels[t] <= a <= addr for a in addrs)
        for addr, t in branches
        if labels.get(t, addr) < addr
    ]
    return max(sizes, default=None)


def sass_listing(cubin: bytes, workdir: Path) -> str:
    path = workdir / "k.cubin"
    path.write_bytes(cubin)
    run = subprocess.run([tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {run.stderr.strip()[-200:]}")
    return run.stdout


def compile_job(job: Job) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    t0 = time.perf_counter()
    fn = getattr(importlib.import_module(job.module), job.kernel)
    arch = ARCHS[job.arch]
    try:
        src = triton.compiler.ASTSource(
            fn=fn, signature=job.signature, constexprs=job.constexprs, attrs=job.attrs
        )
        target = GPUTarget("cuda", arch["cc"], 32)
        compiled = triton.compile(src, target=target, options=job.options)
    except Exception as e:  # noqa: BLE001 - every failure is a row of the report
        first = str(e).strip().splitlines() or [type(e).__name__]
        return {"error": f"{type(e).__name__}: {first[-1][:200]}"}
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        log = ptxas_log(ptx, Path(tmp))
        loop = largest_loop(sass_listing(compiled.asm["cubin"], Path(tmp)))
    lines = bulk_load_lines(fn.fn, job.bulk_args)
    widths = bulk_load_widths(ptx, lines)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill_st = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    spill_ld = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", log))
    shared = int(compiled.metadata.shared)
    warps = int(compiled.metadata.num_warps)
    return {
        "registers": regs,
        "spill_bytes": spill_st + spill_ld,
        "shared": shared,
        "occupancy": occupancy(arch, regs, shared, warps),
        "bulk_load_bytes": min(widths) if widths else None,
        "bulk_loads": len(widths),
        "loop_instructions": loop,
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def occupancy(arch: dict, regs: int, shared: int, warps: int) -> float:
    """Resident warps / max warps per SM (registers allocated per warp in units of 256)."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    blocks = min(32, arch["warps"] // warps, arch["regs"] // (regs_per_warp * warps))
    if shared:
        blocks = min(blocks, arch["smem_sm"] // (shared + 1024))  # 1 KB reserved per block
    return round(blocks * warps / arch["warps"], 3)


# ---------------------------------------------------------------------------------------
# report


def problems(row: dict, arch: dict, min_bytes: int | None) -> list[str]:
    if "error" in row:
        return ["compile failed"]
    out = []
    if row["spill_bytes"] and row["dtype"] != "fp32":
        out.append("spills")
    if row["shared"] > arch["smem_block"]:
        out.append("shared memory")
    if min_bytes and row["bulk_load_bytes"] is not None and row["bulk_load_bytes"] < min_bytes:
        out.append(f"loads < {min_bytes} B")
    return out


def gemv_k_tile(c: dict) -> int | None:
    """Weights along K one iteration of a GEMV kernel's K loop reads per row."""
    if "BLOCK_K" in c:
        return c["BLOCK_K"]
    if "TILE_GROUPS" in c and "TILE_GROUP" in c:
        return c["TILE_GROUPS"] * c["TILE_GROUP"]
    if "NSUB" in c and "SUBLEN" in c:  # the k-quant kernel before 2026-12-06 (f97eed1)
        return c["NSUB"] * c["SUBLEN"]
    return None


def loop_instructions_per_kb(row: dict, constexprs: dict, bytes_per_weight: float | None):
    """Warp instructions the K loop issues per KB of packed weight it reads (None where the
    row is no tiled GEMV): loop instructions x warps / (BLOCK_N x K tile x bytes/weight)."""
    k_tile, block_n = gemv_k_tile(constexprs), constexprs.get("BLOCK_N")
    if not (row.get("loop_instructions") and k_tile and block_n and bytes_per_weight):
        return None
    kb = block_n * k_tile * bytes_per_weight / 1024
    return round(row["loop_instructions"] * row["num_warps"] / kb, 1)


def constexpr_summary(c: dict) -> str:
    keep = (
        "BLOCK",
        "TILE",
        "USE_DOT",
        "BITS",
        "FMT",
        "HALF",
        "HALVES",
        "SUBLEN",
        "SPLIT",
        "HAS_TREE",
    )
    keep += ("DOT_PRECISION",)
    return " ".join(f"{k}={v}" for k, v in sorted(c.items()) if k.startswith(keep))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sm_90"], choices=sorted(ARCHS))
    parser.add_argument("--kernel", nargs="+", choices=sorted(CASES), help="only these kernels")
    parser.add_argument("--models", nargs="+", default=list(MODEL_SHAPES), choices=MODEL_SHAPES)
    parser.add_argument("--formats", nargs="+", help="GEMV: only these weight formats")
    parser.add_argument("--quick", action="store_true", help="a small subset (the test suite's)")
    parser.add_argument(
        "--device",
        default="",
        help="GEMV configurations as on this CUDA device name, e.g. 'NVIDIA H200': its tuned "
        "table (specdec/kernels/configs, or $SPECDEC_GEMV_TUNING) replaces the heuristic",
    )
    parser.add_argument(
        "--kquant-layout",
        choices=("halves", "elements"),
        help="every k-quant GEMV tile in this layout (kquant_gemv.tile_layout) instead of the "
        "installed triton's defaults (kquant_gemv.DEFAULT_LAYOUT)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None, help="results dir (benchmarks/results)")
    parser.add_argument("--name", default="compile_check", help="results file name")
    args = parser.parse_args(argv)
    if args.quick and args.models == list(MODEL_SHAPES):
        args.models = ["smollm2-135m"]

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: compile_check compiles for a GPU: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    cache = tempfile.mkdtemp(prefix="specdec-compile-check-")
    os.environ["TRITON_CACHE_DIR"] = cache  # nothing cached outside tmp
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        import_kernel_modules()
        from specdec.kernels.utils import WEIGHT_FORMATS

        unknown = sorted(set(args.formats or ()) - set(WEIGHT_FORMATS))
        if unknown:
            print(
                f"error: unknown weight formats {unknown}; registered: {sorted(WEIGHT_FORMATS)}",
                file=sys.stderr,
            )
            return 2

        t0 = time.perf_counter()
        from specdec.kernels.kquant_gemv import tile_layout

        with tile_layout(args.kquant_layout) if args.kquant_layout else contextlib.nullcontext():
            jobs, n_launches = collect(args)
        entries = list(jobs.values())
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(compile_job, [e["job"] for e in entries]))
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    fmt_min = {f.name: f.min_load_bytes for f in WEIGHT_FORMATS.values()}
    rows, failed = [], 0
    for entry, res in zip(entries, results):
        job = entry["job"]
        first = entry["cases"][0]
        packed = set(job.bulk_args) - BULK_ARGS
        fmts = {c.fmt for c in entry["cases"] if c.fmt is not None}
        min_bytes = min((fmt_min[f] for f in fmts), default=None) if packed else None
        row = {
            "arch": job.arch,
            "kernel": job.kernel,
            "dtype": first.dtype,
            "example": first.label,
            "launches": len(entry["cases"]),
            "grid": "x".join(map(str, max(entry["grids"]))),
            "num_warps": job.options["num_warps"],
            "num_stages": job.options["num_stages"],
            "config": constexpr_summary(job.constexprs),
            **res,
        }
        if first.bytes_per_weight:  # GEMV rows
            row["loop_instructions_per_kb"] = loop_instructions_per_kb(
                row, job.constexprs, first.bytes_per_weight
            )
        row["problems"] = problems(row, ARCHS[job.arch], min_bytes)
        failed += bool(row["problems"])
        rows.append(row)
    rows.sort(key=lambda r: (r["arch"], r["kernel"], r["dtype"], r["example"]))
    columns = [
        ("arch", "arch", ""),
        ("kernel", "kernel", ""),
        ("dtype", "dtype", ""),
        ("example", "example launch", ""),
        ("launches", "launches", "d"),
        ("config", "constexprs", ""),
        ("num_warps", "warps", "d"),
        ("num_stages", "stages", "d"),
        ("registers", "regs", "d"),
        ("spill_bytes", "spill B", "d"),
        ("shared", "shared B", "d"),
        ("occupancy", "occupancy", ".2f"),
        ("bulk_load_bytes", "weight/KV load B", "d"),
        ("loop_instructions", "loop instr", "d"),
        ("loop_instructions_per_kb", "loop instr/KB", ".0f"),
        ("error", "error", ""),
    ]
    print(markdown_table(rows, columns))
    done = [r for r in rows if "error" not in r]
    print(
        f"\n{n_launches} launches, {len(rows)} distinct configurations, "
        f"{len(rows) - len(done)} compile failures, {failed} with problems; "
        f"max shared {max((r['shared'] for r in done), default=0)} B, "
        f"max spills in fp16/bf16 {max((r['spill_bytes'] for r in done if r['dtype'] != 'fp32'), default=0)} B, "
        f"{time.perf_counter() - t0:.0f} s"
    )
    for r in rows:
        if r["problems"]:
            print(
                f"FAIL {r['arch']} {r['kernel']} {r['dtype']} {r['example']}: {', '.join(r['problems'])}"
            )
    path = save_results(args.name, rows, out=args.out, env=environment("cpu", archs=args.arch))
    print(f"results: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
