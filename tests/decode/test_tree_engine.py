"""Tree rounds through SpeculativeDecoder: greedy decoding is token-identical to plain
greedy for every drafter kind, lossless sampling keeps the target's distribution, and the
CLI flags / configs build the tree round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.decode.drafters import make_drafter
from specdec.decode.generation import generate
from specdec.decode.sampling import SamplingParams
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.decode.tree_round import TreeSpec
from specdec.errors import SpecDecError
from tests.decode import test_tree_decode
from tests.helpers import chi2_pvalue, first_two_token_probs

models = test_tree_decode.models  # the fixture: (target, other, same, prompts) tiny models
STATIC = (0, 0, 0, 1, 1, 2, 3, 4)  # 3 root children, depth 3


def drafter_for(kind, target, other, same):
    if kind == "ngram":
        return make_drafter("ngram", target)
    if kind == "layerskip":
        return make_drafter("layerskip", target, skip="1,3")
    if kind == "early_exit":
        return make_drafter("early_exit", target, exit_layer=2, share_cache=False)
    return make_drafter("model", target, model=other if kind == "model_other" else same)


def decoder(target, drafter, depth, spec, rule="greedy"):
    return SpeculativeDecoder(
        target, drafter, rule, schedule=make_schedule("constant", depth), tree=spec
    )


KINDS = ["ngram", "layerskip", "early_exit", "model_other", "model_same"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "depth,topk,budget,B,static", [(2, 2, 3, 3, None), (4, 3, 10, 1, None), (3, 1, 3, 3, STATIC)]
)
def test_greedy_tree_rounds_equal_plain_greedy(models, kind, depth, topk, budget, B, static):
    target, other, same, prompts = models
    if static is not None and kind == "ngram":
        static = None  # n-gram tries have no static shape
    spec = TreeSpec(topk, budget, static)
    ref = generate(target, prompts[:B], 14)
    res = decoder(target, drafter_for(kind, target, other, same), depth, spec).generate(
        prompts[:B], 14
    )
    assert res.tokens == ref.tokens
    s = res.stats
    assert s["tree"] == spec.describe()
    nodes, widths = s["tree_nodes_per_round"], s["verify_width_per_round"]
    assert len(nodes) == s["rounds"] and len(widths) == s["target_forwards"] - 1
    assert max(nodes) <= (budget if static is None else len(static))
    assert all(1 <= w <= max(nodes) + 1 for w in widths)
    per_seq = [a for q in s["per_sequence"] for a in q["accepted_per_round"]]
    assert all(a <= min(depth, 3 if static else depth) for a in per_seq)
    assert s["mean_accepted_path"] == pytest.approx(sum(per_seq) / len(per_seq))
    depths = s["acceptance_per_depth"]
    assert len(depths) <= depth and all(0.0 <= a <= 1.0 for a in depths)
    if kind == "model_same":  # an identical draft model: its argmax path is always accepted
        assert s["acceptance_per_depth"][0] == 1.0
        assert s["mean_accepted_tokens"] > 1.5


@pytest.mark.parametrize("kind", ["model_same", "layerskip", "ngram"])
@pytest.mark.parametrize("max_new,stop_at", [(7, None), (16, 6), (2, None)])
def test_tree_rounds_stop_tokens_and_budgets(models, kind, max_new, stop_at):
    """A stop token inside a block an identical draft accepts (position 6) ends the
    sequence there; the budget is never exceeded."""
    target, other, same, prompts = models
    stop_ids = frozenset()
    if stop_at is not None:
        stop_ids = frozenset({generate(target, prompts[:1], 16).tokens[0][stop_at]})
    want = generate(target, prompts, max_new, stop_ids=stop_ids)
    dec = decoder(target, drafter_for(kind, target, other, same), 4, TreeSpec(2, 6))
    got = dec.generate(prompts, max_new, stop_ids=stop_ids)
    assert (got.tokens, got.finish_reasons) == (want.tokens, want.finish_reasons)


def test_tree_sampling_preserves_target_distribution(models):
    """Chi-square of the 2nd generated token (the first one drafted) of many sequences of
    one prompt, sampled through dynamic (deterministic candidates) and static (drawn
    without replacement, q recorded) trees of a draft whose q differs from p."""
    target, _, _, prompts = models
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = prompts[0]
    N = 1500
    p1, p2 = first_two_token_probs(target, prompt, params)
    for spec in [TreeSpec(2, 4), TreeSpec(2, 5, (0, 0, 1, 1, 2))]:
        drafter = make_drafter("early_exit", target, exit_layer=2, share_cache=False)
        dec = decoder(target, drafter, 2, spec, rule="speculative")
        res = dec.generate([prompt] * N, 3, params, seed=99)
        assert 0.0 < res.stats["acceptance_rate"] < 1.0
        assert chi2_pvalue(torch.tensor([t[1] for t in res.tokens]), p2) > 1e-3


def test_bad_tree_specs_and_drafters(models):
    target = models[0]
    for bad in [dict(topk=0), dict(budget=0), dict(budget=64), dict(static_parents=(1,))]:
        with pytest.raises(SpecDecError):
            TreeSpec(**bad)
    with pytest.raises(SpecDecError, match="static tree"):
        decoder(target, make_drafter("ngram", target), 2, TreeSpec(2, 4, (0, 0)))


def test_cli_tree_flags(models, tiny_dir, tmp_path, capsys):
    from specdec.generate import main

    target = models[0]
    d = str(tiny_dir("llama", False, layers=4))
    static = tmp_path / "tree.json"
    static.write_text(json.dumps(list(STATIC)))
    base = ["--model", d, "--prompt", "The quick brown fox", "--max-new-tokens", "8", "--json"]
    for extra in [
        [
            "--draft",
            "layerskip",
            "--skip",
            "1,3",
            "--k",
            "3",
            "--tree-topk",
            "2",
            "--tree-budget",
            "5",
        ],
        ["--draft", "early_exit", "--exit-layer", "2", "--k", "3", "--tree-static", str(static)],
        ["--draft", "ngram", "--tree-topk", "1", "--tree-budget", "4"],
    ]:
        main(base + extra)
        out = json.loads(capsys.readouterr().out)
        assert out["tokens"] == generate(target, [out["prompt_ids"]], 8).tokens[0]
        assert out["stats"]["tree"] is not None and "acceptance_per_depth" in out["stats"]


def test_config_tree_run(tiny_dir, tmp_path):
    """experiments.run with tree.topk / tree.budget (and tree.static inline) on a tiny
    model: lossless outputs, tree statistics in the summary."""
    from hydra import compose, initialize_config_dir

    from experiments.run import run

    prompts = tmp_path / "prompts.jsonl"
    texts = ["The quick brown fox jumps.", "1 + 2 = 3, 10 * 7 = 70"]
    prompts.write_text(
        "".join(
            json.dumps({"id": str(i), "category": "qa", "prompt": t}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    base = [
        "target=local",
        f"target.model={tiny_dir('llama', False, layers=4)}",
        "dataset=file",
        f"dataset.path={prompts}",
        "gen.max_new_tokens=8",
        "gen.warmup=false",
        "dtype=float32",  # `auto` depends on the CPU
        "draft=layerskip",
        "draft.skip=[1,3]",
        "spec.k=3",
    ]
    configs = str(Path(__file__).resolve().parents[2] / "configs")
    for i, extra in enumerate([["tree.topk=2", "tree.budget=5"], ["tree.static=[0,0,1,1,2]"]]):
        with initialize_config_dir(config_dir=configs, version_base="1.3"):
            cfg = compose("config", overrides=base + extra)
        s = run(cfg, tmp_path / str(i))
        assert s["agreement"]["identical_outputs"] == 1.0
        assert s["tree"]["budget"] == 5 and (s["tree"]["static"] is None) == (i == 0)
        assert 1.0 <= s["mean_verify_width"] <= 6.0 and 0.0 < s["mean_tree_nodes"] <= 5.0
        assert 1 <= len(s["acceptance_per_depth"]) <= 3
        assert s["acceptance_per_depth"] == pytest.approx(s["per_position_acceptance"])
    from experiments.plot import plot_all

    names = {p.name for p in plot_all([tmp_path])}
    assert {"accepted_vs_width.png", "speedup_vs_budget.png"} <= names
