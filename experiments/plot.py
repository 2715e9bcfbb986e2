"""Figures from experiment runs: `python -m experiments.plot RUN_OR_MULTIRUN_DIR... [--out DIR]`.

Reads every summary.json at or below the given folders (failed points are listed and left
out) and writes PNG + PDF figures into --out (default: <first dir>/plots):

    acceptance_vs_k        acceptance rate vs draft length k, one line per drafter
    mean_accepted_vs_k     mean accepted tokens per round vs k, with the i.i.d. theory
                           (1 - alpha^(k+1)) / (1 - alpha) from each point's measured alpha
    speedup_vs_k           wall-clock speedup vs k, with the cost-model prediction
                           (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)) from measured alpha and c,
                           and the same with the measured verification cost v in place of 1
    drafters               instead of the three above when the runs share one k (e.g.
                           experiment=pairings): the same quantities as bars per drafter
    per_position           P(draft i accepted | drafted) vs position i, one panel per drafter
    per_category           mean accepted tokens and speedup per prompt category
    threshold_tradeoff     lossy acceptance: acceptance, agreement with the greedy output
                           and speedup vs tau (only for threshold / typical points)
    accepted_vs_width      token trees: mean accepted tokens per verification vs the mean
                           verification width T, chains and trees, one panel per drafter
    speedup_vs_budget      token trees: speedup vs tree budget, one line per topk
                           (both only when some point drafted trees)
    speedup_vs_batch       batch-size sweeps (experiment=batch): speedup over plain decoding
                           at the same batch size vs gen.batch_size, best k per point, one
                           line per drafter, with the cost model's predictions from the
                           step times measured at each batch size
    best_k_vs_batch        the best k per batch size, measured and predicted
                           (both only when the points span more than one batch size)
    temperature            lossless points at several gen.temperature values (e.g.
                           experiment=temperature): measured acceptance alpha and the
                           distribution-level alpha_dist = mean sum_x min(p, q) vs
                           temperature, and the speedup with the cost model's prediction
                           from alpha_dist, one line per drafter
    pairings               experiment=pairings (points with a `pairing` config key):
                           acceptance, mean accepted tokens and speedup per pairing,
                           one bar per dataset

A "series" is the set of points whose configs differ only in the swept x (k, or tau);
series are labelled by the config keys that differ between them.
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from experiments.datasets import CATEGORY_LABELS  # noqa: E402
from experiments.metrics import expected_tokens, predicted_speedup  # noqa: E402
from experiments.results import load_summaries  # noqa: E402
from specdec.cli import ArgumentParser, setup_logging, user_errors  # noqa: E402
from specdec.errors import SpecDecError  # noqa: E402

log = logging.getLogger(__name__)

K_KEYS = ("spec.k", "schedule.k")
BATCH_KEYS = ("gen.batch_size",)
TAU_KEYS = ("accept.tau", "accept.epsilon")  # the lossy rules' x: threshold, typical
IGNORED = ("resume", "name", "gen.warmup")
LOSSY = ("threshold", "typical")


# -- grouping ---------------------------------------------------------------------------
def lossy_level(summary: dict) -> float | None:
    """The swept parameter of a lossy rule: threshold's tau, typical's epsilon."""
    accept = summary["config"]["accept"]
    return accept.get("tau", accept.get("epsilon"))


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, v in d.items():
        if key.startswith("_"):
            continue
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = v
    return out


def _short(key: str, value) -> str:
    if key in ("draft.kind", "accept.rule"):
        return str(value)
    if key in ("draft.model", "target.model"):
        return Path(str(value)).name
    return f"{key.rsplit('.', 1)[-1]}={value}"


def group_series(summaries: list[dict], x_keys: tuple[str, ...]) -> dict[str, list[dict]]:
    """label -> points whose flattened configs agree outside `x_keys` (and IGNORED).

    A series is named by its drafter kind (a draft model by its file name, a non-greedy
    rule by its name) plus the keys that differ between points of the same drafter kind;
    options that only exist for one kind (ngram_max, skip, ...) do not clutter labels."""
    flat = [flatten(s["config"]) for s in summaries]
    keys = sorted(set().union(*flat) - set(x_keys) - set(IGNORED))
    by_kind: dict = defaultdict(list)
    for f in flat:
        by_kind[f.get("draft.kind")].append(f)
    varying = [
        k
        for k in keys
        if k != "draft.kind"
        and any(len({repr(f.get(k)) for f in fs}) > 1 for fs in by_kind.values())
    ]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    labels: dict[tuple, str] = {}
    for s, f in zip(summaries, flat):
        key = tuple((k, repr(f.get(k))) for k in keys)
        parts = [str(f.get("draft.kind"))]
        if f.get("draft.model") and "draft.model" not in varying:
            parts[0] += f":{_short('draft.model', f['draft.model'])}"
        if f.get("accept.rule") not in (None, "greedy") and "accept.rule" not in varying:
            parts.append(str(f["accept.rule"]))
        parts += [_short(k, f.get(k)) for k in varying if f.get(k) is not None]
        groups[key].append(s)
        labels[key] = " ".join(parts)
    if len(set(labels.values())) < len(labels):  # same label, different configs: say why
        all_varying = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
        for key, group in groups.items():
            f = flatten(group[0]["config"])
            extra = [
                _short(k, f.get(k)) for k in all_varying if k not in varying and k != "draft.kind"
            ]
            labels[key] = " ".join([labels[key], *extra])
    return {labels[key]: pts for key, pts in groups.items()}


def subtitle(summaries: list[dict]) -> str:
    models = sorted({s["model"] for s in summaries})
    hw = sorted(
        {f"{s['environment']['hardware']} ({s['environment']['device']})" for s in summaries}
    )
    prompts = sorted({s["n_prompts"] for s in summaries})
    return (
        f"target {', '.join(models)} | {'/'.join(map(str, prompts))} prompts | "
        f"measured on {'; '.join(hw)}"
    )


def _title(ax_or_fig, title: str, summaries: list[dict], drafters: str | None = None) -> None:
    sub = subtitle(summaries)
    if drafters:
        sub = f"drafters: {drafters}\n{sub}"
    text = f"{title}\n{sub}"
    if hasattr(ax_or_fig, "suptitle"):
        ax_or_fig.suptitle(text, fontsize=10)
    else:
        ax_or_fig.set_title(text, fontsize=10)


def _save(fig, out: Path, name: str, written: list[Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        path = out / f"{name}.{ext}"
        fig.savefig(path, dpi=150 if ext == "png" else None, bbox_inches="tight")
        written.append(path)
    plt.close(fig)


def _fill_note(fig, series: dict[str, list[dict]]) -> None:
    """Footnote: the theory assumes k drafts every round; how full the rounds really were."""
    fills = []
    for label, pts in series.items():
        drafted = sum(s["speculative"]["drafted"] for s in pts)
        slots = sum(s["speculative"]["rounds"] * s["k"] for s in pts)
        fills.append(f"{label} {drafted / slots:.2f}" if slots else label)
    fig.text(
        0.01,
        -0.02,
        "theory assumes k drafts in every round; drafted / (rounds x k) measured: "
        + ", ".join(fills),
        fontsize=7,
        ha="left",
        va="top",
    )


def _colors(n: int):
    cmap = plt.get_cmap("tab10")
    return [cmap(i % 10) for i in range(n)]


# -- figures ----------------------------------------------------------------------------
def plot_vs_k(spec: list[dict], out: Path, written: list[Path]) -> None:
    series = group_series(spec, K_KEYS)
    labels = ", ".join(series)
    colors = _colors(len(series))
    ks = sorted({s["k"] for s in spec})

    # acceptance rate
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (label, pts), color in zip(series.items(), colors):
        pts = sorted(pts, key=lambda s: s["k"])
        ax.plot(
            [s["k"] for s in pts],
            [s["acceptance_rate"] for s in pts],
            "o-",
            color=color,
            label=label,
        )
    ax.set(
        xlabel="draft length k (tokens drafted per round)",
        ylabel="acceptance rate (accepted / drafted)",
    )
    ax.set_ylim(0, 1.05)
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter")
    _title(ax, "Acceptance rate vs draft length", spec, labels)
    _save(fig, out, "acceptance_vs_k", written)

    # mean accepted tokens, measured vs i.i.d. theory
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (label, pts), color in zip(series.items(), colors):
        pts = sorted(pts, key=lambda s: s["k"])
        k = [s["k"] for s in pts]
        ax.plot(k, [s["mean_accepted_tokens"] for s in pts], "o-", color=color, label=label)
        ax.plot(k, [expected_tokens(s["alpha"], s["k"]) for s in pts], "x--", color=color)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(
        xlabel="draft length k (tokens drafted per round)",
        ylabel="tokens per round (incl. bonus token)",
    )
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    style = [
        Line2D([], [], color="k", marker="o", label="measured"),
        Line2D(
            [], [], color="k", ls="--", marker="x", label="theory (1-α^(k+1))/(1-α), measured α"
        ),
        Line2D([], [], color="gray", lw=0.8, label="plain decoding (1 token)"),
    ]
    first = ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter")
    ax.add_artist(first)
    ax.legend(handles=style, fontsize=8, loc="lower left", bbox_to_anchor=(1.02, 0.0))
    _fill_note(fig, series)
    _title(ax, "Mean accepted tokens per round vs draft length", spec, labels)
    _save(fig, out, "mean_accepted_vs_k", written)

    # wall-clock speedup, measured vs cost model
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (label, pts), color in zip(series.items(), colors):
        pts = sorted((s for s in pts if s["c"] is not None), key=lambda s: s["k"])
        if not pts:
            continue
        k = [s["k"] for s in pts]
        cs = sorted(s["c"] for s in pts)
        c_text = f"c={cs[len(cs) // 2]:.2g}"  # the median over k
        ax.plot(k, [s["speedup"] for s in pts], "o-", color=color, label=f"{label} ({c_text})")
        ax.plot(k, [predicted_speedup(s["alpha"], s["k"], s["c"]) for s in pts], "x--", color=color)
        with_v = [
            expected_tokens(s["alpha"], s["k"]) / (s["k"] * s["c"] + s["verify_ratio"])
            for s in pts
            if s["verify_ratio"]
        ]
        if len(with_v) == len(pts):
            ax.plot(k, with_v, "+:", color=color, ms=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(
        xlabel="draft length k (tokens drafted per round)",
        ylabel="speedup over plain decoding (x, tokens/s ratio)",
    )
    ax.set_xticks(ks)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.grid(alpha=0.3)
    style = [
        Line2D([], [], color="k", marker="o", label="measured"),
        Line2D([], [], color="k", ls="--", marker="x", label="predicted (1-α^(k+1))/((1-α)(kc+1))"),
        Line2D(
            [],
            [],
            color="k",
            ls=":",
            marker="+",
            ms=8,
            label="predicted with measured verify cost v: .../(kc+v)",
        ),
        Line2D([], [], color="gray", lw=0.8, label="plain decoding"),
    ]
    first = ax.legend(
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        title="drafter (c = draft / target step time)",
        title_fontsize=8,
    )
    ax.add_artist(first)
    ax.legend(handles=style, fontsize=8, loc="lower left", bbox_to_anchor=(1.02, 0.0))
    _fill_note(fig, series)
    _title(ax, "Wall-clock speedup vs draft length (measured on this hardware)", spec, labels)
    _save(fig, out, "speedup_vs_k", written)


def plot_drafters(spec: list[dict], out: Path, written: list[Path]) -> None:
    """One k only (e.g. experiment=pairings): measured vs predicted per drafter, as bars."""
    series = group_series(spec, ())
    labels = list(series)
    pts = [max(p, key=lambda s: s["speedup"] or 0.0) for p in series.values()]
    x = range(len(pts))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    a_acc, a_tok, a_speed = axes
    a_acc.bar(x, [s["acceptance_rate"] for s in pts], color="tab:blue")
    a_acc.set(ylabel="acceptance rate (accepted / drafted)", ylim=(0, 1.05))
    a_acc.set_title("Acceptance rate", fontsize=9)
    a_tok.bar(x, [s["mean_accepted_tokens"] for s in pts], color="tab:blue", label="measured")
    a_tok.plot(
        x,
        [expected_tokens(s["alpha"], s["k"]) for s in pts],
        "kx",
        ms=9,
        label="theory (1-α^(k+1))/(1-α), measured α",
    )
    a_tok.axhline(1.0, color="gray", lw=0.8)
    a_tok.set(ylabel="tokens per round (incl. bonus token)")
    a_tok.set_title("Mean accepted tokens per round", fontsize=9)
    a_tok.legend(fontsize=8, loc="upper left")
    a_speed.bar(x, [s["speedup"] for s in pts], color="tab:blue", label="measured")
    with_c = [(i, s) for i, s in enumerate(pts) if s["c"] is not None]
    a_speed.plot(
        [i for i, _ in with_c],
        [predicted_speedup(s["alpha"], s["k"], s["c"]) for _, s in with_c],
        "kx",
        ms=9,
        label="predicted (1-α^(k+1))/((1-α)(kc+1))",
    )
    with_v = [(i, s) for i, s in with_c if s["verify_ratio"]]
    a_speed.plot(
        [i for i, _ in with_v],
        [
            expected_tokens(s["alpha"], s["k"]) / (s["k"] * s["c"] + s["verify_ratio"])
            for _, s in with_v
        ],
        "k+",
        ms=10,
        label="predicted with measured verify cost v",
    )
    a_speed.axhline(1.0, color="gray", lw=0.8)
    tops = [s["speedup"] for s in pts] + [
        max(map(float, ln.get_ydata()), default=0) for ln in a_speed.lines
    ]
    a_speed.set_ylim(0, 1.45 * max(tops))  # room for the legend above the markers
    a_tok.set_ylim(0, 1.3 * max(max(s["k"] + 1 for s in pts), 1))
    a_speed.set(ylabel="speedup over plain decoding (x, tokens/s ratio)")
    a_speed.set_title("Wall-clock speedup (1.0 = plain decoding)", fontsize=9)
    a_speed.legend(fontsize=8, loc="upper left")
    ticks = [
        f"{label}\nk={s['k']}, c={s['c']:.2g}" if s["c"] is not None else label
        for label, s in zip(labels, pts)
    ]
    for ax in axes:
        ax.set_xticks(list(x), ticks, fontsize=8, rotation=20, ha="right")
        ax.set_xlabel("drafter")
        ax.grid(alpha=0.3, axis="y")
    _title(fig, "Drafters at one draft length: measured vs theory", spec)
    _save(fig, out, "drafters", written)


def plot_per_position(spec: list[dict], out: Path, written: list[Path]) -> None:
    """One panel per drafter with a line per k, or one panel when each drafter has one k."""
    series = group_series(spec, K_KEYS)
    if all(len(pts) == 1 for pts in series.values()):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for (label, pts), color in zip(series.items(), _colors(len(series))):
            pos = pts[0]["per_position_acceptance"] or []
            ax.plot(
                range(1, len(pos) + 1), pos, "o-", color=color, label=f"{label} (k={pts[0]['k']})"
            )
        ax.set(xlabel="draft position i", ylabel="P(draft i accepted | drafted)", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter")
        _title(ax, "Per-position acceptance", spec)
        _save(fig, out, "per_position", written)
        return
    n = len(series)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows + 0.8), squeeze=False)
    cmap = plt.get_cmap("viridis")
    ks = sorted({s["k"] for s in spec})
    for ax, (label, pts) in zip(axes.flat, series.items()):
        for s in sorted(pts, key=lambda s: s["k"]):
            pos = s["per_position_acceptance"] or []
            if not pos:
                continue
            shade = cmap(ks.index(s["k"]) / max(1, len(ks) - 1) * 0.9)
            ax.plot(range(1, len(pos) + 1), pos, "o-", color=shade, ms=3, label=f"k={s['k']}")
        ax.set_title(label, fontsize=9)
        ax.set(xlabel="draft position i", ylabel="P(draft i accepted | drafted)")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    _title(fig, "Per-position acceptance", spec)
    _save(fig, out, "per_position", written)


def plot_per_category(spec: list[dict], out: Path, written: list[Path]) -> None:
    """Per-category bars of the best point (highest speedup) of each series."""
    series = group_series(spec, K_KEYS + TAU_KEYS)
    best = {}
    for label, pts in series.items():
        s = max(pts, key=lambda s: s["speedup"] or 0.0)
        tag = f"k={s['k']}" + (f" tau={lossy_level(s):g}" if lossy_level(s) is not None else "")
        best[f"{label} ({tag})"] = s
    cats = list(dict.fromkeys(c for s in best.values() for c in s["per_category"]))
    colors = _colors(len(best))
    width = 0.8 / len(best)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for j, metric, ylabel in (
        (0, "mean_accepted_tokens", "tokens per round (incl. bonus)"),
        (1, "speedup", "speedup over plain decoding (x)"),
    ):
        ax = axes[j]
        for i, ((label, s), color) in enumerate(zip(best.items(), colors)):
            vals = [(s["per_category"].get(c) or {}).get(metric) or 0.0 for c in cats]
            x = [n + (i - (len(best) - 1) / 2) * width for n in range(len(cats))]
            ax.bar(x, vals, width, color=color, label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        n = {
            c: max((s["per_category"].get(c) or {}).get("n", 0) for s in best.values())
            for c in cats
        }
        ticks = [f"{CATEGORY_LABELS.get(c, c)}\n(n={n[c]})" for c in cats]
        ax.set_xticks(range(len(cats)), ticks, fontsize=8, rotation=30, ha="right")
        ax.set(xlabel="prompt category", ylabel=ylabel)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title("Mean accepted tokens per round", fontsize=9)
    axes[1].set_title("Wall-clock speedup (1.0 = plain decoding)", fontsize=9)
    axes[1].legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter (best point)"
    )
    _title(fig, "Per-category results (best point of each drafter)", spec)
    _save(fig, out, "per_category", written)


def plot_threshold(lossy: list[dict], out: Path, written: list[Path]) -> None:
    series = group_series(lossy, TAU_KEYS)
    colors = _colors(len(series))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (a_acc, a_agree), (a_speed, a_trade) = axes
    for (label, pts), color in zip(series.items(), colors):
        pts = sorted(pts, key=lossy_level)
        tau = [lossy_level(s) for s in pts]
        a_acc.plot(tau, [s["acceptance_rate"] for s in pts], "o-", color=color, label=label)
        a_speed.plot(tau, [s["speedup"] for s in pts], "o-", color=color, label=label)
        agree = [s for s in pts if s["agreement"] is not None]
        if not agree:
            continue
        t_agree = [lossy_level(s) for s in agree]
        a_agree.plot(
            t_agree, [s["agreement"]["overall"] for s in agree], "o-", color=color, label=label
        )
        a_agree.plot(t_agree, [s["agreement"]["prefix"] for s in agree], "s--", color=color, ms=4)
        x = [s["agreement"]["overall"] for s in agree]
        y = [s["mean_accepted_tokens"] for s in agree]
        a_trade.plot(x, y, "o-", color=color, label=label)
        spots: dict[tuple, list[str]] = defaultdict(list)  # points on the same spot: one label
        for s, xi, yi in zip(agree, x, y):
            spots[(round(xi, 3), round(yi, 2))].append(f"{lossy_level(s):g}")
        dy = 4 - 11 * list(series).index(label)  # series' labels apart where points meet
        for (xi, yi), taus in spots.items():
            a_trade.annotate(
                ", ".join(taus),
                (xi, yi),
                fontsize=7,
                color=color,
                xytext=(5, dy),
                textcoords="offset points",
            )
    taus = sorted({lossy_level(s) for s in lossy})
    for ax in (a_acc, a_agree, a_speed):
        ax.set_xscale("log")
        ax.set_xticks(taus)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("tau (threshold: p(x) >= tau max p; typical: epsilon)")
        ax.grid(alpha=0.3)
    a_acc.set(ylabel="acceptance rate (accepted / drafted)", ylim=(0, 1.05))
    a_acc.set_title("Acceptance", fontsize=9)
    a_agree.set(ylabel="fraction of tokens equal to greedy output", ylim=(0, 1.05))
    a_agree.set_title("Agreement with the target's greedy output", fontsize=9)
    a_agree.legend(
        handles=[
            Line2D([], [], color="k", marker="o", label="same token at the same position"),
            Line2D(
                [], [], color="k", ls="--", marker="s", ms=4, label="before the first difference"
            ),
        ],
        fontsize=8,
    )
    a_speed.axhline(1.0, color="gray", lw=0.8)
    a_speed.set(ylabel="speedup over plain decoding (x)")
    a_speed.set_title("Wall-clock speedup", fontsize=9)
    a_trade.set(
        xlabel="agreement with greedy output (fraction of tokens)",
        ylabel="tokens per round (incl. bonus)",
    )
    a_trade.set_title("Trade-off (labels: tau)", fontsize=9)
    a_trade.grid(alpha=0.3)
    a_acc.legend(fontsize=8)
    _title(fig, "Lossy acceptance: threshold and typical", lossy, ", ".join(series))
    _save(fig, out, "threshold_tradeoff", written)


def _tree_label(s: dict) -> str:
    tree = s.get("tree")
    if tree is None or (tree["static"] is None and tree["topk"] == 1):
        return "chain"  # a dynamic tree of topk 1 is the chain of its depth
    return "static tree" if tree["static"] is not None else f"tree topk={tree['topk']}"


def plot_trees(spec: list[dict], out: Path, written: list[Path]) -> None:
    """Chains vs token trees per drafter: acceptance per verification width, speedup vs
    budget (module docstring)."""
    kinds = sorted({s["drafter"] for s in spec})
    labels = sorted({_tree_label(s) for s in spec}, key=lambda x: (x != "chain", x))
    colors = dict(zip(labels, _colors(len(labels))))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.8), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for label in labels:
            pts = sorted(
                (s for s in spec if s["drafter"] == kind and _tree_label(s) == label),
                key=lambda s: s["mean_verify_width"],
            )
            if pts:
                x = [s["mean_verify_width"] for s in pts]
                y = [s["mean_accepted_tokens"] for s in pts]
                ax.plot(x, y, "o-", color=colors[label], label=label)
        ax.set(
            xlabel="mean verification width T (tokens per sequence)",
            ylabel="mean accepted tokens per verification",
            title=kind,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _title(fig, "Chains vs token trees: tokens per verification vs its width", spec)
    _save(fig, out, "accepted_vs_width", written)

    trees = [s for s in spec if s.get("tree") and s["speedup"] is not None]
    if not trees:
        return
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.8), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for label in labels:
            pts = sorted(
                (s for s in trees if s["drafter"] == kind and _tree_label(s) == label),
                key=lambda s: s["tree"]["budget"],
            )
            if pts:
                x = [s["tree"]["budget"] for s in pts]
                ax.plot(x, [s["speedup"] for s in pts], "o-", color=colors[label], label=label)
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set(xlabel="tree budget (draft nodes per round)", ylabel="speedup (x)", title=kind)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _title(fig, "Token-tree speedup vs budget (measured on this hardware)", trees)
    _save(fig, out, "speedup_vs_budget", written)


# -- batch --
def batch_size(summary: dict) -> int:
    """gen.batch_size of a point (schema-1 summaries: 1)."""
    return int(summary["config"].get("gen", {}).get("batch_size", 1))


def _batch_predicted(s: dict) -> float | None:
    """The lockstep-batch cost model's speedup (specdec/decode/cost_model.py)."""
    return (s["predicted"] or {}).get("batch_speedup")


