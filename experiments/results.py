"""Result files of experiments/run.py: atomic writes, their schema, loading and tables.

A run folder holds
    results.jsonl  one row per prompt (ROW_SCHEMA)
    summary.json   written last; status "ok" (SUMMARY_SCHEMA) or "failed" (FAILED_SCHEMA)
A sweep folder holds one run folder per point; `load_summaries` finds them all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

# 2: gen.batch_size; rows carry their batch and per-sequence latency, summaries a "batch"
# block and the batched cost model (schema 1 summaries still load: batch size 1)
SCHEMA_VERSION = 2
RESULTS, SUMMARY = "results.jsonl", "summary.json"


# -- sweep point folders ------------------------------------------------------------------
POINT_DIR_EXCLUDE = ("experiment", "resume")


def point_dirname(overrides) -> str:
    """Folder name of a sweep point (configs/hydra/default.yaml): its overrides, sorted and
    joined by commas, without POINT_DIR_EXCLUDE; a value holding a path keeps its last part
    (target.model=/models/SmolLM2-360M -> target.model=SmolLM2-360M), so the folder stays
    one level deep. The runner checks the full config before it skips a point."""
    items = []
    for o in overrides:
        key, _, value = str(o).partition("=")
        if key.lstrip("+~") in POINT_DIR_EXCLUDE:
            continue
        if "/" in value:
            value = value.rstrip("/").rsplit("/", 1)[-1] or "_"
        items.append(f"{key}={value}")
    return ",".join(sorted(items))


OmegaConf.register_new_resolver("point_dirname", point_dirname, replace=True)


# -- atomic writes ----------------------------------------------------------------------
def _write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    """Strict JSON: a NaN or Infinity is a ValueError, never written."""
    _write_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    _write_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- schema -----------------------------------------------------------------------------
class ListOf:
    def __init__(self, item):
        self.item = item


class MapOf:
    def __init__(self, value):
        self.value = value


class OneOf:
    def __init__(self, *values):
        self.values = values


class Omittable:
    """A dict key that may be missing (files of an older schema); checked when present."""

    def __init__(self, spec):
        self.spec = spec


NUM = "number"  # int or finite float, not bool
INT = "int"  # int, not bool
ANY = "any"


def validate(obj, spec, path: str = "$") -> None:
    """Raise ValueError naming the first place where `obj` does not match `spec`: a dict
    of required keys, ListOf / MapOf / OneOf, NUM / INT / ANY, a type, None, or a tuple
    of alternatives."""
    if isinstance(spec, tuple):
        errors = []
        for alt in spec:
            try:
                return validate(obj, alt, path)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(" / ".join(errors))
    if spec is None:
        ok = obj is None
    elif spec == ANY:
        ok = True
    elif spec == NUM:  # NaN / Infinity (which json reads) are not measurements
        ok = isinstance(obj, int | float) and not isinstance(obj, bool) and math.isfinite(obj)
    elif spec == INT:
        ok = isinstance(obj, int) and not isinstance(obj, bool)
    elif isinstance(spec, OneOf):
        ok = obj in spec.values
    elif isinstance(spec, ListOf):
        if not isinstance(obj, list):
            raise ValueError(f"{path}: expected a list, got {type(obj).__name__}")
        for i, x in enumerate(obj):
            validate(x, spec.item, f"{path}[{i}]")
        return
    elif isinstance(spec, MapOf):
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: expected an object, got {type(obj).__name__}")
        for key, x in obj.items():
            validate(x, spec.value, f"{path}.{key}")
        return
    elif isinstance(spec, dict):
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: expected an object, got {type(obj).__name__}")
        for key, sub in spec.items():
            if isinstance(sub, Omittable):
                if key not in obj:
                    continue
                sub = sub.spec
            if key not in obj:
                raise ValueError(f"{path}: missing key {key!r}")
            validate(obj[key], sub, f"{path}.{key}")
        return
    else:
        ok = isinstance(obj, spec)
    if not ok:
        raise ValueError(f"{path}: {obj!r} does not match {getattr(spec, '__name__', spec)}")


TIME_SPLIT = {"prefill": NUM, "draft": NUM, "verify": NUM, "other": NUM}
# Rows of a batch (gen.batch_size > 1) share the batch's elapsed_s, prefill_s, forward
# counts and time_s; latency_s is the sequence's own time to its last token. Rows of
# schema 1 lack "batch" and latency_s (batches of one).
ROW_SCHEMA = {
    "index": INT,
    "id": str,
    "category": str,
    "prompt_ids": ListOf(INT),
    "batch": Omittable({"index": INT, "size": INT}),
    "baseline": {
        "tokens": ListOf(INT),
        "finish_reason": OneOf("stop", "length"),
        "latency_s": Omittable(NUM),
        "elapsed_s": NUM,
        "prefill_s": NUM,
        "target_forwards": INT,
        "reused": bool,
        "bytes_streamed": (None, INT),
    },
    "spec": (
        None,
        {
            "tokens": ListOf(INT),
            "finish_reason": OneOf("stop", "length"),
            "latency_s": Omittable(NUM),
            "elapsed_s": NUM,
            "prefill_s": NUM,
            "rounds": INT,
            "drafted": INT,
            "accepted": INT,
            "accepted_per_round": ListOf(INT),
            "drafted_per_round": ListOf(INT),
            "target_forwards": INT,
            "draft_forwards": INT,
            "time_s": TIME_SPLIT,
            "bytes_streamed": (None, INT),
        },
    ),
    "agreement": (None, {"prefix": INT, "matches": INT, "compared": INT, "reference": INT}),
}
CORE = {
    "n": INT,
    "baseline_tokens_per_second": (NUM, None),
    "spec_tokens_per_second": (NUM, None),
    "speedup": (NUM, None),
    "acceptance_rate": (NUM, None),
    "mean_accepted_tokens": (NUM, None),
}
ENVIRONMENT = {
    "device": str,
    "hardware": str,
    "cpu_count": (INT, None),
    "torch_threads": INT,
    "torch": str,
    "triton": (str, None),
    "python": str,
    "platform": str,
    "commit": (str, None),
    "dirty": (bool, None),
}
COMMON = {
    "schema_version": INT,
    "status": str,
    "config": dict,
    "overrides": ListOf(str),
    "environment": ENVIRONMENT,
    "started_at": str,
    "wall_s": NUM,
}
SUMMARY_SCHEMA = {
    **COMMON,
    "status": OneOf("ok"),
    "model": str,
    "drafter": str,
    "accept": (str, None),
    "schedule": (str, None),
    "k": (INT, None),
    "note": str,
    "n_prompts": INT,
    "baseline": {
        "generated": INT,
        "elapsed_s": NUM,
        "prefill_s": NUM,
        "tokens_per_second": (NUM, None),
        "decode_step_s": (NUM, None),
    },
    "speculative": (
        None,
        {
            "generated": INT,
            "elapsed_s": NUM,
            "tokens_per_second": (NUM, None),
            "time_s": TIME_SPLIT,
            "rounds": INT,
            "drafted": INT,
            "accepted": INT,
            "rejected_rounds": INT,
            "target_forwards": INT,
            "draft_forwards": INT,
        },
    ),
    "speedup": (NUM, None),
    "acceptance_rate": (NUM, None),
    "alpha": (NUM, None),
    "mean_accepted_tokens": (NUM, None),
    "per_position_acceptance": (ListOf(NUM), None),
    "time_split": (TIME_SPLIT, None),
    "target_step_s": (NUM, None),
    "draft_step_s": (NUM, None),
    "verify_step_s": (NUM, None),
    "c": (NUM, None),
    "verify_ratio": (NUM, None),
    "predicted": (None, {"mean_accepted_tokens": NUM, "speedup": NUM}),
    "agreement": (None, {"overall": NUM, "prefix": NUM, "identical_outputs": NUM}),
    "per_category": MapOf(CORE),
    "bytes_streamed_per_token": {"baseline": (NUM, None), "speculative": (NUM, None)},
    "baseline_reused": INT,
}
LATENCY = (None, {"mean": NUM, "median": NUM, "max": NUM})
BATCH_PART = (None, {"tokens_per_second": ListOf(NUM), "latency_s": LATENCY})
SUMMARY_SCHEMA_V2 = {
    **SUMMARY_SCHEMA,
    "speculative": (None, {**SUMMARY_SCHEMA["speculative"][1], "batched_rounds": INT}),
    "predicted": (
        None,
        {
            "mean_accepted_tokens": NUM,
            "speedup": NUM,
            "speedup_v": (NUM, None),
            "batch_speedup": (NUM, None),
        },
    ),
    "batch": {
        "batch_size": INT,
        "n_batches": INT,
        "sizes": ListOf(INT),
        "baseline": BATCH_PART,
        "speculative": BATCH_PART,
    },
}
FAILED_SCHEMA = {**COMMON, "status": OneOf("failed"), "error": str, "traceback": str}


def validate_row(row: dict) -> None:
    validate(row, ROW_SCHEMA)


def validate_summary(summary: dict) -> None:
    if not isinstance(summary, dict):
        raise ValueError("$: expected an object")
    if summary.get("status") == "failed":
        validate(summary, FAILED_SCHEMA)
    else:
        validate(
            summary, SUMMARY_SCHEMA if summary.get("schema_version") == 1 else SUMMARY_SCHEMA_V2
        )


# -- loading ----------------------------------------------------------------------------
def read_run(directory: Path) -> tuple[list[dict], dict]:
    """One finished run's results.jsonl rows and summary.json, both validated."""
    directory = Path(directory)
    rows = read_jsonl(directory / RESULTS)
    for r in rows:
        validate_row(r)
    summary = json.loads((directory / SUMMARY).read_text())
    validate_summary(summary)
    return rows, summary


