"""Speculative decoding experiments: `python -m experiments.run [overrides]` (configs/).

One run loads the target and the drafter once, then for every batch of gen.batch_size
consecutive prompts of the dataset (different lengths, decoded together; a last partial
batch is decoded as it is) runs the plain baseline and speculative decoding (same
sampling, same seed: seed + index of the batch's first prompt), and writes into Hydra's
output folder
    results.jsonl  one row per prompt: category, prompt ids, both outputs, accepted and
                   drafted tokens per round, the time to its last token, its batch (index,
                   size) and the batch's timings (experiments/results.py: ROW_SCHEMA)
    summary.json   resolved config, environment, aggregate metrics (experiments/metrics.py)
both atomically once the run has finished, summary.json last (a rerun that is interrupted
leaves the old pair or the new one). It prints a per-category table.

Sweeps (`-m`) write one folder per point, named after its overrides, so the same sweep
run again skips the points whose summary.json holds the same config (resume=false
reruns them). A failing point writes summary.json with status "failed" and the error
(results.jsonl of an earlier run of that point is left as it was), the sweep goes on, and
it exits non-zero at the end, naming the failed points. In one process the points share the loaded models; with
gen.reuse_baseline=true they also share the baseline of identical (target, prompt,
sampling) settings instead of measuring it again next to each point.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.components import instantiate, make_acceptance, make_drafter
from experiments.metrics import aggregate, agreement, batch_metrics, batches
from experiments.results import (
    RESULTS,
    SCHEMA_VERSION,
    SUMMARY,
    fmt,
    format_table,
    validate_summary,
    write_json,
    write_jsonl,
)
from specdec import validation
from specdec.cli import user_errors
from specdec.decode.acceptance import AcceptanceRule
from specdec.decode.generation import generate
from specdec.decode.sampling import SamplingParams
from specdec.errors import SpecDecError
from specdec.models import batch_invariant, cpu_compile, cpu_linear

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
_BASELINES: dict[str, list[dict]] = {}  # (target, batch, sampling) -> baseline row parts


# -- environment ------------------------------------------------------------------------
def hardware_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    n = torch.get_num_threads()
    threads = f"{n} torch thread{'s' if n != 1 else ''}"
    return f"{name}{cpu_linear.isa_note()}, {os.cpu_count()} cores, {threads}"


def git_commit() -> tuple[str | None, bool | None]:
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD") or None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def environment(device: str) -> dict:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    commit, dirty = git_commit()
    return {
        "device": str(device),
        "hardware": hardware_name(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit,
        "dirty": dirty,
        "cpu_linear": cpu_linear.describe() if str(device).startswith("cpu") else None,
    }


def resolved_config(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an unresolvable interpolation: keep it as written
        return OmegaConf.to_container(cfg, resolve=False)


# -- measuring --------------------------------------------------------------------------
def check_config(cfg: DictConfig) -> None:
    """The composed config's values (Hydra overrides arrive as strings when mistyped):
    one error line before any model loads."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise SpecDecError(f"missing value: set {', '.join(k + '=...' for k in missing)}")
    validation.seed(cfg.seed, "seed")
    validation.device(str(cfg.device))
    if cfg.threads is not None:
        validation.integer(cfg.threads, "threads", minimum=0)
    validation.integer(cfg.gen.max_new_tokens, "gen.max_new_tokens", minimum=1)
    validation.sampling(cfg.gen.temperature, cfg.gen.top_k, cfg.gen.top_p, prefix="gen.")
    for key in ("gen.warmup", "gen.reuse_baseline", "gen.ignore_eos", "resume"):
        validation.boolean(OmegaConf.select(cfg, key), key)
    validation.integer(cfg.spec.k, "spec.k", minimum=1)
    validation.integer(cfg.gen.batch_size, "gen.batch_size", minimum=1)
    if cfg.dataset.get("limit") is not None:
        validation.integer(cfg.dataset.limit, "dataset.limit", minimum=0)


def sampling_params(gen: DictConfig, rule: AcceptanceRule | None) -> SamplingParams:
    params = validation.sampling(gen.temperature, gen.top_k, gen.top_p, prefix="gen.")
    if rule is not None and rule.greedy_only and params.temperature > 0:
        log.warning(
            "accept=%s decodes greedily; gen.temperature=%s is ignored", rule.name, gen.temperature
        )
        return SamplingParams()
    return params


