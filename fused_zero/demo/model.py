"""A tiny character-level GPT and its data, the workload of ``fused-zero demo``.

The demo trains this model under DDP twice, once with torch.optim and once with the sharded optimizer,
and compares the losses. The model is deliberately small enough to train on two CPU ranks in seconds,
yet has what makes a sharded optimizer earn its keep: parameters of many odd sizes (so the flat
buffers need padding and shard boundaries fall mid-parameter), biases and LayerNorms that usually get
no weight decay, and a weight tied between the embedding and the output head (one Parameter that
receives gradient from two places and must be stepped exactly once).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn as nn
import torch.nn.functional as F


def load_corpus() -> str:
    """The bundled public-domain text (~100 KB). Read through importlib.resources rather than a path
    relative to this file so that it also works from an installed wheel or a zipped package."""
    return resources.files("fused_zero.demo.data").joinpath("corpus.txt").read_text(encoding="utf-8")


class CharTokenizer:
    """One token per character. Sorting the alphabet makes the ids a function of the text alone, so
    every rank that builds a tokenizer from the same corpus agrees on them without communicating."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        """Characters outside the corpus raise KeyError: silently mapping them would hide a mix-up."""
        return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # one matmul for q, k and v
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    """Pre-LayerNorm: the residual stream is never normalised, which keeps training stable without
    warmup at this size and makes the two optimizers' trajectories easy to compare."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # The same Parameter object, not a copy: parameters() yields it once, and its gradient is
            # the sum of the embedding's and the head's contributions.
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)  # draws from the global RNG: torch.manual_seed fixes the init

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """Small weights make the initial logits nearly uniform, so the loss starts at ~ln(vocab)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx`` (B, T) token ids -> (logits (B, T, vocab), mean cross-entropy or None)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample a continuation, to show what the trained model has picked up; pass a generator for
        a sample that does not depend on (or disturb) the global RNG."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def batches(data: torch.Tensor, *, batch_size: int, block_size: int, rank: int, world_size: int,
            seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) batches of random windows of ``data``, y being x shifted by one token.

    Each rank draws from its own torch.Generator seeded from (seed, rank), so under DDP the ranks see
    different data (the global batch is world_size * batch_size windows) while any run, and any
    single rank of it, can be replayed exactly, independently of the global RNG that the model init
    and dropout consume.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if data.dim() != 1 or data.numel() <= block_size:
        raise ValueError("data must be a 1-D tensor longer than block_size")
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # distinct for every rank < 1_000_003
    offsets = torch.arange(block_size)
    while True:
        starts = torch.randint(data.numel() - block_size, (batch_size, 1), generator=g)
        idx = starts + offsets
        yield data[idx], data[idx + 1]


def param_count(model: nn.Module) -> int:
    """Distinct parameters only: a tied weight is counted once, as the optimizer sees it."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["load_corpus", "CharTokenizer", "GPTConfig", "GPT", "batches", "param_count"]
