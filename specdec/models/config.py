"""Model hyper-parameters shared by the Llama and Qwen2 families."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import SpecDecError

ARCHITECTURES = ("llama", "qwen2")


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 -> dim // n_heads
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    # Llama-3 style frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None = plain RoPE
    rope_scaling: dict | None = field(default=None)
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise SpecDecError(f"unsupported architecture {self.arch!r} (supported: llama, qwen2)")
        for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecDecError(f"model config: {k} must be a positive integer, got {v!r}")
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise SpecDecError(
                f"n_heads={self.n_heads} not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
