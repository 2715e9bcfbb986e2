"""experiments/run.py on tiny models: result files against their schema, drafters and
acceptance rules end to end, resumability and failure isolation, in-process and as real
Hydra multiruns (basic and joblib launchers)."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.plot import plot_all
from experiments.results import (
    RESULTS,
    SUMMARY,
    load_summaries,
    read_jsonl,
    read_run,
    validate_summary,
)
from experiments.run import run, summary_table
from specdec.errors import SpecDecError


def test_run_writes_valid_results(compose_cfg, tiny_overrides, tmp_path):
    cfg = compose_cfg([*tiny_overrides, "spec.k=3"])
    summary = run(cfg, tmp_path)
    rows, on_disk = read_run(tmp_path)
    assert on_disk == json.loads(json.dumps(summary))
    assert len(rows) == 4 and {r["category"] for r in rows} == {"summarization", "qa"}
    assert [r["category"] for r in rows] == ["summarization", "qa", "summarization", "qa"]
    for r in rows:
        spec = r["spec"]
        assert 1 <= len(spec["tokens"]) <= 6 and len(r["baseline"]["tokens"]) <= 6
        assert spec["rounds"] == len(spec["accepted_per_round"]) == len(spec["drafted_per_round"])
        assert all(
            a <= d <= 3 for a, d in zip(spec["accepted_per_round"], spec["drafted_per_round"])
        )
        assert spec["accepted"] == sum(spec["accepted_per_round"])
        # greedy acceptance is lossless: the output is the baseline's
        assert spec["tokens"] == r["baseline"]["tokens"]
    s = summary
    assert s["status"] == "ok" and s["drafter"] == "ngram" and s["k"] == 3
    assert s["accept"] == "greedy" and s["schedule"] == "constant"
    assert s["config"]["spec"]["k"] == 3 and s["config"]["target"]["model"].endswith("target")
    env = s["environment"]
    assert env["device"] == "cpu" and env["torch"]
    assert env["torch_threads"] == torch.get_num_threads()  # threads: null leaves them as set
    assert "measured on" in s["note"]
    assert s["dtype"] == "float32" and s["batch_invariant"] is False  # auto: off in float32
    assert s["batch_invariance"].startswith("off") and s["kernels"]
    assert s["agreement"] == {"overall": 1.0, "prefix": 1.0, "identical_outputs": 1.0}
    assert 0.0 <= s["acceptance_rate"] <= 1.0 and s["mean_accepted_tokens"] >= 1.0
    assert len(s["per_position_acceptance"]) <= 3
    assert set(s["time_split"]) == {"prefill", "draft", "verify", "other"}
    assert abs(sum(s["time_split"].values()) - 1.0) < 1e-6
    assert s["c"] is not None and s["c"] >= 0 and s["speedup"] > 0
    assert s["predicted"]["mean_accepted_tokens"] >= 1.0
    assert set(s["per_category"]) == {"summarization", "qa"}
    assert sum(c["n"] for c in s["per_category"].values()) == 4
    table = summary_table(s)
    assert "speedup" in table and "all" in table and "measured on" in table


def test_model_drafter_and_lossy_rules(compose_cfg, tiny_overrides, tiny_models, tmp_path):
    draft_dir = tiny_models[1]
    cfg = compose_cfg([*tiny_overrides, "draft=model", f"draft.model={draft_dir}", "spec.k=2"])
    s = run(cfg, tmp_path / "model")
    assert s["drafter"] == "model" and s["speculative"]["draft_forwards"] > 0
    assert s["c"] > 0  # a model drafter costs something
    assert s["agreement"]["identical_outputs"] == 1.0

    cfg = compose_cfg([*tiny_overrides, "draft=layerskip", "accept=threshold", "accept.tau=0.01"])
    s = run(cfg, tmp_path / "threshold")
    assert s["accept"] == "threshold" and s["agreement"] is not None
    cfg = compose_cfg([*tiny_overrides, "accept=typical", "accept.epsilon=0.2"])
    assert run(cfg, tmp_path / "typical")["accept"] == "typical"


def test_sampling_and_schedules(compose_cfg, tiny_overrides, tmp_path):
    over = [*tiny_overrides, "accept=speculative", "gen.temperature=0.8", "schedule=heuristic"]
    s = run(compose_cfg(over), tmp_path / "sampled")
    assert s["agreement"] is None  # no greedy reference when sampling
    assert s["schedule"] == "heuristic"
    over = [*tiny_overrides, "draft=early_exit", "draft.exit_layer=1", "schedule=confidence"]
    assert run(compose_cfg(over), tmp_path / "conf")["schedule"] == "confidence"


def test_baseline_only(compose_cfg, tiny_overrides, tmp_path):
    s = run(compose_cfg([*tiny_overrides, "draft=none"]), tmp_path)
    rows, _ = read_run(tmp_path)
    assert all(r["spec"] is None for r in rows)
    assert s["speculative"] is None and s["speedup"] is None and s["k"] is None
    assert s["baseline"]["tokens_per_second"] > 0
    assert "base tok/s" in summary_table(s)


def test_chat_template_is_applied(compose_cfg, tiny_overrides, tiny_chat_model, tmp_path):
    over = [*tiny_overrides, f"target.model={tiny_chat_model}", "dataset.limit=1"]
    run(compose_cfg(over), tmp_path / "chat")
    run(compose_cfg([*over, "dataset.chat=false"]), tmp_path / "plain")
    from specdec.models.load import load_model

    _, tok = load_model(str(tiny_chat_model))
    chat_ids = read_jsonl(tmp_path / "chat" / RESULTS)[0]["prompt_ids"]
    plain_ids = read_jsonl(tmp_path / "plain" / RESULTS)[0]["prompt_ids"]
    assert tok.decode(chat_ids).startswith("<|im_start|>user\n")
    assert tok.decode(chat_ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(plain_ids) == "The quick brown fox jumps."


def test_resume_skips_finished_points(compose_cfg, tiny_overrides, tmp_path, monkeypatch):
    cfg = compose_cfg(tiny_overrides)
    first = run(cfg, tmp_path)
    import experiments.run as runner

    def boom(*a, **k):
        raise AssertionError("a finished point was measured again")

    monkeypatch.setattr(runner, "measure", boom)
    assert run(cfg, tmp_path) == json.loads(json.dumps(first))
    # a different config in the same folder is measured again, so is resume=false
    with pytest.raises(AssertionError, match="measured again"):
        run(compose_cfg([*tiny_overrides, "spec.k=2"]), tmp_path)
    with pytest.raises(AssertionError, match="measured again"):
        run(compose_cfg([*tiny_overrides, "resume=false"]), tmp_path)


def test_failed_point_is_recorded(compose_cfg, tiny_overrides, tmp_path):
    cfg = compose_cfg([*tiny_overrides, "spec.k=0"])
    s = run(cfg, tmp_path / "a", raise_errors=False)
    assert s["status"] == "failed" and "k must be >= 1" in s["error"]
    validate_summary(json.loads((tmp_path / "a" / SUMMARY).read_text()))
    assert not (tmp_path / "a" / RESULTS).exists()
    with pytest.raises(SpecDecError, match="k must be >= 1"):
        run(cfg, tmp_path / "b")
    assert json.loads((tmp_path / "b" / SUMMARY).read_text())["status"] == "failed"
    # an unexpected error is recorded with its type and traceback
    import experiments.run as runner

    def broken(*a, **k):
        raise RuntimeError("kernel exploded")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "aggregate", broken)
        s = run(compose_cfg([*tiny_overrides, "spec.k=2"]), tmp_path / "c", raise_errors=False)
    assert s["status"] == "failed" and s["error"] == "RuntimeError: kernel exploded"
    assert "kernel exploded" in s["traceback"]
    # a failed point is retried by the next run of the sweep
    fixed = run(compose_cfg([*tiny_overrides, "spec.k=1"]), tmp_path / "a")
    assert fixed["status"] == "ok"
    read_run(tmp_path / "a")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("gen.max_new_tokens=abc", "gen.max_new_tokens must be an integer, got 'abc'"),
        ("gen.max_new_tokens=0", "gen.max_new_tokens must be >= 1"),
        ("spec.k=abc", "spec.k must be an integer"),
        ("threads=abc", "threads must be an integer"),
        ("dataset.limit=abc", "dataset.limit must be an integer"),
        ("gen.temperature=nan", "gen.temperature must be a finite number"),
        ("gen.temperature=inf", "gen.temperature must be a finite number"),
        ("gen.top_p=nan", "gen.top_p must be a finite number"),
        ("gen.top_k=-1", "gen.top_k must be >= 0"),
        ("gen.warmup=maybe", "gen.warmup must be true or false"),
        (f"seed={2**64}", "seed must be below 2**64"),
        ("device=cpu:5", "one CPU device"),
    ],
)
def test_mistyped_overrides_fail_before_any_model_loads(
    compose_cfg, tiny_overrides, tmp_path, monkeypatch, override, needle
):
    import experiments.run as runner

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(runner, "instantiate", no_load)
    with pytest.raises(SpecDecError) as e:
        run(compose_cfg([*tiny_overrides, override]), tmp_path)
    assert needle in str(e.value)


def test_seed_range_covers_every_prompt(compose_cfg, tiny_overrides, tmp_path):
    with pytest.raises(SpecDecError, match="seed must be below 2\\*\\*64 - 3"):
        run(compose_cfg([*tiny_overrides, f"seed={2**64 - 2}"]), tmp_path)


def _files(d):
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def test_rerun_leaves_the_old_results_or_the_new_ones(
    compose_cfg, tiny_overrides, tmp_path, monkeypatch
):
    import experiments.run as runner

    cfg = compose_cfg(tiny_overrides)
    run(cfg, tmp_path)
    old = _files(tmp_path)
    assert set(old) == {RESULTS, SUMMARY}
    rerun = compose_cfg([*tiny_overrides, "resume=false"])
    real_generate, calls = runner.generate, []

    def interrupted(*a, **k):  # Ctrl-C in the middle of the rerun
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_generate(*a, **k)

    monkeypatch.setattr(runner, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(rerun, tmp_path)
    assert _files(tmp_path) == old
    assert {p.name for p in tmp_path.iterdir()} == {RESULTS, SUMMARY}  # no temporary left

    def failing(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "generate", failing)
    s = run(rerun, tmp_path, raise_errors=False)
    assert s["status"] == "failed"
    assert (tmp_path / RESULTS).read_bytes() == old[RESULTS]  # the old results stay whole
    assert load_summaries([tmp_path])[0][1]["status"] == "failed"

    monkeypatch.setattr(runner, "generate", real_generate)
    new = run(rerun, tmp_path)
    rows, on_disk = read_run(tmp_path)
    assert on_disk["status"] == "ok" and on_disk["started_at"] == new["started_at"]
    assert len(rows) == 4


def test_summaries_with_nan_are_skipped_by_the_plotter(compose_cfg, tiny_overrides, tmp_path):
    run(compose_cfg(tiny_overrides), tmp_path / "a")
    text = (tmp_path / "a" / SUMMARY).read_text()
    s = json.loads(text)
    (tmp_path / "a" / SUMMARY).write_text(text.replace(json.dumps(s["speedup"]), "NaN", 1))
    assert load_summaries([tmp_path]) == []
    with pytest.raises(SpecDecError, match="no summary.json"):
        plot_all([tmp_path])


@pytest.mark.slow
def test_compiled_steps_are_warmed_before_timing(
    compose_cfg, tiny_overrides, tmp_path, monkeypatch
):
    """cpu_compile=on with gen.warmup: every step shape of the timed runs (verification
    widths 1..k + 1, the decode step, the full and the last partial batch size) is compiled
    before the first timed generation, and the note says so; output stays lossless."""
    from torch._dynamo.utils import counters

    import experiments.run as runner
    from specdec.models.cpu_compile import compiler_missing

    if compiler_missing():
        pytest.skip(compiler_missing())
    seen = []
    baseline = runner.run_baseline

    def timed_baseline(*args, **kw):  # the first timed generation of each batch
        seen.append(counters["stats"]["unique_graphs"])
        return baseline(*args, **kw)

    monkeypatch.setattr(runner, "run_baseline", timed_baseline)
    over = ["cpu_compile=on", "gen.warmup=true", "gen.batch_size=3", "spec.k=2"]
    counters.clear()
    s = run(compose_cfg([*tiny_overrides, *over]), tmp_path)
    # widths 1..3 per batch size (3 and the last batch's 1; the decode step is width 1)
    assert s["cpu_compile"] is True and s["warmed_steps"] == 6
    assert seen[0] == 6 and counters["stats"]["unique_graphs"] == 6  # no compile once timed
    assert "compiled steps: 6 compiled before timing" in s["note"]
    assert s["agreement"]["identical_outputs"] == 1.0
    cold = run(compose_cfg([*tiny_overrides, *over[:1], "gen.warmup=false"]), tmp_path / "c")
    assert cold["warmed_steps"] == 0 and "timings include compilation" in cold["note"]


def test_prefill_shapes_are_warmed_before_timing(
    compose_cfg, tiny_overrides, tiny_models, tmp_path, monkeypatch
):
    """gen.warmup runs every (batch size, padded length) prefill of the timed runs, plain
    and speculative with a draft model, before the first timed generation (on a GPU the
    Triton kernels compile per shape: the first H200 main job's baseline paid 6.2 s of
    compilation inside its timing; the warm-up runs on CUDA only, here made to run on the
    CPU); with gen.warmup=false none is run."""
    import experiments.run as runner

    monkeypatch.setattr(runner, "PREFILL_WARMUP_DEVICES", ("cuda", "cpu"))
    from specdec.models.transformer import Transformer

    calls, timed = [], []
    real_forward, real_baseline = Transformer.forward, runner.run_baseline

    def recording_forward(self, tokens, *args, **kw):
        if tokens.shape[1] > 3:  # longer than a verification (k + 1): a prefill
            calls.append((bool(timed), (self.config.n_layers, *tokens.shape)))
        return real_forward(self, tokens, *args, **kw)

    def timed_baseline(*args, **kw):
        timed.append(1)
        return real_baseline(*args, **kw)

    monkeypatch.setattr(Transformer, "forward", recording_forward)
    monkeypatch.setattr(runner, "run_baseline", timed_baseline)
    draft = ["draft=model", f"draft.model={tiny_models[1]}", "spec.k=2"]
    over = [*tiny_overrides, *draft, "gen.batch_size=3"]
    s = run(compose_cfg([*over, "gen.warmup=true"]), tmp_path / "warm")
    warm = {shape for was_timed, shape in calls if not was_timed}
    used = {shape for was_timed, shape in calls if was_timed}
    # 4 prompts in batches of 3 and 1, target and draft model: 4 shapes, all warmed
    assert len(used) == 4 and len({n for n, _, _ in used}) == 2
    assert used <= warm and s["warmed_prefills"] == 2
    assert s["agreement"]["identical_outputs"] == 1.0
    calls.clear()
    cold = run(compose_cfg([*over, "gen.warmup=false"]), tmp_path / "cold")
    assert cold["warmed_prefills"] == 0 and all(was_timed for was_timed, _ in calls)


def test_user_errors(compose_cfg, tiny_overrides, tmp_path):
    with pytest.raises(SpecDecError, match="set dataset.path=..., target.model=..."):
        run(compose_cfg(["dataset=file", "target=local"]), tmp_path / "x")
    for over, msg in [
        (["draft=model"], "set draft.model="),
        (["dataset.path=/nonexistent.jsonl"], "not found"),
        (["target.model=/nonexistent"], "/nonexistent"),
        (["accept=threshold", "accept.tau=2"], "tau"),
        (["gen.top_p=0"], "top_p"),
        (["dataset.limit=-1"], "limit"),
        (["dtype=float64"], "invalid dtype 'float64'"),
        (["batch_invariant=always"], "invalid batch_invariant"),
    ]:
        cfg = compose_cfg([*tiny_overrides, *over])
        with pytest.raises(SpecDecError, match=msg):
            run(cfg, tmp_path / "x")


# -- real Hydra runs ------------------------------------------------------------------------
def test_cli_single_run_and_user_error(run_cli, tiny_overrides, tmp_path):
    p = run_cli(*tiny_overrides, f"hydra.run.dir={tmp_path / 'one'}")
    assert p.returncode == 0, p.stderr
    assert "speedup" in p.stdout and "measured on" in p.stdout
    read_run(tmp_path / "one")
    p = run_cli(*tiny_overrides, "spec.k=0", f"hydra.run.dir={tmp_path / 'bad'}")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == "error: spec.k must be >= 1, got 0"


def points(sweep) -> dict[str, dict]:
    """'<drafter> k=<k>' -> summary of every point in a sweep folder."""
    return {
        f"{s['config']['draft']['kind']} k={s['config']['spec']['k']}": s
        for _, s in load_summaries([sweep])
    }


def test_multirun_resume_failures_and_plots(run_cli, tiny_overrides, tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *tiny_overrides,
        "draft=ngram,layerskip",
        "spec.k=1,2",
        f"hydra.sweep.dir={sweep}",
    ]
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr
    dirs = sorted(d for d in sweep.iterdir() if d.is_dir())
    swept = [[p for p in d.name.split(",") if p.startswith(("draft=", "spec.k="))] for d in dirs]
    assert swept == [
        ["draft=layerskip", "spec.k=1"],
        ["draft=layerskip", "spec.k=2"],
        ["draft=ngram", "spec.k=1"],
        ["draft=ngram", "spec.k=2"],
    ]
    assert all("target.model=target" in d.name for d in dirs)  # paths: last part only
    for d in dirs:
        read_run(d)
    assert set(points(sweep)) == {"ngram k=1", "ngram k=2", "layerskip k=1", "layerskip k=2"}
    assert "sweep" in p.stdout and "4 points done, 0 failed" in p.stdout

    # the plotter renders from the sweep
    written = plot_all([sweep])
    names = {f.name for f in written}
    for fig in (
        "acceptance_vs_k",
        "mean_accepted_vs_k",
        "speedup_vs_k",
        "per_position",
        "per_category",
    ):
        assert f"{fig}.png" in names and f"{fig}.pdf" in names
    assert all(f.stat().st_size > 1000 and f.parent == sweep / "plots" for f in written)

    # the same sweep again: finished points are skipped, their files left alone
    mtimes = {d: (d / SUMMARY).stat().st_mtime_ns for d in dirs}
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("already done, skipped") == 4
    assert {d: (d / SUMMARY).stat().st_mtime_ns for d in dirs} == mtimes

    # a failing point is recorded and does not stop or touch the others
    p = run_cli("-m", *tiny_overrides, "draft=early_exit", "spec.k=0,3", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 1, p.stderr  # after finishing the other points
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: 1 of 6 sweep points failed: ")
    assert "draft=early_exit" in errors[0] and "spec.k=0" in errors[0]
    assert "spec.k must be >= 1" in errors[0]
    status = {name: s["status"] for name, s in points(sweep).items()}
    assert status == {
        "layerskip k=1": "ok",
        "layerskip k=2": "ok",
        "ngram k=1": "ok",
        "ngram k=2": "ok",
        "early_exit k=0": "failed",
        "early_exit k=3": "ok",
    }
    assert "5 points done, 1 failed" in p.stdout
    assert {d: (d / SUMMARY).stat().st_mtime_ns for d in dirs} == mtimes
    for path, s in load_summaries([sweep]):
        if s["status"] == "ok":
            read_run(path)
    plot_all([sweep], tmp_path / "figs")  # failed points are left out of the figures


def test_joblib_launcher_multirun(run_cli, tiny_overrides, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    p = run_cli(
        "-m",
        *tiny_overrides,
        "hydra/launcher=parallel",
        "spec.k=1,2",
        f"hydra.sweep.dir={sweep}",
    )
    assert p.returncode == 0, p.stderr
    assert {s["k"] for _, s in load_summaries([sweep])} == {1, 2}
    for d in sweep.iterdir():
        if d.is_dir():
            read_run(d)


def test_submitit_local_launcher_multirun(run_cli, tiny_overrides, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    p = run_cli(
        "-m",
        *tiny_overrides,
        "hydra/launcher=slurm_local",
        "spec.k=1,2",
        f"hydra.sweep.dir={sweep}",
    )
    assert p.returncode == 0, p.stderr
    assert {s["k"] for _, s in load_summaries([sweep])} == {1, 2}


@pytest.mark.slow
def test_default_run_on_smollm2(run_cli, tmp_path):
    """The no-argument run on the embedded model: 12 prompts, every category, outputs equal
    to the greedy baseline's (its run time is measured in the README, not asserted here), in
    the dtype `auto` picks for this CPU (bf16 runs batch-invariant)."""
    from specdec.models.load import auto_dtype

    p = run_cli(f"hydra.run.dir={tmp_path}", timeout=900)
    assert p.returncode == 0, p.stderr
    rows, s = read_run(tmp_path)
    assert s["n_prompts"] == 12 and len({r["category"] for r in rows}) == 6
    dtype = str(auto_dtype("cpu")).removeprefix("torch.")
    assert s["dtype"] == dtype and s["batch_invariant"] == (dtype == "bfloat16")
    assert dtype in s["note"]
    assert s["agreement"]["identical_outputs"] == 1.0


def test_hostile_chat_template_in_the_runner(compose_cfg, tiny_overrides, tiny_models, tmp_path):
    """The runner renders chat prompts with the model's template: an escape attempt fails as
    a user error and runs nothing."""
    import shutil

    marker = tmp_path / "pwned"
    d = tmp_path / "evil"
    shutil.copytree(tiny_models[0], d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    evil = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}"
    (d / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": evil}))
    cfg = compose_cfg([*tiny_overrides, f"target.model={d}", "dataset.chat=true"])
    with pytest.raises(SpecDecError, match="chat template failed"):
        run(cfg, tmp_path / "out")
    assert not marker.exists()


def test_output_cache_starts_empty_after_the_warm_up(
    compose_cfg, tiny_overrides, tmp_path, monkeypatch
):
    """draft.reuse_outputs: the warm-up's generations (a dataset prompt's head) must not
    reach the timed sequences' cache; the summary counts the rounds per draft source."""
    from specdec.decode.speculative import SpeculativeDecoder

    held = []
    real = SpeculativeDecoder.generate

    def recording(self, prompts, *args, **kw):
        held.append(len(self.drafter.outputs or ()))
        return real(self, prompts, *args, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "generate", recording)
    over = [*tiny_overrides, "draft=ngram", "draft.reuse_outputs=true", "spec.k=2"]
    s = run(compose_cfg([*over, "gen.warmup=true"]), tmp_path / "warm")
    from tests.experiments.conftest import PROMPTS

    n = len(PROMPTS)
    timed = held[-n:]
    assert len(held) > n  # the warm-up's generation came first and held an output after
    assert timed[0] == 0 and timed == sorted(timed) and timed[-1] > 0
    src = s["draft_sources"]
    assert set(src) == {"history", "outputs", "none"} and sum(src.values()) > 0
    plain = run(compose_cfg([*tiny_overrides, "draft=ngram", "spec.k=2"]), tmp_path / "off")
    assert plain["draft_sources"]["outputs"] == 0


def test_every_drafter_runs_after_the_warm_up_and_stays_lossless(
    compose_cfg, tiny_overrides, tiny_models, tmp_path
):
    """gen.warmup=true (the default outside tests) ends with the drafter's reset hook
    (`Drafter.reset()`, no arguments): every drafter config must take it and then decode
    the timed prompts token-identical to plain greedy. (The head drafters' own cache reset
    once shared the name and took arguments: draft=head and draft=ngram_head crashed in
    every warmed run while the tests, run without warm-up, passed.)"""
    from hydra.utils import instantiate

    from tests.experiments.conftest import CONFIGS, drafter_overrides

    model, tok = instantiate(compose_cfg(tiny_overrides).target)
    names = sorted(p.stem for p in (CONFIGS / "draft").glob("*.yaml") if p.stem != "none")
    assert {"head", "ngram_head", "ngram", "replies", "model"} <= set(names)
    for name in names:
        over = [*tiny_overrides, f"draft={name}", "gen.warmup=true", "spec.k=2"]
        over += drafter_overrides(name, model, tok, tiny_models[1], tmp_path / name)
        s = run(compose_cfg(over), tmp_path / "runs" / name)
        assert s["agreement"]["identical_outputs"] == 1.0, name