class FinishTimes:
    """An `on_tokens` callback: when each sequence of a batch received its last token."""

    def __init__(self, batch: int):
        self.first: float | None = None  # the first call: right after the prefill
        self.last = [0.0] * batch

    def __call__(self, new: list[list[int]]) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        for b, tokens in enumerate(new):
            if tokens:
                self.last[b] = now

    def latencies(self, prefill_s: float) -> list[float]:
        """Seconds from the start of the batch to each sequence's last token."""
        return [prefill_s + (t - self.first) for t in self.last]


def run_baseline(model, batch, cfg, params, stop_ids, seed, target_key) -> list[dict]:
    """Plain decoding of one batch -> a row part per sequence (the batch's timings in each)."""
    key = json.dumps(
        [target_key, batch, cfg.gen.max_new_tokens, repr(params), sorted(stop_ids), seed]
    )
    if cfg.gen.reuse_baseline and key in _BASELINES:
        return [{**part, "reused": True} for part in _BASELINES[key]]
    clock = FinishTimes(len(batch))
    res = generate(model, batch, cfg.gen.max_new_tokens, params, stop_ids, seed, on_tokens=clock)
    _BASELINES[key] = [
        {
            "tokens": tokens,
            "finish_reason": reason,
            "latency_s": latency,
            "elapsed_s": res.elapsed_s,
            "prefill_s": res.prefill_s,
            "target_forwards": res.stats["target_forwards"],
            "bytes_streamed": res.stats.get("bytes_streamed"),
        }
        for tokens, reason, latency in zip(
            res.tokens, res.finish_reasons, clock.latencies(res.prefill_s)
        )
    ]
    return [{**part, "reused": False} for part in _BASELINES[key]]


def spec_row(res, b: int, latency_s: float) -> dict:
    """Sequence b of a speculative batch: its tokens and rounds, the batch's timings."""
    st, seq = res.stats, res.stats["per_sequence"][b]
    return {
        "tokens": res.tokens[b],
        "finish_reason": res.finish_reasons[b],
        "latency_s": latency_s,
        "elapsed_s": res.elapsed_s,
        "prefill_s": res.prefill_s,
        "rounds": seq["rounds"],
        "drafted": seq["drafted"],
        "accepted": seq["accepted"],
        "accepted_per_round": seq["accepted_per_round"],
        "drafted_per_round": seq["drafted_per_round"],
        "target_forwards": st["target_forwards"],
        "draft_forwards": st["draft_forwards"],
        "time_s": st["time_s"],
        "bytes_streamed": st.get("bytes_streamed"),
        "verify_width_per_round": st["verify_width_per_round"],
        "tree_nodes_per_round": st.get("tree_nodes_per_round"),
        # the batch's rounds per draft source (n-gram-like drafters), None for the others
        "draft_sources": st.get("draft_sources"),
        **alpha_dist_row(seq),
    }


def alpha_dist_row(seq: dict) -> dict:
    """The per-round sums of the distribution-level acceptance alpha_i (specdec/decode/stats.py)."""
    return {k: seq[k] for k in ("alpha_dist_per_round", "alpha_dist_examined_per_round")}


def tree_metrics(rows: list[dict], tree) -> dict:
    """Verification width and, for tree rounds, tree size and acceptance per depth."""
    one = [first for first, _, _ in batches(rows)]  # per-batch lists: once per batch
    widths = [w for r in one if r["spec"] for w in r["spec"]["verify_width_per_round"]]
    out = {
        "tree": None if tree is None else tree.describe(),
        "mean_verify_width": sum(widths) / len(widths) if widths else None,
    }
    if tree is not None:
        nodes = [n for r in one if r["spec"] for n in r["spec"]["tree_nodes_per_round"]]
        depths = [d for r in rows if r["spec"] for d in r["spec"]["drafted_per_round"]]
        accepted = [a for r in rows if r["spec"] for a in r["spec"]["accepted_per_round"]]
        D = max(depths, default=0)
        offered = [sum(d > i for d in depths) for i in range(D)]
        out["mean_tree_nodes"] = sum(nodes) / len(nodes) if nodes else None
        out["acceptance_per_depth"] = [
            sum(a > i for a in accepted) / o if o else 0.0 for i, o in enumerate(offered)
        ]
    return out