def read_points(dirs: list[str]) -> list[tuple[str, list[dict], dict]]:
    """(dir, rows, summary) of finished experiment points named on a command line (the
    offline tools' input); SpecDecError naming the first that is unreadable or unfinished."""
    from specdec.errors import SpecDecError

    out = []
    for d in dirs:
        try:
            rows, summary = read_run(Path(d))
        except (OSError, ValueError) as e:
            raise SpecDecError(f"{d}: not a readable experiment point ({e})") from e
        if summary.get("status") != "ok":
            raise SpecDecError(f"{d}: the point did not finish (status {summary.get('status')})")
        out.append((d, rows, summary))
    return out


def points_target(summaries: list[dict], given: str | None) -> str:
    """The target the points ran, as their config named it (a registered name or a path;
    summary["model"] is only a display name), or `given`; SpecDecError when they differ."""
    from specdec.errors import SpecDecError

    models = {str(s["config"]["target"]["model"]) for s in summaries}
    if len(models) > 1 and given is None:
        raise SpecDecError(f"the runs have different targets {sorted(models)}: give --model")
    return given or models.pop()


def load_summaries(dirs: list[Path]) -> list[tuple[Path, dict]]:
    """(run folder, summary) for every summary.json at or below `dirs` (invalid ones are
    logged and left out), in path order."""
    found: dict[Path, dict] = {}
    for d in dirs:
        d = Path(d)
        paths = [d / SUMMARY] if (d / SUMMARY).is_file() else sorted(d.rglob(SUMMARY))
        for p in paths:
            try:
                s = json.loads(p.read_text())
                validate_summary(s)
            except (OSError, ValueError) as e:
                log.warning("%s: skipped (%s)", p, e)
                continue
            found[p.parent.resolve()] = s
    return sorted(found.items())