def _by_batch(pts: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for s in pts:
        out[batch_size(s)].append(s)
    return dict(sorted(out.items()))


def plot_batch(spec: list[dict], out: Path, written: list[Path]) -> None:
    """Speedup and best k vs batch size per drafter, measured vs the cost model."""
    series = group_series(spec, BATCH_KEYS + K_KEYS)
    labels = ", ".join(series)
    colors = _colors(len(series))
    sizes = sorted({batch_size(s) for s in spec})

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    best_k: dict[str, list[tuple[int, int, int | None]]] = {}
    for (label, pts), color in zip(series.items(), colors):
        rows = []
        for b, at_b in _by_batch(pts).items():
            best = max(at_b, key=lambda s: s["speedup"] or 0.0)
            with_pred = [s for s in at_b if _batch_predicted(s) is not None]
            pbest = max(with_pred, key=_batch_predicted) if with_pred else None
            rows.append((b, best, pbest))
        x = [b for b, _, _ in rows]
        ax.plot(x, [s["speedup"] for _, s, _ in rows], "o-", color=color, label=label)
        for b, s, _ in rows:
            ax.annotate(
                f"k={s['k']}",
                (b, s["speedup"]),
                fontsize=7,
                color=color,
                xytext=(4, 4),
                textcoords="offset points",
            )
        pred = [(b, _batch_predicted(p)) for b, _, p in rows if p is not None]
        if pred:
            ax.plot(*zip(*pred), "x--", color=color)
        best_k[label] = [(b, s["k"], p["k"] if p is not None else None) for b, s, p in rows]
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set(
        xlabel="batch size (prompts decoded together)",
        ylabel="speedup over plain decoding at the same batch size (x)",
    )
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.grid(alpha=0.3)
    style = [
        Line2D([], [], color="k", marker="o", label="measured, best k (labelled)"),
        Line2D(
            [],
            [],
            color="k",
            ls="--",
            marker="x",
            label="cost model, best k: prefill + E[max rounds] (f c + v + o)",
        ),
        Line2D([], [], color="gray", lw=0.8, label="plain decoding"),
    ]
    first = ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter")
    ax.add_artist(first)
    ax.legend(handles=style, fontsize=8, loc="lower left", bbox_to_anchor=(1.02, 0.0))
    fig.text(
        0.01,
        -0.02,
        "cost model from the step times measured at each batch size: c = draft / plain step, "
        "v = verification / plain step, o = other per-round work, f = drafter forwards per round",
        fontsize=7,
        ha="left",
        va="top",
    )
    _title(ax, "Speedup vs batch size (measured on this hardware)", spec, labels)
    _save(fig, out, "speedup_vs_batch", written)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    n = len(best_k)
    for i, ((label, rows), color) in enumerate(zip(best_k.items(), colors)):
        shift = 2 ** ((i - (n - 1) / 2) * 0.04)  # series side by side where they meet
        x = [b * shift for b, _, _ in rows]
        ax.plot(x, [k for _, k, _ in rows], "o-", color=color, label=label)
        pred = [(b * shift, p) for b, _, p in rows if p is not None]
        if pred:
            ax.plot(*zip(*pred), "x--", color=color, ms=9)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ks = sorted({s["k"] for s in spec})
    ax.set_yticks(ks)
    ax.set(xlabel="batch size (prompts decoded together)", ylabel="best k (of the swept k)")
    ax.grid(alpha=0.3)
    style = [
        Line2D([], [], color="k", marker="o", label="measured (highest speedup)"),
        Line2D(
            [], [], color="k", ls="--", marker="x", ms=9, label="cost model (highest predicted)"
        ),
    ]
    first = ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter")
    ax.add_artist(first)
    ax.legend(handles=style, fontsize=8, loc="lower left", bbox_to_anchor=(1.02, 0.0))
    _title(ax, "Best draft length vs batch size", spec, labels)
    _save(fig, out, "best_k_vs_batch", written)


# -- temperature --------------------------------------------------------------------------
TEMPERATURE_KEYS = ("gen.temperature",)


def temperature(summary: dict) -> float:
    return float(summary["config"]["gen"]["temperature"])


def _temperature_axis(ax, temps: list[float]) -> None:
    ax.set_xticks(temps, [("greedy\n(0)" if t == 0 else f"{t:g}") for t in temps])
    ax.set_xlabel("sampling temperature (lossless speculative sampling)")
    ax.grid(alpha=0.3)


def plot_temperature(spec: list[dict], out: Path, written: list[Path]) -> None:
    """Acceptance and speedup vs temperature per drafter: measured (solid) against the
    distribution-level alpha_dist (dashed) and the cost model's speedup from it."""
    series = group_series(spec, TEMPERATURE_KEYS)
    temps = sorted({temperature(s) for s in spec})
    fig, (a_acc, a_speed) = plt.subplots(1, 2, figsize=(13, 4.8))
    for (label, pts), color in zip(series.items(), _colors(len(series))):
        pts = sorted(pts, key=temperature)
        t = [temperature(s) for s in pts]
        a_acc.plot(t, [s["alpha"] for s in pts], "o-", color=color, label=label)
        a_speed.plot(t, [s["speedup"] for s in pts], "o-", color=color, label=label)
        dist = [s for s in pts if s.get("alpha_dist") is not None]
        a_acc.plot(
            [temperature(s) for s in dist], [s["alpha_dist"] for s in dist], "x--", color=color
        )
        seen = [s for s in dist if s.get("alpha_dist_examined") is not None]
        a_acc.plot(
            [temperature(s) for s in seen],
            [s["alpha_dist_examined"] for s in seen],
            "+:",
            color=color,
            ms=8,
        )
        pred = [s for s in dist if s.get("predicted_from_alpha_dist")]
        a_speed.plot(
            [temperature(s) for s in pred],
            [s["predicted_from_alpha_dist"]["speedup"] for s in pred],
            "x--",
            color=color,
        )
        with_c = [s for s in pts if s["c"] is not None]
        a_speed.plot(
            [temperature(s) for s in with_c],
            [predicted_speedup(s["alpha"], s["k"], s["c"]) for s in with_c],
            "+:",
            color=color,
            ms=8,
        )
    a_acc.set(ylabel="per-token acceptance α", ylim=(0, 1.05))
    a_acc.set_title("Acceptance vs temperature", fontsize=9)
    a_acc.legend(
        handles=[
            Line2D(
                [],
                [],
                color="k",
                marker="o",
                label="measured α = accepted / (accepted + rejections)",
            ),
            Line2D(
                [],
                [],
                color="k",
                ls="--",
                marker="x",
                label="α_dist = mean Σ min(p, q), drafted positions",
            ),
            Line2D(
                [], [], color="k", ls=":", marker="+", ms=8, label="α_dist over examined positions"
            ),
        ],
        fontsize=7,
        loc="lower left",
    )
    a_speed.axhline(1.0, color="gray", lw=0.8)
    a_speed.set(ylabel="speedup over plain decoding (x, tokens/s ratio)")
    a_speed.set_ylim(bottom=0)
    a_speed.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    a_speed.set_title("Wall-clock speedup vs temperature (measured on this hardware)", fontsize=9)
    first = a_speed.legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="drafter", title_fontsize=8
    )
    a_speed.add_artist(first)
    a_speed.legend(
        handles=[
            Line2D([], [], color="k", marker="o", label="measured"),
            Line2D([], [], color="k", ls="--", marker="x", label="predicted from α_dist"),
            Line2D([], [], color="k", ls=":", marker="+", ms=8, label="predicted from measured α"),
            Line2D([], [], color="gray", lw=0.8, label="plain decoding"),
        ],
        fontsize=8,
        loc="lower left",
        bbox_to_anchor=(1.02, 0.0),
        title="(1-α^(k+1)) / ((1-α)(kc+1))",
        title_fontsize=8,
    )
    for ax in (a_acc, a_speed):
        _temperature_axis(ax, temps)
    ks = sorted({s["k"] for s in spec})
    _title(fig, f"Temperature sweep (k={'/'.join(map(str, ks))})", spec, ", ".join(series))
    _save(fig, out, "temperature", written)


