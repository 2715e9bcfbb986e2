"""One transformer core for the Llama and Qwen2 families.

The differences are data, not code: Qwen2 has q/k/v biases, either family may tie the
LM head to the token embedding, and rope theta / rms eps / GQA come from the config.

A single call serves prefill, one-token decode and verification of k+1 drafted tokens:

    logits = model(tokens, cache, start_pos)      # tokens [B, T], start_pos [B]

writes the T new keys/values of sequence b at slots start_pos[b] .. start_pos[b]+T-1 of
the static cache and returns logits for all T positions ([B, T, V], fp32). Query i of
sequence b sits at position start_pos[b] + i and sees keys 0 .. start_pos[b] + i (or, with
a tree mask, the committed prefix plus its ancestors among the new tokens). The caller
owns the per-sequence lengths (`KVCache.lens`): rolling back a rejected draft is lowering
them, because the next forward overwrites the slots after them.

`static=True` makes the same call without host syncs (start_pos is only read on the device,
attention spans the whole static cache) so that `specdec.models.cuda_graphs` can capture it.

Drafters use the same call on a subset of layers: `layers=[0, 2, 4, ...]` (layer skip) or
`layers=range(n)` (early exit); both finish with the final norm and LM head.

Every linear layer (including the tied LM head) is a `Linear`, which runs the quantized
GEMV kernel on the Triton backend and a dense copy of the weight on the torch backend.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecDecError
from specdec.kernels.quant import QuantizedWeight
from specdec.kernels.utils import resolve_backend, rows_are_one, rows_as_one
from specdec.models import batch_invariant as invariance
from specdec.models.batch_invariant import InvariantAttention
from specdec.models.config import ModelConfig
from specdec.models.cpu_compile import check_available as check_compile
from specdec.models.cpu_compile import resolve_setting as cpu_compile_setting
from specdec.models.cpu_linear import (
    PACKED,
    Choice,
    CpuLinear,
    choose_backend,
    mixed_ort_choice,
    resolve_mode,
)

log = logging.getLogger(__name__)


class KVCache:
    """Static per-layer cache: k, v are [n_layers, B, kv_heads, max_len, head_dim]; layer i's
    cache is the view k[i] ([B, kv_heads, max_len, head_dim]). `lens` [B] counts committed
    entries per sequence."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)

    @classmethod
    def for_model(cls, model: Transformer, batch: int, max_len: int) -> KVCache:
        c = model.config
        dtype = model.dtype
        if model.batch_invariant and model.backend == "torch":
            # rows read whole buckets of key slots, in fp32 (the Triton kernels' invariant
            # launches read the cache as it is)
            max_len = invariance.bucket_len(max_len - 1)
            dtype = torch.float32
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, dtype, model.device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