def warm_up_steps(model, spec, prompts: list[list[int]], size: int, n_new: int) -> int:
    """Compile (cpu_compile) or capture (CUDA graphs) every fixed-shape step the timed runs
    will meet -> how many (0 on the eager path). The static caches are sized for the longest
    prompt, so every batch reuses them; the batch size of the last, partial batch is warmed
    first, the full one last (the cache kept)."""
    from specdec.decode.generation import warm_up

    longest = max(len(p) for p in prompts)
    sizes = [len(prompts) % size] if len(prompts) % size and len(prompts) > size else []
    if model.cpu_compile:
        log.info("compiling the decode and verification steps before timing (cpu_compile)")
    t0 = time.perf_counter()
    n = 0
    for b in [*sizes, min(size, len(prompts))]:
        if spec is not None:  # first: its cache (with the verification slack) is the larger
            n += spec.warm_up(b, longest, n_new)
        n += warm_up(model, b, longest, n_new)
    if n:
        log.info("%d step shapes compiled / captured in %.0f s", n, time.perf_counter() - t0)
    return n


# devices whose prefills compile kernels per shape (Triton's JIT); on CPU a prefill runs
# eager library kernels (compiled steps never cover it), so nothing is gained there
PREFILL_WARMUP_DEVICES = ("cuda",)


class _WarmedUp(Exception):
    """Ends a warm-up generation after its first round (raised from its on_tokens)."""


def _first_rounds(n: int):
    """An on_tokens callback that stops a generation after n calls (the prefill's token is
    the first)."""
    calls = [0]

    def on_tokens(_new) -> None:
        calls[0] += 1
        if calls[0] >= n:
            raise _WarmedUp

    return on_tokens


def warm_up_prefills(model, spec, batches, n_new: int, params, seed: int) -> int:
    """Per distinct batch shape of the run, plain and speculative decoding of the batch up to
    their first round, untimed -> how many shapes: the prefill, one decode step or round
    and, for a draft model, its own prefill (its first catch-up). With the run's own token
    budget, so the static caches and compiled steps are those the timed runs use (a
    shorter budget sizes other caches, and compiled steps compile again for them).

    On a GPU the Triton kernels of a prefill are compiled per specialization of its shape
    (Triton specializes integer arguments on divisibility by 16), so without this the first
    timed run meeting a new prompt length pays seconds of compilation: the plain baseline,
    which runs first, looked slow and the speedup too large (4.67x printed for about 0.93x
    on an H200). Run on PREFILL_WARMUP_DEVICES only."""
    shapes: dict[tuple[int, int], list[list[int]]] = {}
    for batch in batches:
        shapes.setdefault((len(batch), max(len(p) for p in batch)), batch)
    t0 = time.perf_counter()
    nothing = frozenset()  # no stop tokens: the round runs whatever is generated
    # the first batch's shape last: its static caches (and their graphs) are then the ones
    # kept for the first timed run, as warm_up_steps leaves them
    runs = [functools.partial(generate, model)] + ([spec.generate] if spec is not None else [])
    for batch in reversed(list(shapes.values())):
        for run_one in runs:  # plain, then speculative
            try:
                run_one(batch, n_new, params, nothing, seed, on_tokens=_first_rounds(2))
            except _WarmedUp:
                pass
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    log.info("%d prefill shapes warmed in %.1f s", len(shapes), time.perf_counter() - t0)
    return len(shapes)


