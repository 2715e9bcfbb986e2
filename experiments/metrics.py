"""Aggregate metrics of a run from its per-prompt rows (theory: specdec/decode/cost_model.py).

Conventions (shared/REFERENCE.md, specdec/decode/stats.py):
- acceptance_rate = accepted drafts / drafted tokens.
- alpha = accepted / (accepted + rejected rounds): the per-token acceptance of the i.i.d.
  model, in which E = (1 - alpha^(k+1)) / (1 - alpha) tokens come out of each round.
- mean_accepted_tokens = tokens emitted per round, the bonus / recovered token included.
- tokens/s = generated tokens / wall time (prefill included), summed over prompts;
  speedup = speculative tokens/s / baseline tokens/s.
- Batches (gen.batch_size > 1): the rows of one batch carry the batch's timings and forward
  counts (row["batch"]: index, size); they are counted once per batch, so tokens/s is the
  throughput summed over the batch's sequences and the speedup compares plain and
  speculative decoding at the same batch size. Per category, each sequence is charged
  its batch's time / the batch's size. Steps and rounds are batched ones: target_step_s is
  a batched plain decode step, draft and verification times are per batched round.
- c = draft step time / target step time. The draft step is the draft time per drafter
  forward (model drafters), or per draft slot (rounds * k) for drafters without a model;
  the target step is the baseline's decode time per token ((elapsed - prefill) per forward
  after the prefill). The predicted speedup (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)) also
  assumes a verification forward costs one target step; verify_ratio measures that.
  k is the configured k: with the heuristic or confidence schedule the rounds draft other
  lengths and the predictions are only indicative.
- predicted.speedup_v = E / (k c + v); predicted.batch_speedup: the lockstep-batch model of
  specdec/decode/cost_model.py (prefill, per-round overhead o, E[max rounds] over each
  batch) from this run's measured step times, against the measured plain throughput;
  batch_speedup_per_sequence_alpha: the same with each sequence's own alpha.
- alpha_dist = mean over drafted positions of alpha_i = sum_x min(p_i(x), q_i(x)), the
  acceptance the draft and target distributions allow (specdec/decode/stats.py);
  alpha_dist_examined = its mean over the positions the rule examined, of which `alpha` is
  the empirical estimate under lossless speculative sampling; predicted_from_alpha_dist =
  the cost model with alpha_dist in place of the measured alpha. None for tree rounds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from specdec.decode.cost_model import (
    expected_max_rounds,
    expected_tokens,
    predicted_speedup,
    speculative_batch_s,
)

__all__ = [
    "aggregate",
    "agreement",
    "batch_metrics",
    "batches",
    "expected_tokens",
    "predicted_speedup",
]


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """Position-wise agreement of `tokens` with `reference` (e.g. the target's greedy output):
    prefix = tokens before the first difference, matches = equal positions, compared =
    len(tokens) (positions past the reference's end count as different), reference =
    len(reference)."""
    prefix = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        prefix += 1
    matches = sum(a == b for a, b in zip(tokens, reference))
    return {
        "prefix": prefix,
        "matches": matches,
        "compared": len(tokens),
        "reference": len(reference),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def batches(rows: list[dict]) -> list[tuple[dict, list[dict], int | float]]:
    """(first row, rows, weight) per batch among `rows`: weight = the share of the batch's
    sequences present (1 when all are). Rows without "batch" (schema 1) are batches of one."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for i, r in enumerate(rows):
        b = r.get("batch")
        groups[("row", i) if b is None else ("batch", b["index"])].append(r)
    out = []
    for rs in groups.values():
        size = rs[0]["batch"]["size"] if "batch" in rs[0] else 1
        out.append((rs[0], rs, 1 if len(rs) == size else len(rs) / size))
    return out


def _batch_sum(rows: list[dict], part: str, key) -> int | float:
    """Sum of a per-batch quantity (`key` of row[part], or a function of it), once per batch."""
    get = key if callable(key) else lambda p: p[key]
    return sum(get(r[part]) * w for r, _, w in batches(rows))


def _baseline(rows: list[dict]) -> dict:
    generated = sum(len(r["baseline"]["tokens"]) for r in rows)
    elapsed = _batch_sum(rows, "baseline", "elapsed_s")
    prefill = _batch_sum(rows, "baseline", "prefill_s")
    steps = _batch_sum(rows, "baseline", lambda b: b["target_forwards"] - 1)
    return {
        "generated": generated,
        "elapsed_s": elapsed,
        "prefill_s": prefill,
        "tokens_per_second": _ratio(generated, elapsed),
        "decode_step_s": _ratio(elapsed - prefill, steps),
    }


def _speculative(rows: list[dict]) -> dict:
    specs = [r["spec"] for r in rows]
    time_s = {
        key: _batch_sum(rows, "spec", lambda s, key=key: s["time_s"][key])
        for key in specs[0]["time_s"]
    }
    rounds = sum(len(s["accepted_per_round"]) for s in specs)  # (sequence, round) pairs
    drafted = sum(sum(s["drafted_per_round"]) for s in specs)
    accepted = sum(sum(s["accepted_per_round"]) for s in specs)
    rejected = sum(
        a < d for s in specs for a, d in zip(s["accepted_per_round"], s["drafted_per_round"])
    )
    emitted = sum(len(s["tokens"]) - 1 for s in specs)  # the first token comes from prefill
    generated = sum(len(s["tokens"]) for s in specs)
    elapsed = _batch_sum(rows, "spec", "elapsed_s")
    pos_drafted: list[int] = []
    pos_accepted: list[int] = []
    for s in specs:
        for a, d in zip(s["accepted_per_round"], s["drafted_per_round"]):
            while len(pos_drafted) < d:
                pos_drafted.append(0)
                pos_accepted.append(0)
            for i in range(d):
                pos_drafted[i] += 1
                pos_accepted[i] += int(i < a)
    return {
        "generated": generated,
        "elapsed_s": elapsed,
        "tokens_per_second": _ratio(generated, elapsed),
        "time_s": time_s,
        "rounds": rounds,
        "batched_rounds": _batch_sum(rows, "spec", lambda s: s["target_forwards"] - 1),
        "drafted": drafted,
        "accepted": accepted,
        "rejected_rounds": rejected,
        "target_forwards": _batch_sum(rows, "spec", "target_forwards"),
        "draft_forwards": _batch_sum(rows, "spec", "draft_forwards"),
        "acceptance_rate": _ratio(accepted, drafted) or 0.0,
        "alpha": _ratio(accepted, accepted + rejected) or 0.0,
        "mean_accepted_tokens": _ratio(emitted, rounds) or 0.0,
        "per_position_acceptance": [a / d for a, d in zip(pos_accepted, pos_drafted)],
    }


def _core(rows: list[dict]) -> dict:
    base = _baseline(rows)
    out = {
        "n": len(rows),
        "baseline_tokens_per_second": base["tokens_per_second"],
        "spec_tokens_per_second": None,
        "speedup": None,
        "acceptance_rate": None,
        "mean_accepted_tokens": None,
    }
    if rows[0]["spec"] is not None:
        spec = _speculative(rows)
        out.update(
            spec_tokens_per_second=spec["tokens_per_second"],
            speedup=_ratio(spec["tokens_per_second"] or 0.0, base["tokens_per_second"] or 0.0),
            acceptance_rate=spec["acceptance_rate"],
            mean_accepted_tokens=spec["mean_accepted_tokens"],
        )
    return out


def _predicted_batched(
    rows: list[dict], spec: dict, base: dict, k: int, c: float, v: float | None
) -> dict:
    """The cost model with the measured verification cost and the lockstep-batch model
    (module docstring; specdec/decode/cost_model.py)."""
    t, step, rounds = spec["time_s"], base["decode_step_s"], spec["batched_rounds"]
    if not v or not rounds:
        return {"speedup_v": None, "batch_speedup": None}
    f = _ratio(spec["draft_forwards"], rounds) or k  # drafter forwards (or slots) per round
    o = t["other"] / rounds / step  # per-round work outside the forwards, in target steps
    round_steps = f * c + v + o
    alpha = spec["alpha"]
    empty = _empty_share(rows)
    spec_s = spec_seq_s = expected_rounds = 0.0
    for first, rs, _ in batches(rows):
        emitted = [len(r["spec"]["tokens"]) - 1 for r in rs]
        own = [_speculative([r])["alpha"] for r in rs]  # each sequence's acceptance
        own_empty = [_empty_share([r]) for r in rs]
        expected_rounds += expected_max_rounds(alpha, k, emitted, empty)
        prefill = first["spec"]["prefill_s"]
        spec_s += speculative_batch_s(alpha, k, emitted, step, round_steps, prefill, empty)
        spec_seq_s += speculative_batch_s(own, k, emitted, step, round_steps, prefill, own_empty)
    base_tps = base["tokens_per_second"]
    return {
        "speedup_v": predicted_speedup(alpha, k, c, v),
        "batch_speedup": spec["generated"] / spec_s / base_tps,
        "batch_speedup_per_sequence_alpha": spec["generated"] / spec_seq_s / base_tps,
        "round_steps": round_steps,
        "overhead_steps": o,
        "drafter_forwards_per_round": f,
        "batched_rounds": expected_rounds,
        "empty_round_share": empty,
        "prefill_share": _ratio(t["prefill"], spec["elapsed_s"]),
    }


def _empty_share(rows: list[dict]) -> float:
    """Share of a sequence's rounds (its last left out: the token budget may allow no
    draft there) in which the drafter proposed nothing."""
    drafted = [d for r in rows for d in r["spec"]["drafted_per_round"][:-1]]
    return _ratio(sum(d == 0 for d in drafted), len(drafted)) or 0.0


def _latency(rows: list[dict], part: str) -> dict | None:
    """Per-sequence time to its last token (prefill included): mean, median, max."""
    lat = [r[part].get("latency_s") for r in rows if r[part] is not None]
    if not lat or any(x is None for x in lat):
        return None
    return {"mean": statistics.fmean(lat), "median": statistics.median(lat), "max": max(lat)}


def batch_metrics(rows: list[dict], batch_size: int) -> dict:
    """Per-batch throughput (tokens/s summed over the batch's sequences) and per-sequence
    latency, plain and speculative."""
    groups = batches(rows)

    def part(name: str) -> dict | None:
        if rows[0][name] is None:
            return None
        tps = [
            sum(len(r[name]["tokens"]) for r in rs) / f[name]["elapsed_s"] for f, rs, _ in groups
        ]
        return {"tokens_per_second": tps, "latency_s": _latency(rows, name)}

    return {
        "batch_size": batch_size,
        "n_batches": len(groups),
        "sizes": [len(rs) for _, rs, _ in groups],
        "baseline": part("baseline"),
        "speculative": part("spec"),
    }


def _streamed_per_token(parts: list[dict]) -> float | None:
    """Bytes of streamed target weights per generated token (None: target not streamed)."""
    if not parts or any(p.get("bytes_streamed") is None for p in parts):
        return None
    return _ratio(sum(p["bytes_streamed"] for p in parts), sum(len(p["tokens"]) for p in parts))


def aggregate(rows: list[dict], k: int) -> dict:
    """The metrics of summary.json from a run's rows (see the module docstring)."""
    base = _baseline(rows)
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    out = {
        "n_prompts": len(rows),
        "baseline": base,
        "speculative": None,
        "speedup": None,
        "acceptance_rate": None,
        "alpha": None,
        "mean_accepted_tokens": None,
        "per_position_acceptance": None,
        "time_split": None,
        "target_step_s": base["decode_step_s"],
        "draft_step_s": None,
        "verify_step_s": None,
        "c": None,
        "verify_ratio": None,
        "predicted": None,
        "agreement": None,
        "per_category": {cat: _core(rs) for cat, rs in by_cat.items()},
        "bytes_streamed_per_token": {
            "baseline": _streamed_per_token([r["baseline"] for r in rows]),
            "speculative": _streamed_per_token([r["spec"] for r in rows if r["spec"]]),
        },
    }
    if rows[0]["spec"] is None:
        return out
    spec = _speculative(rows)
    t = spec["time_s"]
    draft_slots = spec["draft_forwards"] or spec["batched_rounds"] * k
    draft_step = _ratio(t["draft"], draft_slots)
    verify_step = _ratio(t["verify"], spec["batched_rounds"])
    target_step = base["decode_step_s"]
    c = _ratio(draft_step, target_step) if draft_step is not None and target_step else None
    total = sum(t.values())
    out.update(
        speculative=spec,
        speedup=_ratio(spec["tokens_per_second"] or 0.0, base["tokens_per_second"] or 0.0),
        acceptance_rate=spec["acceptance_rate"],
        alpha=spec["alpha"],
        mean_accepted_tokens=spec["mean_accepted_tokens"],
        per_position_acceptance=spec["per_position_acceptance"],
        time_split={key: _ratio(v, total) or 0.0 for key, v in t.items()},
        draft_step_s=draft_step,
        verify_step_s=verify_step,
        c=c,
        verify_ratio=_ratio(verify_step, target_step) if verify_step and target_step else None,
    )
    if c is not None:
        out["predicted"] = {
            "mean_accepted_tokens": expected_tokens(spec["alpha"], k),
            "speedup": predicted_speedup(spec["alpha"], k, c),
            **_predicted_batched(rows, spec, base, k, c, out["verify_ratio"]),
        }
    out.update(alpha_dist_metrics([r["spec"] for r in rows], k, c))
    agreements = [r["agreement"] for r in rows if r.get("agreement") is not None]
    if agreements:
        compared = sum(a["compared"] for a in agreements)
        out["agreement"] = {
            "overall": _ratio(sum(a["matches"] for a in agreements), compared) or 0.0,
            "prefix": _ratio(sum(a["prefix"] for a in agreements), compared) or 0.0,
            "identical_outputs": sum(
                a["matches"] == a["compared"] == a["reference"] for a in agreements
            )
            / len(agreements),
        }
    return out


def alpha_dist_metrics(specs: list[dict], k: int, c: float | None) -> dict:
    """alpha_dist, alpha_dist_examined and the cost model's prediction from alpha_dist over
    the spec parts of a run's rows (module docstring)."""
    out = {"alpha_dist": None, "alpha_dist_examined": None, "predicted_from_alpha_dist": None}
    drafted = sum(sum(s["drafted_per_round"]) for s in specs)
    per_round = [len(s.get("alpha_dist_per_round") or ()) for s in specs]
    if not drafted or per_round != [len(s["drafted_per_round"]) for s in specs]:
        return out  # tree rounds: not measured
    examined = sum(
        min(a + 1, d)
        for s in specs
        for a, d in zip(s["accepted_per_round"], s["drafted_per_round"])
    )
    alpha = _ratio(sum(sum(s["alpha_dist_per_round"]) for s in specs), drafted)
    out["alpha_dist"] = alpha
    out["alpha_dist_examined"] = _ratio(
        sum(sum(s["alpha_dist_examined_per_round"]) for s in specs), examined
    )
    if alpha is not None and c is not None:
        out["predicted_from_alpha_dist"] = {
            "mean_accepted_tokens": expected_tokens(alpha, k),
            "speedup": predicted_speedup(alpha, k, c),
        }
    return out
