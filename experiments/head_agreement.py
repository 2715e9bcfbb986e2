"""Teacher-forced agreement of draft heads with the target on recorded greedy outputs.

    python -m experiments.head_agreement RUN_DIR [RUN_DIR ...] --head DIR [--head DIR ...]
        [--positions 3] [--model NAME] [--dtype auto]

Every experiment point records the target's plain greedy continuation of each prompt
(results.jsonl: prompt_ids and baseline tokens). This runs the target once over each
prompt + continuation (its hidden states at the head's feature layers, its next token at
every position), then each head over the same features as in training (`train_head`'s
`step_losses`: draft position 1 reads the target's features, positions 2.. its own
outputs fed back), and prints the head's top-1 agreement with the target per draft
position on the continuation's tokens, per category and over all rows. The same number
as train_head's held-out report, on the evaluation's own text: where the two differ, the
head's training text misses the evaluation's kind of chat. It measures, it never trains:
nothing read here goes into a head.
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from pathlib import Path

import torch

from experiments.results import format_table, points_target, read_points
from specdec.cli import user_errors
from specdec.errors import SpecDecError

log = logging.getLogger("experiments.head_agreement")


@torch.inference_mode()
def target_pass(target, seq: list[int], layers) -> dict:
    """The target over one sequence -> a batch of one for `step_losses`."""
    from specdec.models.transformer import KVCache
    from specdec.train_head import _top

    x = torch.tensor([seq])
    cache = KVCache.for_model(target, 1, len(seq))
    logits, hidden = target(x, cache, torch.zeros(1, dtype=torch.long), hidden_layers=layers)
    ids, logp = _top(logits[:, 1:])
    return {"chunks": x, "feats": hidden[:, :-1].half(), "top_ids": ids, "top_logp": logp}


def agreement(
    head, index: torch.Tensor, batch: dict, n_prompt: int, positions: int
) -> tuple[torch.Tensor, ...]:
    """-> (agreement sums, counts) per draft position on the continuation's tokens (`index`:
    train_head.vocab_index(head)): position i predicts token i + 2, so the mask starts
    where that is the first continuation token."""
    from specdec.train_head import step_losses

    T = batch["chunks"].shape[1] - 1
    mask = (torch.arange(T) + 2 >= n_prompt)[None]
    with torch.no_grad():
        _, agree = step_losses(head, batch, index, positions, mask)
    w = torch.tensor([float(mask[:, i:].sum()) for i in range(positions)])
    return agree * w, w


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.head_agreement", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "runs", nargs="+", help="experiment point directories (results.jsonl + summary.json)"
    )
    p.add_argument("--head", action="append", required=True, metavar="DIR", help="a head's DIR")
    p.add_argument(
        "--positions", type=int, default=3, help="draft positions (own outputs fed back)"
    )
    p.add_argument("--model", default=None, help="the target (default: the runs' target)")
    p.add_argument("--dtype", default=None, help="the target's dtype (default: the runs')")
    return p


def main(argv: list[str] | None = None) -> None:
    from specdec.decode.heads.head import load_head
    from specdec.models.load import load_model
    from specdec.train_head import vocab_index

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    if args.positions < 1:
        raise SpecDecError(f"--positions must be >= 1, got {args.positions}")
    rows, points = [], []
    for d, got, summary in read_points(args.runs):
        if float(summary["config"]["gen"]["temperature"]) != 0.0:
            raise SpecDecError(
                f"{d}: needs a greedy run (gen.temperature=0): its outputs are sampled"
            )
        rows += got
        points.append(summary)
    model = points_target(points, args.model)
    dtype = args.dtype or points[0]["config"].get("dtype") or "auto"
    for d in args.head:
        if not (Path(d) / "head.json").is_file():
            raise SpecDecError(f"{d}: no head.json (not a head directory)")
    target, _ = load_model(model, dtype=dtype, device="cpu", batch_invariant="off")
    heads = []
    for d in args.head:
        head = load_head(d, target).float().eval()
        heads.append((d, head, vocab_index(head)))
    seen = set()
    sums = {d: defaultdict(lambda: torch.zeros(2, args.positions)) for d in args.head}
    for r in rows:
        seq = list(r["prompt_ids"]) + list(r["baseline"]["tokens"])
        key = tuple(seq)
        if key in seen or len(r["baseline"]["tokens"]) < 2:
            continue  # the same prompt in several points counts once
        seen.add(key)
        by_layers: dict = {}
        for d, head, index in heads:
            layers = head.cfg.feature_layers
            if layers not in by_layers:
                by_layers[layers] = target_pass(target, seq, layers)
            s, w = agreement(head, index, by_layers[layers], len(r["prompt_ids"]), args.positions)
            for cat in (r.get("category") or "-", "all"):
                sums[d][cat][0] += s
                sums[d][cat][1] += w
    if not seen:
        raise SpecDecError("no recorded output of at least 2 tokens in the runs")
    table = []
    for d, *_ in heads:
        for cat in sorted(sums[d], key=lambda c: (c == "all", c)):
            a, w = sums[d][cat]
            table.append(
                [
                    Path(d).name,
                    cat,
                    str(int(w[0])),
                    *(f"{x:.3f}" for x in (a / w.clamp(min=1)).tolist()),
                ]
            )
    print(
        f"{model} ({dtype}) | {len(seen)} recorded greedy outputs | teacher-forced top-1 agreement"
    )
    cols = ["head", "category", "tokens", *(f"pos {i + 1}" for i in range(args.positions))]
    print(format_table(cols, table))


if __name__ == "__main__":
    user_errors(main)()