def measure(cfg: DictConfig) -> tuple[dict, list[dict]]:
    """Run the baseline and speculative decoding over the dataset -> (the summary's
    metrics, the rows of results.jsonl)."""
    from specdec.decode.speculative import SpeculativeDecoder

    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    cpu_linear.set_mode(cfg.get("cpu_linear"))
    batch_invariant.set_setting(cfg.get("batch_invariant"))
    cpu_compile.set_setting(cfg.get("cpu_compile"))
    kind = cfg.draft.kind
    rule = make_acceptance(cfg.accept) if kind != "none" else None
    params = sampling_params(cfg.gen, rule)
    model, tok = instantiate(cfg.target)
    dataset = instantiate(cfg.dataset)
    prompts = dataset.encode(tok)
    validation.seed(cfg.seed, "seed", count=len(prompts))  # prompt i runs with seed + i
    spec, schedule, tree = None, None, None
    if kind != "none":
        drafter = make_drafter(cfg.draft, model, tok)
        kind = drafter.name  # a draft model of another vocabulary becomes cross_tokenizer
        schedule = instantiate(cfg.schedule)
        tree = instantiate(cfg.tree) if cfg.get("tree") is not None else None
        spec = SpeculativeDecoder(model, drafter, rule, schedule=schedule, tree=tree)
    stop, n_new = (
        frozenset() if cfg.gen.get("ignore_eos") else tok.stop_ids,
        int(cfg.gen.max_new_tokens),
    )
    target_key = json.dumps(OmegaConf.to_container(cfg.target, resolve=True), sort_keys=True)

    size = int(cfg.gen.batch_size)
    batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    warmed_steps = warmed_prefills = 0
    if cfg.gen.warmup:  # first calls pay for allocations and lazy initialisation
        # compiled / captured steps first: their caches, sized for the longest prompt, then
        # serve the short generations below as well
        warmed_steps = warm_up_steps(model, spec, prompts, size, n_new)
        warm = [prompts[0][:32]] * min(size, len(prompts))
        generate(model, warm, min(4, n_new), params, stop, cfg.seed)
        if spec is not None:
            spec.generate(warm, min(4, n_new), params, stop, cfg.seed)
        if model.device.type in PREFILL_WARMUP_DEVICES:
            warmed_prefills = warm_up_prefills(model, spec, batches, n_new, params, int(cfg.seed))
        if spec is not None:  # no timed sequence drafts from a warm-up's output
            spec.drafter.reset()

    label = kind if spec is None else f"{kind} k={cfg.spec.k}"
    if size > 1:
        label += f" batch={size}"
    if len(prompts) % size:
        log.info(
            "%d prompts in batches of %d: the last batch holds %d (decoded as it is)",
            len(prompts),
            size,
            len(prompts) % size,
        )
    rows: list[dict] = []
    accepted = drafted = 0
    bar = tqdm(total=len(prompts), desc=label, unit="prompt", file=sys.stderr, leave=False)
    for j, batch in enumerate(batches):
        start = j * size
        seed = int(cfg.seed) + start
        base = run_baseline(model, batch, cfg, params, stop, seed, target_key)
        if spec is not None:
            clock = FinishTimes(len(batch))
            res = spec.generate(batch, n_new, params, stop, seed, on_tokens=clock)
            latencies = clock.latencies(res.prefill_s)
        for b, ids in enumerate(batch):
            ex = dataset.examples[start + b]
            row = {
                "index": start + b,
                "id": ex.id,
                "category": ex.category,
                "prompt_ids": ids,
                "batch": {"index": j, "size": len(batch)},
                "baseline": base[b],
                "spec": None,
                "agreement": None,
            }
            if spec is not None:
                row["spec"] = spec_row(res, b, latencies[b])
                if params.greedy:
                    row["agreement"] = agreement(res.tokens[b], base[b]["tokens"])
                accepted += row["spec"]["accepted"]
                drafted += row["spec"]["drafted"]
            rows.append(row)
        if spec is not None:
            bar.set_postfix(acceptance=f"{accepted / drafted:.2f}" if drafted else "-")
        bar.update(len(batch))
    bar.close()

    k = int(cfg.spec.k)
    metrics = {
        "model": Path(str(cfg.target.model)).name,
        "drafter": kind,
        "accept": rule.name if rule is not None else None,
        "schedule": schedule.name if schedule is not None else None,
        "k": k if spec is not None else None,
        "baseline_reused": sum(r["baseline"]["reused"] for r in rows),
        # what each kind of weight ran on, and whether verification rows are computed
        # exactly as decode steps (specdec.models.batch_invariant)
        "dtype": str(model.dtype).removeprefix("torch."),  # what dtype=auto resolved to
        "kernels": model.cpu_linear_report(),
        "batch_invariant": model.batch_invariant,
        "batch_invariance": model.batch_invariant_reason,
        "cpu_compile": model.cpu_compile,  # compiled decode / verification steps
        # step shapes compiled / captured before timing (gen.warmup), so none is inside
        # the timed runs
        "warmed_steps": warmed_steps,
        # distinct prefill shapes run untimed first (gen.warmup on a GPU: Triton compiles per
        # shape)
        "warmed_prefills": warmed_prefills,
        **aggregate(rows, k),
        "batch": batch_metrics(rows, size),
    }
    if spec is not None:
        metrics.update(tree_metrics(rows, tree))
        metrics["draft_sources"] = draft_sources(rows)
    return metrics, rows