# -- pairings ---------------------------------------------------------------------------
def dataset_label(summary: dict) -> str:
    """specbench_mini, humaneval, ...: the dataset config's name, else its loader's."""
    cfg = summary["config"].get("dataset", {})
    name = cfg.get("name") or str(cfg.get("_target_", "?")).rsplit(".", 1)[-1]
    return name.removeprefix("load_")


def plot_pairings(spec: list[dict], out: Path, written: list[Path]) -> None:
    """experiment=pairings: acceptance, mean accepted tokens and speedup per pairing
    (config key `pairing`), one bar per dataset."""
    pairings = sorted({s["config"]["pairing"] for s in spec})
    datasets = sorted({dataset_label(s) for s in spec})
    cell = {(s["config"]["pairing"], dataset_label(s)): s for s in spec}
    colors = dict(zip(datasets, _colors(len(datasets))))
    width = 0.8 / len(datasets)
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 1.3 * len(pairings) + 6), 4.8))
    panels = [
        ("acceptance_rate", "acceptance rate (accepted / drafted target tokens)"),
        ("mean_accepted_tokens", "target tokens per verification (incl. bonus)"),
        ("speedup", "speedup over plain decoding (x)"),
    ]
    for ax, (key, ylabel) in zip(axes, panels):
        for j, ds in enumerate(datasets):
            xs, ys = [], []
            for i, p in enumerate(pairings):
                s = cell.get((p, ds))
                if s is not None and s.get(key) is not None:
                    xs.append(i + (j - (len(datasets) - 1) / 2) * width)
                    ys.append(s[key])
            ax.bar(xs, ys, width, color=colors[ds], label=ds)
        if key != "acceptance_rate":
            ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xticks(range(len(pairings)), pairings, fontsize=8, rotation=30, ha="right")
        ax.set(ylabel=ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, title="dataset", title_fontsize=8)
    axes[0].set_ylim(0, 1.05)
    _title(fig, "Draft/target pairings (configs/pairing/)", spec)
    _save(fig, out, "pairings", written)


