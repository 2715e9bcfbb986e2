"""GPU benchmark of the rejection sampler: the Triton kernels vs their torch reference.

    python -m benchmarks.bench_rejection            # full grid, well under a minute on one GPU
    python -m benchmarks.bench_rejection --quick    # one vocabulary; on CPU a tiny smoke
    python -m benchmarks.bench_rejection --out DIR  # results directory (see bench_kernels)

Grid: B x k x V with V the vocabularies of benchmarks.harness.MODEL_SHAPES (SmolLM2 49152,
Qwen2.5 151936, Llama-3 128256), k in {1, 4, 8}, B in {1, 4, 16, 64}; greedy and stochastic
(with draft probabilities q). p and q are softmaxes of random logits, p near q on the draft
rows so acceptance runs vary in length; greedy drafts are p's argmax with one position per
sequence corrupted (or none). Both implementations consume the same noise
(`draw_acceptance_noise`, drawn outside the timed call) and must agree exactly (checked).

GB/s counts the probabilities the kernel must read for the outcome it computes: greedy,
the rows up to the first mismatch (n_accepted + 1 rows of p); stochastic, the row it samples
from (p, q where a draft was rejected) and the race weights, fp32. The torch reference
reads whole tensors; its time is the baseline.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial

import torch

if not torch.cuda.is_available():  # the CPU smoke run needs the interpreter before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import MODEL_SHAPES, kernel_record, run_kernel_bench  # noqa: E402
from benchmarks.harness import time_ms as _time_ms  # noqa: E402
from specdec.kernels import rejection_sampling as rs  # noqa: E402

log = logging.getLogger(__name__)

VOCABS = tuple(MODEL_SHAPES[m].vocab_size for m in ("smollm2-135m", "qwen2.5-0.5b", "llama-3-8b"))
KS = (1, 4, 8)
BATCHES = (1, 4, 16, 64)
time_ms = partial(_time_ms, warmup=1, repeats=3, budget_ms=(5, 20))


def rejection_case(B: int, k: int, V: int, *, greedy: bool, device, seed: int = 0):
    """(draft_tokens [B, k], p [B, k+1, V], q [B, k, V] or None, uniforms, race_weights)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q_logits = torch.randn(B, k, V, device=device, generator=g)
    p_logits = torch.cat(
        [
            q_logits + torch.randn(B, k, V, device=device, generator=g),
            torch.randn(B, 1, V, device=device, generator=g),
        ],
        1,
    )
    p = torch.softmax(p_logits, -1)
    del p_logits
    if greedy:
        drafts = p[:, :k].argmax(-1)  # [B, k]
        bad = torch.randint(0, k + 1, (B,), device=device, generator=g)  # == k: none corrupted
        hit = torch.arange(k, device=device)[None, :] == bad[:, None]
        return torch.where(hit, (drafts + 1) % V, drafts), p, None, None, None
    q = torch.softmax(q_logits, -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    uniforms, race = rs.draw_acceptance_noise(B, k, V, device, g)
    return drafts, p, q, uniforms, race


def probability_bytes(res: rs.AcceptResult, k: int, V: int, *, greedy: bool) -> int:
    """fp32 bytes of p / q / race weights the kernel reads for this outcome (see docstring)."""
    n_acc = res.n_accepted.cpu()
    if greedy:
        rows = int((n_acc + 1).sum())
    else:
        rows = int(torch.where(n_acc < k, 3, 2).sum())  # p, q, race or p (bonus), race
    return rows * V * 4


def bench_rejection(
    copy_bw_gbps: float,
    *,
    vocabs: tuple[int, ...] = VOCABS,
    ks: tuple[int, ...] = KS,
    batches: tuple[int, ...] = BATCHES,
    device: torch.device | str = "cuda",
) -> list[dict]:
    records = []
    for greedy in (True, False):
        mode = "greedy" if greedy else "stochastic"
        for V in vocabs:
            for k in ks:
                for B in batches:
                    drafts, p, q, u, race = rejection_case(B, k, V, greedy=greedy, device=device)
                    kw = dict(greedy=greedy, uniforms=u, race_weights=race)
                    got = rs.rejection_sample_triton(drafts, p, q, **kw)
                    want = rs.rejection_sample_reference(drafts, p, q, **kw)
                    same = torch.equal(got.n_accepted, want.n_accepted) and torch.equal(
                        got.next_token, want.next_token
                    )
                    if not same:
                        log.warning("%s B=%d k=%d V=%d: Triton != reference", mode, B, k, V)
                    args = (drafts, p, q)
                    ms = time_ms(lambda a=args, kw=kw: rs.rejection_sample_triton(*a, **kw))
                    base_ms = time_ms(lambda a=args, kw=kw: rs.rejection_sample_reference(*a, **kw))
                    nbytes = probability_bytes(got, k, V, greedy=greedy)
                    shape = f"{mode} B={B} k={k} V={V} fp32"
                    rec = kernel_record(
                        f"rejection_sample[{mode}]",
                        shape,
                        ms,
                        nbytes,
                        copy_bw_gbps,
                        "rejection_sample_reference (torch)",
                        base_ms,
                    )
                    rec["mean_accepted"] = float(got.n_accepted.float().mean())
                    rec["matches_reference"] = same
                    records.append(rec)
                    log.info("%s: %.4f ms (torch %.4f ms)", shape, ms, base_ms)
                    del args, p, q, u, race
    return records


def bench_rejection_quick(copy_bw_gbps: float) -> list[dict]:
    return bench_rejection(copy_bw_gbps, vocabs=(VOCABS[-1],), ks=(4,), batches=(1, 64))


def cpu_smoke(copy_bw_gbps: float) -> list[dict]:
    """Tiny shapes through Triton's interpreter: checks the plumbing, not performance."""
    return bench_rejection(copy_bw_gbps, vocabs=(1000,), ks=(1, 4), batches=(3,), device="cpu")


def main(argv: list[str] | None = None) -> int:
    return run_kernel_bench(
        "bench_rejection",
        __doc__,
        full=[bench_rejection],
        quick=[bench_rejection_quick],
        cpu=[cpu_smoke],
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
