"""Replay a model-free drafter on recorded greedy outputs: exact acceptance, no target.

    python -m experiments.replay RUN_DIR [RUN_DIR ...] --draft datastore
        [--draft-opt p_min=0.3 ...] [--k 2,4,8] [--model NAME]

Under greedy acceptance a round's outcome depends only on the drafts and on the target's
greedy continuation, which every experiment point records (results.jsonl: prompt_ids and
baseline tokens). So the rounds of a drafter that needs no model (n-gram lookup, the
datastore) can be replayed without the target: the same k per round as the engine
(min(k, max_new_tokens - emitted - 1)), the same emission (accepted drafts + one target
token), `commit` called with the accepted counts, `finish` with each output in turn (rows in
the runs' order, as the engine met them at batch size 1). The tokens per round are exact
(tests/experiments/test_replay.py compares them with the engine's); the speedup column is
a prediction: tokens per round / (1 + rounds' verify cost), with the verify cost of T
tokens taken from the point's measured verify_ratio at its k, linear in T. Use it to tune
a drafter's options on hundreds of prompts in seconds, then measure the best ones for real.
Replaying the drafter the first run used starts from that run's drafter options (from its
summary.json); --draft-opt overrides them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import time

import torch

from experiments.results import format_table, points_target, read_points
from specdec.cli import user_errors
from specdec.cli.speculative_options import parse_options
from specdec.decode.drafters import DraftRequest, build_drafter, drafter_class
from specdec.decode.sampling import SamplingParams
from specdec.errors import SpecDecError

log = logging.getLogger("experiments.replay")


def replay(drafter, rows: list[dict], k: int, max_new: int) -> dict:
    """Greedy rounds of `drafter` over rows ({prompt_ids, tokens}) -> counts."""
    rounds = emitted = drafted = accepted = 0
    widths: list[int] = []
    t_draft = 0.0
    params = SamplingParams()
    drafter.reset()
    for r in rows:
        prompt, out = list(r["prompt_ids"]), list(r["tokens"])
        drafter.begin(None, None, [prompt], len(prompt) + max_new + k + 1)
        pos = 1  # the prefill emitted out[0]; it is pending
        while pos < len(out):
            kb = min(k, max_new - pos - 1)
            t0 = time.perf_counter()
            d = drafter.propose(DraftRequest([prompt + out[:pos]], torch.tensor([kb]), params))
            t_draft += time.perf_counter() - t0
            nd = min(int(d.n_draft[0]), kb)
            guess = d.tokens[0, :nd].tolist()
            a = 0
            while a < nd and pos + a < len(out) and guess[a] == out[pos + a]:
                a += 1
            drafter.commit(torch.tensor([a]))
            step = min(a + 1, len(out) - pos)
            rounds += 1
            emitted += step
            drafted += nd
            accepted += a
            widths.append(nd + 1)
            pos += step
        drafter.finish([out])  # as the engine does once a sequence ends
    return {
        "rounds": rounds,
        "emitted": emitted,
        "drafted": drafted,
        "accepted": accepted,
        "widths": widths,
        "draft_ms_per_round": 1000 * t_draft / max(rounds, 1),
    }


def predicted_speedup(res: dict, verify_ratio: float, k_measured: int) -> float:
    """Plain decoding's steps / the replayed rounds' verify cost, cost(T) = 1 + s (T - 1)
    with s fitted to the point's verify_ratio at T = k_measured + 1."""
    s = (verify_ratio - 1) / max(k_measured, 1)
    cost = sum(1 + s * (w - 1) for w in res["widths"])
    plain = res["emitted"]  # one step per token (the prefill's first token excluded on both)
    return plain / cost if cost else 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.replay", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "runs", nargs="+", help="experiment point directories (results.jsonl + summary.json)"
    )
    p.add_argument("--draft", default="ngram", help="a registered drafter that needs no model")
    p.add_argument("--draft-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--k", default="4", help="draft lengths, e.g. 2,4,8")
    p.add_argument("--model", default=None, help="the target whose tokenizer the drafter needs "
                   "(default: the runs' target)")  # fmt: skip
    return p


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError as e:
        raise SpecDecError(f"--k takes comma-separated integers, got {text!r}") from e
    if not ks or min(ks) < 1:
        raise SpecDecError(f"--k values must be >= 1, got {text!r}")
    return ks


def run_options(summary: dict, cls) -> dict:
    """The first run's drafter options when it ran the drafter being replayed (so a replay
    of a run's own drafter starts from its settings; --draft-opt overrides them), else {}.
    Only the options the drafter's constructor takes, its model-bound ones left out."""
    draft = (summary.get("config") or {}).get("draft") or {}
    try:
        same = bool(draft.get("kind")) and drafter_class(str(draft["kind"])) is cls
    except SpecDecError:  # a drafter this install does not have
        same = False
    if not same:
        return {}
    takes = inspect.signature(cls).parameters
    skip = {"target", "target_tokenizer"}
    return {k: v for k, v in draft.items() if k in takes and k not in skip}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    ks = parse_ks(args.k)
    cls = drafter_class(args.draft)
    if not cls.model_free:
        raise SpecDecError(
            f"drafter {args.draft!r} needs a model; replay takes n-gram-like drafters"
        )
    rows, points = [], []
    for d, got, summary in read_points(args.runs):
        if summary.get("accept") != "greedy" or summary.get("tree"):
            raise SpecDecError(f"{d}: replay needs a greedy chain run (accept=greedy, no tree)")
        rows += [{"prompt_ids": r["prompt_ids"], "tokens": r["baseline"]["tokens"]} for r in got]
        points.append(summary)
    model = points_target(points, args.model)
    max_new = int(points[0]["config"]["gen"]["max_new_tokens"])
    tok = None
    if "target_tokenizer" in inspect.signature(cls).parameters:
        from specdec.models.load import load_tokenizer

        tok = load_tokenizer(model)
    options = {**run_options(points[0], cls), **parse_options(args.draft_opt, "--draft-opt")}
    vr, km = float(points[0]["verify_ratio"]), int(points[0]["k"])
    table = []
    for k in ks:
        drafter = build_drafter(cls, None, tok, **options)
        res = replay(drafter, rows, k, max_new)
        table.append([
            args.draft, str(k), str(len(rows)), f"{res['accepted'] / max(res['drafted'], 1):.3f}",
            f"{res['emitted'] / max(res['rounds'], 1):.3f}",
            f"{res['drafted'] / max(res['rounds'], 1):.2f}", f"{res['draft_ms_per_round']:.2f}",
            f"{predicted_speedup(res, vr, km):.2f}x",
        ])  # fmt: skip
    print(
        f"{model} | replayed on {len(rows)} recorded greedy outputs | options {json.dumps(options)}"
    )
    heads = ["drafter", "k", "prompts", "accept", "tok/round", "drafted/round", "draft ms", "pred."]
    print(format_table(heads, table))
    print(f"pred.: verify cost linear in T through the runs' verify_ratio {vr:.2f} at k = {km}")


if __name__ == "__main__":
    user_errors(main)()