class Linear(nn.Module):
    """y = x W^T (+ b) with W dense [out, in] or a QuantizedWeight.

    On the Triton backend the packed weight feeds the GEMV kernel directly. On the torch
    backend on CPU the weight is prepared once for the kernel `specdec.models.cpu_linear`
    picks (mode `cpu_linear`: oneDNN prepacked dense weights by default, or torch's int4/int8
    packed kernels on the codes in "native" mode); elsewhere a quantized weight is
    dequantized once into `dense` and runs through F.linear.
    """

    def __init__(
        self,
        weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
        parts: list[QuantizedWeight] | None = None,
    ):
        super().__init__()
        self.qweight = weight if isinstance(weight, QuantizedWeight) else None
        # the quantized parts of a dense fusion of mixed formats (q/k/v of different GGUF
        # types): only the ort backend computes from them (`mixed_ort_choice`)
        self.parts = parts
        self.dense = None if self.qweight is not None else weight
        self.bias = bias
        self.use_kernel = False
        self._cpu_src = None
        self.cpu: CpuLinear | None = None  # the prepared CPU kernel (torch backend on CPU)
        self.cpu_choice: Choice | None = None
        # a copy pointed at a streamed layer's slot: the kernel built on the slot's weights
        # for the current forward (`build_copy_kernel`; LayerStream sets and drops it)
        self.slot_kernel: CpuLinear | None = None

    @property
    def out_features(self) -> int:
        w = self.qweight if self.qweight is not None else self.dense
        return w.shape[0]

    def prepare(self, backend: str, dtype: torch.dtype, cpu_linear: str = "dense") -> None:
        self.use_kernel = backend == "triton" and self.qweight is not None
        self.cpu = self.cpu_choice = None
        if self.bias is not None and self.bias.dtype != dtype:
            self.bias = self.bias.to(dtype)
        src = self.qweight if self.qweight is not None else self.dense
        parts = None
        if not self.use_kernel and src.device.type == "cpu":
            self.cpu_choice = choose_backend(cpu_linear, self.qweight, dtype)
            if self.parts is not None:  # set only when the fusion went dense
                mixed = mixed_ort_choice(cpu_linear, self.parts, dtype)
                if mixed is not None:
                    self.cpu_choice, parts = mixed, self.parts
        packed = self.cpu_choice is not None and self.cpu_choice.backend in PACKED
        if not self.use_kernel and not packed and self.dense is None:
            self.dense = self.qweight.dequantize(dtype)
        if self.dense is not None and self.dense.dtype != dtype:
            self.dense = self.dense.to(dtype)
        if self.cpu_choice is not None:
            self.cpu = CpuLinear(
                self.cpu_choice.backend,
                dense=None if packed else self.dense,
                qweight=self.qweight if parts is None else parts,
                bias=self.bias,
                dtype=dtype,
            )
            if self.qweight is not None and self.cpu_choice.backend != "mkl":
                self.dense = None  # the kernel holds its own copy
            src = self.qweight if self.qweight is not None else self.dense
        self._cpu_src = src

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from specdec.kernels.quant_gemv import quant_linear

            return quant_linear(x, self.qweight, self.bias, backend="triton")
        if rows_are_one() and x[..., 0].numel() > 1:
            # a batch-invariant forward on the Triton backend (quant_gemv.rows_as_one): a
            # dense weight's library GEMM picks its kernel by M, so each row is a call of one
            rows = x.reshape(-1, x.shape[-1])
            out = torch.cat([self._dense_forward(rows[i : i + 1]) for i in range(len(rows))])
            return out.view(*x.shape[:-1], out.shape[-1])
        return self._dense_forward(x)

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slot_kernel is not None:
            return self.slot_kernel(x)
        if self.cpu is not None and self._cpu_src is (
            self.qweight if self.qweight is not None else self.dense
        ):
            return self.cpu(x)
        if x.device.type == "cpu":
            # a copy pointed at other weights that no kernel was built for: the resident
            # layer's kernel, built for this call, so both compute identical numbers
            built = self.build_copy_kernel(x.dtype)
            if built is not None:
                return built(x)
        return F.linear(x, self.dense, self.bias)

    def copy_backend(self, dtype: torch.dtype) -> str:
        """The CPU backend of the resident layer this copy was made from (its prepared
        kernel's, native's ort in bf16 too), else the one `prepare` would choose."""
        if self.cpu is not None:
            return self.cpu.backend
        mode = resolve_mode()
        backend = choose_backend(mode, self.qweight, dtype).backend
        if self.parts is not None and mixed_ort_choice(mode, self.parts, dtype):
            backend = "ort"
        return backend

    def build_copy_kernel(self, dtype: torch.dtype, backend: str | None = None) -> CpuLinear | None:
        """For a copy pointed at other weights (a streamed layer's slot): the CPU kernel the
        resident layer runs (`backend`, by default `copy_backend`), built on the copy's
        weights as `prepare` builds it once on a resident layer's (oneDNN's prepacked
        weight, or torch's packed codes), or None where that kernel is F.linear on the dense
        weight. The kernel must be the resident one: oneDNN on the plain, unpacked weight
        rounds differently (single rows under torch 2.13 on an AVX-512 Zen 4, every row
        count under torch 2.11). A packed backend reads the codes; the others the dense
        weight, which the caller provides."""
        backend = backend or self.copy_backend(dtype)
        if backend == "onednn":
            return CpuLinear(backend, dense=self.dense, qweight=None, bias=self.bias, dtype=dtype)
        if backend in PACKED:  # ort on a mixed fusion: its parts
            w = self.qweight if self.qweight is not None else self.parts
            return CpuLinear(backend, dense=None, qweight=w, bias=self.bias, dtype=dtype)
        return None

    def weight_bytes(self) -> int:
        """Bytes of weights one call reads in the prepared form."""
        if self.use_kernel:
            return self.qweight.nbytes()
        if self.cpu is not None:
            return self.cpu.nbytes()
        return self.dense.numel() * self.dense.element_size()


