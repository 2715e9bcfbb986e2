"""bench_generate's round-robin timing: every system runs once per round, in order, and the
rows' rates come from each system's own runs."""

from __future__ import annotations

import random

from benchmarks.bench_generate import interleaved


def test_interleaved_runs_round_robin():
    calls = []
    secs = {name: random.uniform(0.5, 2.0) for name in ("a", "b", "c")}

    def system(name):
        def run(n_new):
            calls.append(name)
            return secs[name], list(range(n_new))

        return run

    n_new, repeats = random.randint(3, 9), random.randint(2, 5)
    out = interleaved({name: system(name) for name in secs}, n_new, repeats)
    assert calls == ["a", "b", "c"] * repeats
    for name, (rates, toks) in out.items():
        assert rates == [n_new / secs[name]] * repeats
        assert toks == list(range(n_new))