def draft_sources(rows: list[dict]) -> dict | None:
    """Rounds per draft source over the run (each batch's counts once), for drafters that
    count them (n-gram-like ones: history / outputs / datastore / none); else None."""
    total: dict[str, int] = {}
    seen = set()
    for r in rows:
        got = (r.get("spec") or {}).get("draft_sources")
        if got is None or r["batch"]["index"] in seen:
            continue
        seen.add(r["batch"]["index"])
        for w, n in got.items():
            total[w] = total.get(w, 0) + int(n)
    return total or None


def compile_note(metrics: dict) -> str:
    """The summary note's word on compiled steps: warmed before timing (gen.warmup) or
    compiled inside the timed generations."""
    if not metrics.get("cpu_compile"):
        return ""
    if metrics.get("warmed_steps"):
        return f", compiled steps: {metrics['warmed_steps']} compiled before timing"
    return ", compiled steps, timings include compilation (gen.warmup=false)"


def _strict_json(obj):
    """`obj` with every NaN / Infinity float replaced by its repr (strict JSON can't hold them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict_json(v) for v in obj]
    return obj


def finished(out_dir: Path, config: dict) -> dict | None:
    """The summary of a finished point with this exact config, else None."""
    try:
        summary = json.loads((out_dir / SUMMARY).read_text())
        validate_summary(summary)
    except (OSError, ValueError):
        return None
    if summary["status"] != "ok" or summary["config"] != config:
        return None
    return summary if (out_dir / RESULTS).is_file() else None


def run(
    cfg: DictConfig, out_dir: Path, overrides: list[str] = (), raise_errors: bool = True
) -> dict:
    """One experiment point into `out_dir` -> its summary. A finished point with the same
    config is skipped (cfg.resume). On an error the summary says status "failed"; the
    error is raised again if `raise_errors`."""
    out_dir = Path(out_dir)
    config = resolved_config(cfg)
    if cfg.get("resume", True) and (done := finished(out_dir, config)) is not None:
        log.info("%s: already done, skipped (resume=false reruns it)", out_dir)
        return done
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    head = {
        "schema_version": SCHEMA_VERSION,
        "status": "ok",
        "config": config,
        "overrides": list(overrides),
        "environment": environment(cfg.get("device", "cpu")),
        "started_at": started,
    }
    try:
        metrics, rows = measure(cfg)
    except Exception as e:
        summary = {
            **head,
            "config": _strict_json(config),  # a rejected value such as nan, as a string
            "status": "failed",
            "wall_s": time.perf_counter() - t0,
            "error": f"{type(e).__name__}: {e}" if not isinstance(e, SpecDecError) else str(e),
            "traceback": traceback.format_exc(),
        }
        write_json(out_dir / SUMMARY, summary)
        if raise_errors:
            raise
        if isinstance(e, SpecDecError):
            log.error("%s: failed: %s", out_dir, e)
        else:
            log.exception("%s: failed", out_dir)
        return summary
    env = environment(cfg.device)  # torch threads as the run set them
    summary = {
        **head,
        "environment": env,
        "wall_s": time.perf_counter() - t0,
        "note": f"speedups measured on {env['hardware']} ({cfg.device}, {metrics['dtype']}, "
        f"cpu_linear={cpu_linear.resolve_mode()}"
        f"{', batch-invariant' if metrics.get('batch_invariant') else ''}"
        f"{compile_note(metrics)})",
        **metrics,
    }
    # Nothing is written until the point has finished. The old summary goes first, so an
    # interruption leaves the old results or the new ones, never one beside the other's
    # summary (a folder without summary.json is not finished: resumed, not plotted).
    validate_summary(summary)  # e.g. a NaN metric: fail before the old files are touched
    (out_dir / SUMMARY).unlink(missing_ok=True)
    write_jsonl(out_dir / RESULTS, rows)
    write_json(out_dir / SUMMARY, summary)
    return summary


def summary_table(summary: dict) -> str:
    """Per-category table of one run plus its measured cost-model quantities."""
    cats = summary["per_category"]
    rows = [[cat, *_core_cells(m)] for cat, m in cats.items()]
    overall = {
        "n": summary["n_prompts"],
        "baseline_tokens_per_second": summary["baseline"]["tokens_per_second"],
        "spec_tokens_per_second": summary["speculative"]
        and summary["speculative"]["tokens_per_second"],
        "speedup": summary["speedup"],
        "acceptance_rate": summary["acceptance_rate"],
        "mean_accepted_tokens": summary["mean_accepted_tokens"],
    }
    rows.append(["all", *_core_cells(overall)])
    headers = ["category", "n", "base tok/s", "spec tok/s", "speedup", "accept", "mean tok"]
    cfg = summary["config"]
    title = f"{summary['model']} | draft={summary['drafter']}"
    draft = cfg.get("draft") or {}
    if summary["drafter"] == "datastore":  # which store: a folder or a default corpus
        title += f"({Path(draft['path']).name if draft.get('path') else draft.get('corpus')})"
    if draft.get("reuse_outputs"):  # drafts from earlier outputs too
        title += "+outputs"
    if summary["k"] is not None:
        title += f" k={summary['k']} accept={summary['accept']} schedule={summary['schedule']}"
    title += f" | {summary['n_prompts']} prompts x <= {cfg['gen']['max_new_tokens']} new tokens"
    batch = summary.get("batch")
    if batch and batch["batch_size"] > 1:
        title += f" | batch {batch['batch_size']}"
    lines = [title, format_table(headers, rows)]
    if batch and batch["batch_size"] > 1:
        lines.append(batch_line(batch))
    if summary["c"] is not None:
        pred = summary["predicted"]
        line = (
            f"alpha={summary['alpha']:.3f}  c={summary['c']:.3f} (draft/target step)  "
            f"verify step = {fmt(summary['verify_ratio'])} target steps  "
            f"predicted: {pred['mean_accepted_tokens']:.2f} tokens/round, {pred['speedup']:.2f}x"
        )
        if pred.get("batch_speedup") is not None:
            line += (
                f", E/(kc+v) {pred['speedup_v']:.2f}x, with prefill, overhead "
                f"o={pred['overhead_steps']:.2f} steps/round and the batch's slowest "
                f"sequence {pred['batch_speedup']:.2f}x"
            )
        lines.append(line)
    if summary["agreement"] is not None:
        a = summary["agreement"]
        lines.append(
            f"agreement with greedy baseline: {a['overall']:.3f} of tokens, "
            f"{a['prefix']:.3f} before the first difference, {a['identical_outputs']:.2f} of outputs identical"
        )
    src = summary.get("draft_sources")
    if src and (src.get("outputs") or src.get("datastore")):  # more than prompt lookup
        lines.append("rounds by draft source: " + ", ".join(f"{w} {n}" for w, n in src.items()))
    lines.append(summary["note"])
    return "\n".join(lines)


def batch_line(batch: dict) -> str:
    """Per-batch throughput and per-sequence latency of a batched run, one line."""
    parts = [f"{batch['n_batches']} batches of {'/'.join(map(str, sorted(set(batch['sizes']))))}"]
    for name, key in (("plain", "baseline"), ("spec", "speculative")):
        part = batch[key]
        if part is None:
            continue
        tps = part["tokens_per_second"]
        text = f"{name}: {min(tps):.1f}-{max(tps):.1f} tok/s per batch"
        if part["latency_s"] is not None:
            lat = part["latency_s"]
            text += f", latency mean {lat['mean']:.2f} s / median {lat['median']:.2f} s"
        parts.append(text)
    return "; ".join(parts)


def _core_cells(m: dict) -> list[str]:
    return [
        str(m["n"]),
        fmt(m["baseline_tokens_per_second"], ".1f"),
        fmt(m["spec_tokens_per_second"], ".1f"),
        fmt(m["speedup"]) + ("x" if m["speedup"] is not None else ""),
        fmt(m["acceptance_rate"], ".3f"),
        fmt(m["mean_accepted_tokens"]),
    ]


def run_point(cfg: DictConfig) -> float | None:
    """The Hydra task: one run or sweep point in Hydra's output folder, table printed.
    -> the speedup (a sweeper's objective), None for a failed point or draft=none."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    out_dir = Path(hc.runtime.output_dir)
    summary = run(cfg, out_dir, list(hc.overrides.task), raise_errors=not multirun)
    if summary["status"] == "ok":
        print(summary_table(summary))
        print(f"results: {out_dir}")
    return summary.get("speedup")


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return user_errors(run_point)(cfg)


if __name__ == "__main__":
    main()