class RMSNorm(nn.Module):
    """fp32 in (the residual stream), `out_dtype` out (the compute dtype of the next GEMV)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight  # fp32
        self.eps = eps
        self.out_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rows_are_one():  # a batch-invariant forward on the Triton backend
            from specdec.kernels.rms_norm import rms_norm_rows

            return rms_norm_rows(x, self.weight, self.eps, self.out_dtype, backend="triton")
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps).to(self.out_dtype)


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; False where there is
    none). Building the CPU kernels frees gigabytes of temporaries in chunks glibc keeps for
    reuse: after setup, Qwen2.5-Coder-0.5B in bf16 held 2,928 MiB of anonymous memory in
    `native` mode and 2,297 MiB in `dense`, and 1,927 / 2,038 MiB after the trim (2-vCPU
    AMD Zen 5, torch 2.13; ONNX Runtime's builds fragment the heap most)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def rope_tables(cfg: ModelConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [max_seq_len, head_dim] (HF rotate-half layout: the two halves share
    frequencies; the first half of the sin table is negated, see `apply_rope`)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    rs = cfg.rope_scaling
    if rs:  # Llama-3.1 frequency-dependent scaling
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], -1).float(), torch.cat([-sin, sin], -1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, D]; cos / signed sin [B, T, 1, D]: x * cos + rotate_half(x) * sin, where
    # rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1, 1] (the sign lives in the table)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, wqkv: Linear, wo: Linear):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = wqkv  # fused [q; k; v] projection
        self.wo = wo
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x, cos, sin, k_cache, v_cache, ctx: _StepContext) -> torch.Tensor:
        B, T, _ = x.shape
        hd, nq, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x)
        qk = apply_rope(qkv[..., : (nq + nkv) * hd].view(B, T, nq + nkv, hd), cos, sin)
        q, k = qk[:, :, :nq], qk[:, :, nq:]
        v = qkv[..., (nq + nkv) * hd :].view(B, T, nkv, hd)
        k_cache, v_cache = ctx.write_kv(k_cache, v_cache, k, v)
        o = ctx.attend(q, k_cache, v_cache, self.scale)  # [B, T, Hq, D]
        return self.wo(o.reshape(B, T, nq * hd))


class FeedForward(nn.Module):
    def __init__(self, w_gate_up: Linear, w_down: Linear):
        super().__init__()
        self.w_gate_up = w_gate_up  # fused [gate; up]
        self.w_down = w_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.w_gate_up(x)
        g, u = gu.chunk(2, dim=-1)
        return self.w_down(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, attn: Attention, ffn: FeedForward, attn_norm: RMSNorm, ffn_norm: RMSNorm):
        super().__init__()
        self.attn, self.ffn, self.attn_norm, self.ffn_norm = attn, ffn, attn_norm, ffn_norm

    def forward(self, x, cos, sin, k_cache, v_cache, ctx) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, ctx)
        return h + self.ffn(self.ffn_norm(h))


class _StepContext:
    """Per-forward bookkeeping shared by all layers: where to write, what each query sees."""

    def __init__(
        self,
        start_pos: torch.Tensor,
        T: int,
        tree_mask,
        backend: str,
        static_len: int | None,
        invariant: tuple[int, int, int, int] | None = None,
    ):
        self.B = start_pos.shape[0]
        self.T = T
        self.start_pos = start_pos
        # invariant (KV heads, group size, head dim, cache slots): every row attends in
        # shapes that depend on its own position only, a tree row over its ancestors laid out
        # as a decode step sees them (specdec.models.batch_invariant); a tree this machine's
        # GEMMs cannot run exactly keeps the masked path
        self.invariant = None
        if invariant is not None:
            inv = InvariantAttention(start_pos.tolist(), T, *invariant, tree_mask=tree_mask)
            self.invariant = inv if inv.exact else None
        if static_len is None:
            starts = start_pos.tolist()
            self.uniform = all(s == starts[0] for s in starts)
            self.s0 = starts[0]
            self.kv_len = max(starts) + T  # keys any query can see
        else:  # graph-safe: start_pos stays on the device; attend over the whole cache
            self.uniform = False
            self.kv_len = static_len
        self.tree_mask = tree_mask
        self.use_kernel = backend == "triton" and T <= 64
        self.mask = None
        if (
            self.invariant is None
            and not self.use_kernel
            and (static_len is not None or not self.uniform or T > 1 or tree_mask is not None)
        ):
            dev = start_pos.device
            key = torch.arange(self.kv_len, device=dev)
            qpos = start_pos[:, None] + torch.arange(T, device=dev)  # [B, T]
            mask = key[None, None, :] <= qpos[:, :, None]  # [B, T, L]
            if tree_mask is not None:
                # among the new tokens, the ancestor bits replace the causal rule
                bits = (tree_mask[:, :, None] >> torch.arange(T, device=dev)) & 1  # [B, T, T]
                new_key = key[None, None, :] - start_pos[:, None, None]  # [B, 1, L]
                in_new = (new_key >= 0) & (new_key < T)
                tree_vis = torch.gather(bits.bool(), 2, new_key.clamp(0, T - 1).expand(-1, T, -1))
                mask = torch.where(in_new, tree_vis, key[None, None, :] < start_pos[:, None, None])
            self.mask = mask[:, None]  # [B, 1, T, L]
        if not self.uniform:
            self.b_idx = torch.arange(self.B, device=start_pos.device)[:, None]
            self.slot = start_pos[:, None] + torch.arange(T, device=start_pos.device)
        # static steps: the whole KVCache; the running layer's index. Set by the forward,
        # read by write_kv
        self.static_cache: KVCache | None = None
        self.layer = 0

    def write_kv(self, k_cache, v_cache, k: torch.Tensor, v: torch.Tensor):
        """This step's k, v [B, T, H, D] into the running layer's cache views [B, H, L, D]
        -> the views the attention then reads.
        Static steps index the whole [n_layers, B, H, L, D] tensors instead of the layer's
        view: torch.compile functionalizes a write through a view of a graph input into
        copies of the layer's cache (twice per layer) and of the whole cache at the end (a
        SmolLM2 step over 256 slots took 60 against 50 ms over 64); a write into the input
        itself stays in place."""
        if self.static_cache is not None:
            layer = torch.full((1, 1), self.layer, device=k.device)
            idx = [layer, self.b_idx, None, self.slot]
            torch.ops.aten.index_put_(self.static_cache.k, idx, k.to(k_cache.dtype))
            torch.ops.aten.index_put_(self.static_cache.v, idx, v.to(v_cache.dtype))
            # views taken after the write, in the same graph: views made before it (the
            # caller's, possibly in an earlier graph when a linear breaks the graph) are
            # not seen as aliases of the written tensor and read stale entries
            return self.static_cache.k[self.layer], self.static_cache.v[self.layer]
        self.write(k_cache, k)
        self.write(v_cache, v)
        return k_cache, v_cache

    def write(self, cache: torch.Tensor, x: torch.Tensor) -> None:
        # cache [B, H, L, D]; x [B, T, H, D]
        if self.uniform:
            cache[:, :, self.s0 : self.s0 + self.T] = x.transpose(1, 2)
        else:
            cache.transpose(1, 2)[self.b_idx, self.slot] = x.to(cache.dtype)

    def attend(self, q, k_cache, v_cache, scale) -> torch.Tensor:
        if self.use_kernel:
            from specdec.kernels.verify_attention import verify_attention

            return verify_attention(
                q,
                k_cache,
                v_cache,
                self.start_pos,
                scale=scale,
                tree_mask=self.tree_mask,
                backend="triton",
                invariant=rows_are_one(),
            )
        if self.invariant is not None:
            return self.invariant(q, k_cache, v_cache, scale)
        k = k_cache[:, :, : self.kv_len]
        v = v_cache[:, :, : self.kv_len]
        # batched decode / verification, or any compiled step (cpu_compile: fixed shapes,
        # never a prefill): SDPA's bf16 is slow here
        small = (self.B > 1 and self.T <= 16) or torch.compiler.is_compiling()
        if small and q.device.type == "cpu" and k.dtype in (torch.bfloat16, torch.float16):
            return _small_attention(q, k, v, self.mask, scale)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(k.dtype),  # a batch-invariant model's tree rows: fp32 cache
            k,
            v,
            attn_mask=self.mask,
            scale=scale,
            is_causal=False,
            enable_gqa=True,
        )
        return o.transpose(1, 2).to(q.dtype)


def _small_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention of a few query rows on CPU over a 16-bit cache, in float32 GEMMs: q [B, T,
    Hq, D], k / v [B, Hkv, L, D], mask [B, 1, T, L] bool or None -> [B, T, Hq, D] in q's
    dtype. Batched decode and verification steps outside batch-invariant mode: torch's
    bf16 SDPA on CPU (flash kernel) takes 1.5-2.0 ms per layer for 32 one-token rows
    against 0.35 ms here (AMD Zen 4, 2 threads, L = 70), with float32 scores as SDPA keeps
    them; a SmolLM2 decode step at batch 8 / 32 took 37 / 67 ms against SDPA's 55 / 107 ms
    (interleaved, bf16, 2026-12-03). At batch 1 SDPA is as fast or faster eagerly (T = 5: 36
    against 39 ms) and keeps the path; in compiled steps (cpu_compile), where inductor
    fuses the casts, softmax and masking around these GEMMs but calls SDPA's flash kernel
    as it is, this path won at batch 1 too: a bf16 native SmolLM2 step over 128 slots took
    29.2 against 37.4 ms at T = 1 and 74.8 against 81.2 at T = 5 (AVX2 EPYC, 2 threads,
    interleaved, 2026-12-04); float32 steps gained nothing (55.9 / 55.6 ms) and keep
    SDPA."""
    B, T, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    # [B, Hkv, G * T, D]: the G query heads that share a KV head, each with its T rows
    qg = q.permute(0, 2, 1, 3).reshape(B, Hkv, G * T, D).float()
    s = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s = s.view(B, Hkv, G, T, L).masked_fill_(~mask[:, :, None], float("-inf"))
    p = torch.softmax(s.view(B, Hkv, G * T, L), dim=-1)
    o = torch.matmul(p, v.float()).view(B, Hq, T, D)
    return o.transpose(1, 2).to(q.dtype)


