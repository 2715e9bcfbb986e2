"""GPU benchmarks of the attention-side kernels: verify_attention and compact_kv.

    python -m benchmarks.bench_attention            # full run, about a minute on one GPU
    python -m benchmarks.bench_attention --quick    # fewer shapes; on CPU a tiny smoke
    python -m benchmarks.bench_attention --out DIR  # results directory (see bench_kernels)

Each section is f(copy_bw_gbps) -> kernel records (benchmarks.harness.kernel_record) run by
benchmarks.harness.run_kernel_bench. Times are medians of triton.testing.do_bench. Bytes are
the minimum traffic: the K/V entries read (attention) or read and written (compaction),
plus q and out.

verify_attention: Llama-8B-like heads (32 query / 8 KV heads, D = 128), bf16, batch 1 and
8, L committed keys in {512, 4096, 32768}, T new tokens in {1, 5, 9, 16}; baseline
F.scaled_dot_product_attention over the same cache slice with an explicit causal-offset
mask. The T = 9 records carry one extra key, t9_over_t1: time(T = 9) / time(T = 1) at the
same batch and L (1.0 means verifying 8 drafts costs as much as one decode step).

compact_kv: a Llama-8B-like cache (32 layers, 8 KV heads, D = 128, bf16), batch 8, 4 to 8
accepted entries per sequence scattered over 16 drafted slots; baseline torch advanced
indexing (gather + index_put) with the indices prepared outside the timed region.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the CPU smoke run needs the interpreter before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import (  # noqa: E402
    MODEL_SHAPES,
    add_graph_time,
    kernel_record,
    run_kernel_bench,
)
from benchmarks.harness import time_ms as _time_ms  # noqa: E402
from specdec.kernels.kv_rollback import compact_kv  # noqa: E402
from specdec.kernels.verify_attention import verify_attention  # noqa: E402

log = logging.getLogger(__name__)

_LLAMA = MODEL_SHAPES["llama-3-8b"]
HEADS, KV_HEADS, HEAD_DIM = _LLAMA.n_heads, _LLAMA.n_kv_heads, _LLAMA.head_dim
N_LAYERS = _LLAMA.n_layers

time_ms = partial(_time_ms, warmup=1, repeats=3, budget_ms=(10, 40))


def attention_case(B, L, T, *, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cuda"):
    """q [B, T, Hq, D] and a [B, Hkv, L + T, D] cache holding L committed + T new keys."""
    dt = torch.bfloat16
    q = torch.randn(B, T, heads, head_dim, device=device, dtype=dt)
    k = torch.randn(B, kv_heads, L + T, head_dim, device=device, dtype=dt)
    v = torch.randn_like(k)
    lens = torch.full((B,), L, device=device, dtype=torch.int32)
    return q, k, v, lens


def _sdpa_baseline(q, k, v, L):
    """F.scaled_dot_product_attention with an explicit mask over the cache slice."""
    B, T, Hq, D = q.shape
    n_keys = L + T
    mask = (
        torch.arange(n_keys, device=q.device)[None, :]
        <= L + torch.arange(T, device=q.device)[:, None]
    )  # [T, n_keys]
    mask = mask[None, None]
    qt = q.transpose(1, 2)  # [B, Hq, T, D]
    kk, vv = k[:, :, :n_keys], v[:, :, :n_keys]
    try:
        F.scaled_dot_product_attention(
            qt[:, :, :1], kk, vv, attn_mask=mask[..., :1, :], enable_gqa=True
        )
    except TypeError:  # torch < 2.5: repeat the KV heads once, outside the timed call
        group = Hq // k.shape[1]
        kr, vr = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        return partial(F.scaled_dot_product_attention, qt, kr, vr, attn_mask=mask), "sdpa(mask)"
    sdpa = partial(F.scaled_dot_product_attention, qt, kk, vv, attn_mask=mask, enable_gqa=True)
    return sdpa, "sdpa(mask, enable_gqa)"


def bench_verify_attention(
    copy_bw_gbps: float,
    *,
    batches=(1, 8),
    lengths=(512, 4096, 32768),
    tokens=(1, 5, 9, 16),
    heads=HEADS,
    kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    device="cuda",
) -> list[dict]:
    records = []
    for B in batches:
        for L in lengths:
            by_t = {}
            for T in tokens:
                q, k, v, lens = attention_case(
                    B, L, T, heads=heads, kv_heads=kv_heads, head_dim=head_dim, device=device
                )
                ms = time_ms(lambda: verify_attention(q, k, v, lens))  # noqa: B023
                baseline, name = _sdpa_baseline(q, k, v, L)
                err = (verify_attention(q, k, v, lens) - baseline().transpose(1, 2)).abs().max()
                if not err < 0.05:
                    log.warning("verify_attention differs from %s by %.3g", name, float(err))
                baseline_ms = time_ms(baseline)
                elt = k.element_size()
                nbytes = (2 * B * kv_heads * (L + T) + 2 * B * T * heads) * head_dim * elt
                shape = f"B={B} L={L} T={T} Hq={heads} Hkv={kv_heads} D={head_dim} bf16"
                rec = kernel_record(
                    "verify_attention", shape, ms, nbytes, copy_bw_gbps, name, baseline_ms
                )
                add_graph_time(rec, lambda: verify_attention(q, k, v, lens), nbytes, q.device)  # noqa: B023
                by_t[T] = rec
                records.append(rec)
                log.info("%s: %.4f ms (%s %.4f ms)", shape, ms, name, baseline_ms)
            if 1 in by_t and 9 in by_t:
                by_t[9]["t9_over_t1"] = by_t[9]["ms"] / by_t[1]["ms"]
    return records


def compaction_case(n_acc, *, n_layers=N_LAYERS, B=8, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                    lmax=4096, drafted=16, device="cuda", seed=0):  # fmt: skip
    """A bf16 cache, committed lengths, and per-sequence accepted slots: an increasing
    path through `drafted` slots after the prefix (root first), n_acc[b] entries."""
    g = torch.Generator().manual_seed(seed)
    shape = (n_layers, B, kv_heads, lmax, head_dim)
    k = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.randint(lmax // 4, lmax - drafted, (B,), generator=g)
    src = torch.zeros(B, drafted, dtype=torch.int64)
    for b in range(B):
        rest = torch.randperm(drafted - 1, generator=g)[: max(n_acc[b] - 1, 0)].sort().values
        path = torch.cat([torch.zeros(1, dtype=torch.int64), rest + 1])[: n_acc[b]]
        src[b, : n_acc[b]] = lens[b] + path
    n = torch.tensor(n_acc)
    return k, v, lens.to(device), src.to(device), n.to(device)


def bench_compact_kv(
    copy_bw_gbps: float,
    *,
    accepted=((4,) * 8, (8,) * 8, (4, 5, 6, 7, 8, 4, 6, 8)),
    n_layers=N_LAYERS,
    kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    lmax=4096,
    device="cuda",
) -> list[dict]:
    records = []
    for n_acc in accepted:
        B = len(n_acc)
        k, v, lens, src, n = compaction_case(
            list(n_acc),
            n_layers=n_layers,
            B=B,
            kv_heads=kv_heads,
            head_dim=head_dim,
            lmax=lmax,
            device=device,
        )
        ms = time_ms(lambda: compact_kv(k, v, lens, src, n))  # noqa: B023
        b_idx = torch.repeat_interleave(torch.arange(B, device=device), n)
        j_idx = torch.cat([torch.arange(int(c), device=device) for c in n_acc])
        src_flat, dst_flat = src[b_idx, j_idx], lens[b_idx] + j_idx

        def baseline(k=k, v=v, b_idx=b_idx, src_flat=src_flat, dst_flat=dst_flat):
            for cache in (k, v):
                cache[:, b_idx, :, dst_flat] = cache[:, b_idx, :, src_flat]

        baseline_ms = time_ms(baseline)
        nbytes = 2 * 2 * n_layers * kv_heads * head_dim * k.element_size() * sum(n_acc)
        shape = (
            f"layers={n_layers} B={B} Hkv={kv_heads} D={head_dim} Lmax={lmax} "
            f"accepted={'/'.join(map(str, n_acc))} bf16"
        )
        records.append(
            kernel_record(
                "compact_kv", shape, ms, nbytes, copy_bw_gbps, "torch gather+index_put", baseline_ms
            )  # fmt: skip
        )
        log.info("%s: %.4f ms (baseline %.4f ms)", shape, ms, baseline_ms)
    return records


def bench_verify_attention_quick(copy_bw_gbps: float) -> list[dict]:
    return bench_verify_attention(copy_bw_gbps, batches=(1,), lengths=(4096,), tokens=(1, 9))


def bench_compact_kv_quick(copy_bw_gbps: float) -> list[dict]:
    return bench_compact_kv(copy_bw_gbps, accepted=((4, 5, 6, 7, 8, 4, 6, 8),))


def cpu_smoke(copy_bw_gbps: float) -> list[dict]:
    """Tiny shapes through Triton's interpreter: checks the plumbing, not performance."""
    tiny = dict(kv_heads=2, head_dim=16, device="cpu")
    return bench_verify_attention(
        copy_bw_gbps, batches=(2,), lengths=(24,), tokens=(1, 9), heads=4, **tiny
    ) + bench_compact_kv(copy_bw_gbps, accepted=((2, 3),), n_layers=2, lmax=64, **tiny)


def main(argv: list[str] | None = None) -> int:
    return run_kernel_bench(
        "bench_attention",
        __doc__,
        full=[bench_verify_attention, bench_compact_kv],
        quick=[bench_verify_attention_quick, bench_compact_kv_quick],
        cpu=[cpu_smoke],
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