# -- tables -----------------------------------------------------------------------------
def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def point_label(summary: dict) -> str:
    cfg = summary["config"]
    label = cfg["draft"]["kind"]
    if cfg["draft"].get("model"):
        label = f"{label}:{Path(str(cfg['draft']['model'])).name}"
    rule = cfg["accept"]["rule"]
    if rule != "greedy":
        label += f" {rule}"
        for key in ("tau", "epsilon"):
            if key in cfg["accept"]:
                label += f" {key}={cfg['accept'][key]}"
    return label


def sweep_table(summaries: list[tuple[Path, dict]]) -> str:
    headers = ["point", "B", "k", "accept", "mean tok", "base tok/s", "spec tok/s", "speedup"]
    headers += ["c", "predicted"]
    rows = []
    for _, s in summaries:
        batch = s["config"].get("gen", {}).get("batch_size", 1)
        if s["status"] != "ok":
            k = s["config"].get("spec", {}).get("k")
            rows.append([point_label(s), str(batch), str(k), "failed", *["-"] * 6])
            continue
        pred = s["predicted"] or {}
        pred = pred.get("batch_speedup", pred.get("speedup"))
        rows.append(
            [
                point_label(s),
                str(batch),
                fmt(s["k"], "d"),
                fmt(s["acceptance_rate"], ".3f"),
                fmt(s["mean_accepted_tokens"]),
                fmt(s["baseline"]["tokens_per_second"], ".1f"),
                fmt(s["speculative"] and s["speculative"]["tokens_per_second"], ".1f"),
                fmt(s["speedup"]) + ("x" if s["speedup"] is not None else ""),
                fmt(s["c"], ".3f"),
                fmt(pred) + ("x" if pred is not None else ""),
            ]
        )
    return format_table(headers, rows)


EXIT_SWEEP_FAILED = 1


class SweepTableCallback(Callback):
    """Prints one table over every point of the sweep folder when a multirun ends; if any
    point failed, one error line naming them and exit code EXIT_SWEEP_FAILED."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summaries = load_summaries([sweep_dir])
        if not summaries:
            return
        ok = [s for _, s in summaries if s["status"] == "ok"]
        failed = len(summaries) - len(ok)
        hw = ok[0]["environment"]["hardware"] if ok else ""
        print(f"\nsweep {sweep_dir}: {len(ok)} points done, {failed} failed")
        print(sweep_table(summaries))
        if hw:
            print(f"speedups measured on {hw}")
        if failed:
            names = "; ".join(
                f"{path.name} ({' '.join(s['error'].split())})"
                for path, s in summaries
                if s["status"] != "ok"
            )
            print(
                f"error: {failed} of {len(summaries)} sweep points failed: {names}", file=sys.stderr
            )
            sys.exit(EXIT_SWEEP_FAILED)