def _check_hidden_layers(hidden_layers: Sequence[int] | None, run: Sequence[int]) -> set[int]:
    """The layers whose output the forward keeps (each must be one that runs)."""
    if hidden_layers is None:
        return set()
    missing = sorted(set(hidden_layers) - set(run))
    if missing or not hidden_layers:
        raise ValueError(f"hidden_layers {list(hidden_layers)} must be non-empty layers that run")
    return set(hidden_layers)


class Transformer(nn.Module):
    """Llama / Qwen2 decoder. Built by the loaders (`specdec.models.load`)."""

    def __init__(
        self,
        config: ModelConfig,
        tok_embeddings: torch.Tensor | QuantizedWeight,
        blocks: Sequence[Block],
        norm: RMSNorm,
        lm_head: Linear,
    ):
        super().__init__()
        self.config = config
        self.tok_embeddings = tok_embeddings  # [V, dim], dense or quantized rows
        self.embed_dense: torch.Tensor | None = None
        self.layers = nn.ModuleList(blocks)
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.backend = "torch"
        self.cpu_linear = "dense"
        self.cos = self.sin = None
        self.layer_stream = None  # specdec.models.streaming: layers copied in just in time
        # batch-invariant forwards (set by `setup`; specdec.models.batch_invariant): a row of
        # a T-token verification computes exactly what a 1-token decode step at its slot
        # computes, so greedy speculative output equals plain greedy bit for bit even where
        # low-precision rounding (bf16, int8 activations) makes last-bit differences visible
        self.batch_invariant = False
        self.batch_invariant_reason = "off"

    # -- setup -----------------------------------------------------------------------------
    def setup(
        self,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: str | None = None,
        cpu_linear: str | None = None,
        batch_invariant_setting: str | bool | None = None,
        cpu_compile: str | bool | None = None,
    ):
        """Move to `device`, cast compute tensors to `dtype` and pick the kernel backend.
        `cpu_linear`: the CPU linear mode (`specdec.models.cpu_linear`; None: $SPECDEC_CPU_LINEAR
        or "dense"), used on the torch backend on CPU. `batch_invariant_setting`: auto | on | off
        (`specdec.models.batch_invariant`; None: $SPECDEC_BATCH_INVARIANT or auto).
        `cpu_compile`: off | on, compiled decode / verification steps on CPU
        (`specdec.models.cpu_compile`; None: $SPECDEC_CPU_COMPILE or off)."""
        device = torch.device(device)
        self.dtype, self.device = dtype, device
        self.backend = backend or resolve_backend(device)
        self.cpu_linear = resolve_mode(cpu_linear)
        self.cpu_compile = cpu_compile_setting(cpu_compile) == "on"
        if self.cpu_compile:
            check_compile(device, self.backend)
        emb = self.tok_embeddings
        tied = isinstance(emb, QuantizedWeight) and self.lm_head.qweight is emb
        if isinstance(emb, QuantizedWeight):
            self.tok_embeddings = emb.to(device)
        for m in self.modules():
            if isinstance(m, Linear):
                if m is self.lm_head and tied:
                    m.qweight = self.tok_embeddings
                elif m.qweight is not None:
                    m.qweight = m.qweight.to(device)
                if m.dense is not None:
                    m.dense = m.dense.to(device)
                if m.bias is not None:
                    m.bias = m.bias.to(device)
                m.prepare(self.backend, dtype, self.cpu_linear)
            elif isinstance(m, RMSNorm):
                m.weight = m.weight.to(device=device, dtype=torch.float32)
                m.out_dtype = dtype
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        setting = invariance.resolve_setting(batch_invariant_setting)
        if self.cpu_compile:
            # compiled steps run the graph-safe forward, which has no batch-invariant attention
            if setting == "on":
                raise SpecDecError(
                    "batch_invariant=on cannot be combined with cpu_compile=on (compiled steps "
                    "run the graph-safe forward, whose attention is not batch-invariant)"
                )
            setting = "off"
        self.batch_invariant, self.batch_invariant_reason = invariance.choose(
            setting,
            dtype,
            on_cpu_torch=self.backend == "torch" and device.type == "cpu",
            int8_activations=any(m.cpu is not None and m.cpu.backend == "ort" for m in linears),
            on_triton=self.backend == "triton",
        )
        if self.cpu_compile:
            self.batch_invariant_reason = "off (cpu_compile=on: the graph-safe forward)"
        if self.batch_invariant:
            verdicts: dict = {}
            problems = [m.cpu.make_invariant(verdicts) for m in linears if m.cpu is not None]
            problems = [p for p in problems if p is not None]
            if problems and setting == "on":
                raise SpecDecError(f"batch_invariant=on is not possible here: {problems[0]}")
            if problems:  # a kernel of this machine computes a row differently for other M
                for m in linears:
                    if m.cpu is not None:
                        m.cpu.invariant = False
                self.batch_invariant = False
                self.batch_invariant_reason = f"off: not possible here ({problems[0]})"
                log.warning("batch invariance %s", self.batch_invariant_reason)
        if isinstance(emb, QuantizedWeight):
            # the tied LM head may already hold the dense copy: share it
            if tied and self.lm_head.dense is not None:
                self.embed_dense = self.lm_head.dense
            else:
                self.embed_dense = self.tok_embeddings.dequantize(dtype)
        else:
            self.embed_dense = emb.to(device=device, dtype=dtype)
            self.tok_embeddings = self.embed_dense
            if self.lm_head.qweight is None and self.lm_head.dense is emb:
                self.lm_head.dense = self.embed_dense
        self.cos, self.sin = (t.to(device) for t in rope_tables(self.config, device))
        release_free_heap()
        for kind, why in self.cpu_linear_report().items():
            log.info("CPU linear %s -> %s", kind, why)
        log.info("batch invariance: %s", self.batch_invariant_reason)
        return self

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        start_pos: torch.Tensor,
        *,
        layers: Sequence[int] | None = None,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        static: bool = False,
        hidden_layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] at cache slots start_pos[b] + i -> logits [B, T, V] (fp32).

        layers: run only these layer indices (ascending), then norm + LM head.
        positions: rotary positions [B, T] (default start_pos[b] + i; tree drafts pass depths).
        tree_mask: int64 [B, T] ancestor bits among the new tokens (bit j of row i: i sees j).
        logits_index: [B] index into T: return only that position's logits, [B, 1, V].
        static: no host syncs (CUDA-graph capturable): start_pos is never read on the host,
            the cache is written by device index and attention spans all `cache.max_len` slots
            (masked). The caller guarantees start_pos + T <= cache.max_len.
        hidden_layers: also return the residual stream after each of these layers for all T
            positions (trained draft heads read it): (logits, hidden [B, T, n, dim] fp32).
        """
        B, T = tokens.shape
        if not static and int(start_pos.max()) + T > cache.max_len:
            raise ValueError(
                f"forward past the cache: start {int(start_pos.max())} + {T} > {cache.max_len}"
            )
        stream = self.layer_stream
        h = self.embed_dense[tokens] if stream is None else stream.embed(tokens)  # [B, T, dim]
        # the residual stream stays fp32 whatever the compute dtype: one fused fp32 rms_norm per
        # norm instead of bf16's decomposed one (and no rounding of the running sum)
        h = h.to(torch.float32)
        if positions is None:
            positions = start_pos[:, None] + torch.arange(T, device=tokens.device)
        cos = self.cos[positions].to(self.dtype)[:, :, None]  # [B, T, 1, D]
        sin = self.sin[positions].to(self.dtype)[:, :, None]
        invariant = None
        # Triton backend: the invariant launches of every kernel, for forwards the attention
        # kernel runs (a longer prefill is shared by plain and speculative decoding) over
        # every layer (a self-drafter's partial forwards only propose tokens)
        rows_one = self.batch_invariant and self.backend == "triton" and T <= 64
        rows_one = rows_one and layers is None
        if self.batch_invariant and self.backend == "torch" and not static:
            c = self.config
            invariant = (c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim, cache.max_len)
        ctx = _StepContext(
            start_pos,
            T,
            tree_mask,
            self.backend,
            cache.max_len if static else None,
            invariant=invariant,
        )
        idx = range(len(self.layers)) if layers is None else layers
        blocks = ((i, self.layers[i]) for i in idx) if stream is None else stream.blocks(idx)
        want = _check_hidden_layers(hidden_layers, idx)
        hidden = {}
        ctx.static_cache = cache if static else None

        def layers_and_head(h):
            for i, block in blocks:
                ctx.layer = i
                h = block(h, cos, sin, cache.k[i], cache.v[i], ctx)
                if i in want:
                    hidden[i] = h
            if logits_index is not None:
                h = h[torch.arange(B, device=h.device), logits_index][:, None]
            lm_head = self.lm_head if stream is None else stream.lm_head()
            return lm_head(self.norm(h)).float()

        if rows_one:  # (never inside compiled CPU steps: the torch backend)
            with rows_as_one():
                logits = layers_and_head(h)
        else:
            logits = layers_and_head(h)
        if hidden_layers is None:
            return logits
        return logits, torch.stack([hidden[i] for i in hidden_layers], dim=2)  # [B, T, n, dim]

    def num_parameters_bytes(self) -> int:
        """Bytes of weights a full forward reads (packed size for quantized layers)."""
        return sum(m.weight_bytes() for m in self.modules() if isinstance(m, Linear))

    def cpu_linear_report(self) -> dict[str, str]:
        """Which CPU linear backend each kind of weight got and why ({} off the CPU path)."""
        out: dict[str, str] = {}
        for name, m in self.named_modules():
            if isinstance(m, Linear) and m.cpu_choice is not None:
                fmt = m.qweight.fmt if m.qweight is not None else str(m.dense.dtype)[6:]
                kind = name.split(".")[-1]
                out.setdefault(f"{kind} ({fmt})", f"{m.cpu_choice.backend}: {m.cpu_choice.reason}")
        return out
