"""Prompt sets (experiments/datasets.py), metrics against the theory of shared/REFERENCE.md,
and the result-file schema checks."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from experiments.datasets import BUILTIN, CATEGORY_LABELS, interleave, load_dataset
from experiments.metrics import aggregate, agreement, expected_tokens, predicted_speedup
from experiments.results import ROW_SCHEMA, validate, validate_row, write_json, write_jsonl
from specdec.errors import SpecDecError

SPEC_BENCH = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


# -- datasets -------------------------------------------------------------------------------
def test_specbench_mini_covers_six_categories():
    lines = BUILTIN["specbench_mini"].read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    counts = Counter(r["category"] for r in rows)
    assert set(counts) == SPEC_BENCH == set(CATEGORY_LABELS)
    assert min(counts.values()) >= 8
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["messages"][-1]["role"] == "user"
        if r["category"] == "mt_bench":  # multi-turn: user, assistant, user
            assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user"]
    ds = load_dataset("specbench_mini")
    assert len(ds) == len(rows)


def test_limit_takes_prompts_round_robin_over_categories():
    ds = load_dataset("specbench_mini", limit=12)
    counts = Counter(ex.category for ex in ds.examples)
    assert set(counts) == SPEC_BENCH and set(counts.values()) == {2}
    assert [ex.category for ex in ds.examples[:6]] == [ex.category for ex in ds.examples[6:]]
    only = load_dataset("specbench_mini", categories=["rag", "qa"], limit=3)
    assert [ex.category for ex in only.examples] == ["qa", "rag", "qa"]
    with pytest.raises(SpecDecError, match="unknown categories"):
        load_dataset("specbench_mini", categories=["poetry"])


def test_interleave_keeps_order_within_categories():
    ds = load_dataset("specbench_mini")
    again = interleave(ds.examples)
    assert again == ds.examples


def test_user_files_in_every_format(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"category": "x", "prompt": "hello"}),
                json.dumps({"question_id": 81, "category": "writing", "turns": ["t1", "t2"]}),
                "",
                json.dumps(
                    {
                        "messages": [
                            {"role": "system", "content": "s"},
                            {"role": "user", "content": "u"},
                        ]
                    }
                ),
            ]
        )
    )
    ds = load_dataset("file", str(path))
    assert [ex.category for ex in ds.examples] == ["x", "writing", "default"]
    assert ds.examples[1].id == "81" and ds.examples[1].messages == (
        {"role": "user", "content": "t1"},
    )
    assert ds.examples[2].messages[0]["role"] == "system"


@pytest.mark.parametrize(
    "line,msg",
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"category": "x"}', "needs 'messages', 'prompt' or 'turns'"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages"),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}',
            "last message",
        ),
        ('{"prompt": "   "}', "empty prompt"),
    ],
)
def test_bad_user_files(tmp_path, line, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(SpecDecError, match=msg):
        load_dataset("file", str(path))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(SpecDecError, match="not found"):
        load_dataset("file", str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SpecDecError, match="no examples"):
        load_dataset("file", str(tmp_path / "empty.jsonl"))
    with pytest.raises(SpecDecError, match="chat"):
        load_dataset("specbench_mini", chat="yes")


# -- metrics --------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,k,expected", [(0.6, 2, 1.96), (0.8, 5, 3.69), (0.9, 10, 6.86)])
def test_leviathan_table_1(alpha, k, expected):
    """shared/REFERENCE.md: Leviathan et al. Table 1 (c = 0)."""
    assert expected_tokens(alpha, k) == pytest.approx(expected, abs=0.005)
    assert predicted_speedup(alpha, k, 0.0) == pytest.approx(expected, abs=0.005)


def test_theory_edges():
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert predicted_speedup(0.0, 4, 0.5) == pytest.approx(1 / 3)
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx(expected_tokens(0.8, 4) / 1.4)


def test_agreement():
    assert agreement([1, 2, 3], [1, 2, 3]) == {
        "prefix": 3,
        "matches": 3,
        "compared": 3,
        "reference": 3,
    }
    assert agreement([1, 9, 3, 4], [1, 2, 3]) == {
        "prefix": 1,
        "matches": 2,
        "compared": 4,
        "reference": 3,
    }
    assert agreement([], [1]) == {"prefix": 0, "matches": 0, "compared": 0, "reference": 1}


def fake_row(category, accepted, drafted, spec_s=1.0, base_s=2.0, n_tokens=None):
    emitted = sum(min(a + 1, d + 1) for a, d in zip(accepted, drafted))
    n = n_tokens or emitted + 1
    return {
        "index": 0,
        "id": "x",
        "category": category,
        "prompt_ids": [1, 2],
        "baseline": {
            "tokens": list(range(n)),
            "finish_reason": "length",
            "elapsed_s": base_s,
            "prefill_s": 0.2,
            "target_forwards": n,
            "reused": False,
            "bytes_streamed": None,
        },
        "spec": {
            "tokens": list(range(emitted + 1)),
            "finish_reason": "length",
            "elapsed_s": spec_s,
            "prefill_s": 0.2,
            "rounds": len(accepted),
            "drafted": sum(drafted),
            "accepted": sum(accepted),
            "accepted_per_round": accepted,
            "drafted_per_round": drafted,
            "target_forwards": len(accepted) + 1,
            "draft_forwards": 0,
            "time_s": {"prefill": 0.2, "draft": 0.04, "verify": 0.7, "other": 0.06},
            "bytes_streamed": None,
        },
        "agreement": agreement(list(range(emitted + 1)), list(range(n))),
    }


def test_aggregate_by_hand():
    rows = [fake_row("a", [2, 0, 1], [2, 2, 2]), fake_row("b", [2, 2], [2, 2])]
    for r in rows:
        validate_row(r)
    s = aggregate(rows, k=2)
    # 7 of 10 drafts accepted; rejections in 2 of 5 rounds -> alpha = 7 / 9
    assert s["acceptance_rate"] == pytest.approx(0.7)
    assert s["alpha"] == pytest.approx(7 / 9)
    assert s["per_position_acceptance"] == pytest.approx([4 / 5, 3 / 5])
    # emitted per round: (3 + 1 + 2) + (3 + 3) = 12 tokens in 5 rounds
    assert s["mean_accepted_tokens"] == pytest.approx(12 / 5)
    assert s["speculative"]["generated"] == 14 and s["baseline"]["generated"] == 14
    assert s["speedup"] == pytest.approx(2.0)  # same tokens in half the time
    # target step: (2.0 - 0.2) * 2 s over (7 - 1) * 2 forwards; ngram: draft time per slot
    assert s["target_step_s"] == pytest.approx(3.6 / 12)
    assert s["draft_step_s"] == pytest.approx(0.08 / (5 * 2))
    assert s["c"] == pytest.approx(s["draft_step_s"] / s["target_step_s"])
    assert s["verify_ratio"] == pytest.approx((1.4 / 5) / (3.6 / 12))
    assert s["predicted"]["mean_accepted_tokens"] == pytest.approx(expected_tokens(7 / 9, 2))
    assert s["agreement"]["identical_outputs"] == 1.0
    assert s["per_category"]["a"]["n"] == 1 and s["per_category"]["b"]["acceptance_rate"] == 1.0


# -- schema -----------------------------------------------------------------------------------
def test_schema_rejects_what_it_should():
    row = fake_row("a", [1], [2])
    validate_row(row)
    for breaking, msg in [
        (lambda r: r.pop("category"), "missing key 'category'"),
        (lambda r: r["baseline"].update(finish_reason="eos"), "finish_reason"),
        (lambda r: r["spec"].update(accepted_per_round=[1.5]), r"accepted_per_round\[0\]"),
        (lambda r: r["spec"].update(rounds=True), "rounds"),
        (lambda r: r.update(prompt_ids="1 2"), "prompt_ids"),
    ]:
        bad = json.loads(json.dumps(row))
        breaking(bad)
        with pytest.raises(ValueError, match=msg):
            validate(bad, ROW_SCHEMA)


def test_atomic_writes_leave_no_temporary_files(tmp_path):
    write_json(tmp_path / "s.json", {"a": 1})
    write_jsonl(tmp_path / "r.jsonl", [{"a": 1}, {"b": 2}])
    write_json(tmp_path / "s.json", {"a": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "s.json"]
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 2}
    assert (tmp_path / "r.jsonl").read_text() == '{"a": 1}\n{"b": 2}\n'