def plot_all(dirs: list[Path], out: Path | None = None) -> list[Path]:
    """All figures the summaries below `dirs` allow -> the files written."""
    loaded = load_summaries(dirs)
    if not loaded:
        raise SpecDecError(f"no summary.json found under {', '.join(map(str, dirs))}")
    for path, s in loaded:
        if s["status"] != "ok":
            log.warning("%s: failed point left out (%s)", path, s["error"])
    ok = [s for _, s in loaded if s["status"] == "ok"]
    spec = [s for s in ok if s["speculative"] is not None]
    if not spec:
        raise SpecDecError("no speculative-decoding points to plot (only draft=none runs)")
    out = Path(out) if out else Path(dirs[0]) / "plots"
    written: list[Path] = []
    lossless = [s for s in spec if s["accept"] not in LOSSY]
    lossy = [s for s in spec if s["accept"] in LOSSY]
    if lossless:
        if len({s["k"] for s in lossless}) > 1:
            plot_vs_k(lossless, out, written)
        else:
            plot_drafters(lossless, out, written)
        plot_per_position(lossless, out, written)
        if len({temperature(s) for s in lossless}) > 1:
            plot_temperature(lossless, out, written)
    plot_per_category(spec, out, written)
    if lossy:
        plot_threshold(lossy, out, written)
    if any(s.get("tree") for s in spec):
        plot_trees([s for s in spec if s.get("mean_verify_width")], out, written)
    if len({batch_size(s) for s in lossless}) > 1:
        plot_batch(lossless, out, written)
    if any("pairing" in s["config"] for s in spec):
        plot_pairings([s for s in spec if "pairing" in s["config"]], out, written)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m experiments.plot", description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="run or multirun folders")
    p.add_argument(
        "--out", type=Path, default=None, help="figure folder (default <first dir>/plots)"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@user_errors
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    for d in args.dirs:
        if not d.is_dir():
            raise SpecDecError(f"{d}: not a folder")
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise SpecDecError(f"--out {args.out}: names a file; give a folder for the figures")
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecDecError(f"--out {args.out}: cannot create it ({e.strerror or e})") from e
    for path in plot_all(args.dirs, args.out):
        if path.suffix == ".png":
            print(path)


if __name__ == "__main__":
    main()
