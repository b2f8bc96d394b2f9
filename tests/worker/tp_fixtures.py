"""A random-weight checkpoint whose greedy decisions are not near-ties in bfloat16.

Plain random weights (every tensor N(0, std)) give Gaussian logits over the whole vocabulary:
the top-2 gap is ~1/sqrt(2 ln V) of a standard deviation, and at V = 32k about 40 % of
positions have it below bf16's resolution of the logits (a few ulps of the top logit), where
any reordering of a sum — TP=2's all-reduce of partial sums against TP=1's single GEMM —
flips the winner. A trained model is confident; this fixture is made confident on purpose,
while its decision still depends on what the layers compute:

- the LM head is cold random rows (N(0, `cold_std`): their logits stay far below the hot
  ones) plus one antipodal pair of hot rows, +`scale`·u and -`scale`·u for a random unit
  vector u: the top-1 token is one of the pair, chosen by the sign of a = u·h (h the final
  normed hidden state), and its top-2 gap is 2|a|·scale — twice the top logit, far above
  bf16's resolution wherever a is not near 0;
- a is kept away from 0 without being fixed by the input token: every embedding row gets a
  component of ±`offset`·|row| along u (a random sign per token; the row's own component
  along u removed first), which the residual stream carries to h, and which the attention
  and MLP outputs (mixing other tokens' signs, and their own directions) add to or
  override. `decided_by_layers` measures how often the prediction differs from the input
  token's own sign: 5-14 % of positions on the CPU shape (hidden 512, 4 layers), depending
  on the sequences — more than the 1 % a group that computed the layers wrong could lose.
  A smaller offset lets the layers decide more (0.5: ~30 %) but brings positions with a
  near 0 back (bf16 TP=2 vs TP=1 agreement 99.2 % instead of 99.8-100 % on 512 positions).

Every tensor keeps its real shape; only values of `lm_head.weight` and
`model.embed_tokens.weight` change (the checkpoint must not tie them).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fixtures_models import make_tiny_model

#: Sizes of the construction (see the module doc).
HOT_SCALE = 16.0
COLD_STD = 1e-4
EMBED_OFFSET = 1.0


def make_decisive_model(path: Path, *, seed: int = 0, scale: float = HOT_SCALE, cold_std: float = COLD_STD,
                        offset: float = EMBED_OFFSET, **shape) -> Path:
    """`make_tiny_model(path, "llama", **shape)` with the decisive LM head and embedding
    offsets; writes `decisive.json` (the hot token ids and every token's sign) beside it."""
    make_tiny_model(path, "llama", seed=seed, **shape)
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{path}: expected one safetensors file, found {len(files)} (raise max_shard_size)")
    weights = load_file(str(files[0]))
    if "lm_head.weight" not in weights:
        raise ValueError("the decisive head needs untied embeddings (tie_word_embeddings=False)")
    head, emb = weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed + 1)
    vocab, hidden = head.shape
    u = torch.randn(hidden, generator=g, dtype=torch.float64)
    u /= u.norm()
    new_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * cold_std
    hot = torch.randperm(vocab, generator=g)[:2].tolist()
    new_head[hot[0]], new_head[hot[1]] = scale * u, -scale * u
    sign = torch.randint(0, 2, (vocab,), generator=g).double() * 2 - 1
    e = emb.double()
    e = e - (e @ u)[:, None] * u[None]
    e = e + (offset * sign * e.norm(dim=1))[:, None] * u[None]
    weights["lm_head.weight"] = new_head.to(head.dtype).contiguous()
    weights["model.embed_tokens.weight"] = e.to(emb.dtype).contiguous()
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    (path / "decisive.json").write_text(json.dumps({"hot": hot, "sign": sign.int().tolist()}))
    return path


def resolved(logits: torch.Tensor, ulps: float = 4.0) -> torch.Tensor:
    """Positions whose top-2 gap exceeds `ulps` bf16 epsilons of the top logit's magnitude."""
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) > ulps * torch.finfo(torch.bfloat16).eps * top[..., 0].abs()


def decided_by_layers(path: Path, tokens: torch.Tensor, top1: torch.Tensor) -> float:
    """Share of positions whose top-1 is not the hot token the input token's own sign points
    to (the layers, not the embedding alone, chose it)."""
    meta = json.loads((path / "decisive.json").read_text())
    sign = torch.tensor(meta["sign"])[tokens]
    by_embedding = torch.where(sign > 0, meta["hot"][0], meta["hot"][1])
    return (top1 != by_embedding).float().mean().item()
