"""Built-in models: the factories `model.name` names (SPEC_FACTORIES), and the table
models they build on. No torch.distributed here, and nothing of the registry, which reads
SPEC_FACTORIES from here.

A factory is called as `factory(spec, **model.options)` and returns an nn.Module.

Shard-unit protocol: a model may declare `shard_units() -> list[nn.Module]`, the repeated
blocks worth sharding on their own. With `strategy: fsdp`, trainyard.parallel.wrap applies
`fully_shard` to each of them, then to the root; parameters outside them (embeddings,
head, final norm) belong to the root's unit. A model without the method is sharded as one
root unit.

Tensor-plan protocol: a model that can be split with `train.parallel.tensor` declares
`tensor_plan(degree) -> {module name pattern: "columns" | "rows" | "columns_gathered"}`
(trainyard.parallel.tensor says what each style does), raising ValueError where it cannot
be split `degree` ways.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from trainyard.data_spec import DataSpec

# ---------------------------------------------------------------- tables


def mlp(
    in_features: int,
    num_classes: int,
    hidden_sizes: Sequence[int] = (128, 64),
    dropout: float = 0.0,
) -> nn.Module:
    layers: list[nn.Module] = []
    width = in_features
    for hidden in hidden_sizes:
        layers += [
            nn.Linear(width, hidden),
            nn.ReLU(),
            nn.Dropout(dropout) if dropout else nn.Identity(),
        ]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return indexed_sequential(layers)


def indexed_sequential(layers: Sequence[nn.Module]) -> nn.Sequential:
    """`nn.Sequential(*layers)` without its Identity layers, every other one under the index
    it would have had: a model without dropout has the checkpoint keys of one with it, and
    its forward skips a module call per Identity (~1.5 us each, on 0.7 ms digits steps)."""
    kept = ((str(i), layer) for i, layer in enumerate(layers) if not isinstance(layer, nn.Identity))
    return nn.Sequential(OrderedDict(kept))


def linear(in_features: int, num_classes: int) -> nn.Module:
    """Multinomial logistic regression."""
    return nn.Linear(in_features, num_classes)


def mlp_for(
    spec: DataSpec, hidden_sizes: Sequence[int] = (128, 64), dropout: float = 0.0
) -> nn.Module:
    model = mlp(spec.num_features, spec.num_outputs, hidden_sizes, dropout)
    return _flatten_if_needed(spec, model)


def linear_for(spec: DataSpec) -> nn.Module:
    return _flatten_if_needed(spec, linear(spec.num_features, spec.num_outputs))


def _flatten_if_needed(spec: DataSpec, model: nn.Module) -> nn.Module:
    """A table's model is returned as is, so its checkpoint keys stay those of today."""
    if len(spec.input_shape) == 1:
        return model
    return nn.Sequential(nn.Flatten(), model)


# ---------------------------------------------------------------- images


def cnn(spec: DataSpec, channels: Sequence[int] = (16, 32), dropout: float = 0.0) -> nn.Module:
    """3x3 conv + ReLU + 2x2 max-pool per entry of `channels`, for N x C x H x W input.

    Padding and ceil-mode pooling keep every map at least 1x1, and the adaptive pool fixes
    the head's input size, so any H, W work (8x8 digits included).
    """
    if spec.kind != "image":
        raise ValueError(f"model cnn needs image data (N x C x H x W), got {spec.kind!r}")
    if not channels or any(c < 1 for c in channels):
        raise ValueError(f"cnn channels = {tuple(channels)}: give one positive width per layer")
    layers: list[nn.Module] = []
    width = spec.input_shape[0]
    for out in channels:
        layers += [
            nn.Conv2d(width, out, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, ceil_mode=True),
        ]
        width = out
    # 2x2 rather than global pooling: keeps coarse layout (which corner a stroke is in).
    layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten()]
    layers += [nn.Dropout(dropout) if dropout else nn.Identity()]
    layers.append(nn.Linear(width * 4, spec.num_outputs))
    return indexed_sequential(layers)


# ---------------------------------------------------------------- tokens


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Queries, keys and values are three projections, not
    one fused: a tensor-parallel split of each by output rows gives a worker whole heads
    (a row split of a fused [q; k; v] would hand one worker all of q and half of k)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_width = width // heads
        self.dropout = dropout
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = self._project(x)
        # Heads are counted from the projections' own width: a tensor-parallel worker holds
        # width / tensor of it, so heads / tensor of them. Spelled out, not -1: a view of an
        # empty batch cannot infer it.
        width = q.shape[-1]
        shape = (batch, time, width // self.head_width, self.head_width)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, time, width)
        return self.resid_drop(self.proj(y))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values. Where the three weights are plain tensors, in one matmul
        of their concatenation: three matmuls trained the model at 0.75x the fused speed on an
        H200 (benchmarks/lm_gpu.py). Split across workers (DTensors), each goes on its own."""
        projections = (self.q, self.k, self.v)
        if any(type(p.weight) is not nn.Parameter for p in projections):
            return self.q(x), self.k(x), self.v(x)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([cast(torch.Tensor, p.bias) for p in projections])
        q, k, v = F.linear(x, weight, bias).chunk(3, dim=-1)
        return q, k, v


def split_fused_qkv(state: dict[str, Any]) -> bool:
    """Rename, in place, a transformer state dict saved when queries, keys and values were one
    fused `attn.qkv` Linear, to the three projections they are now (the same weights, rows
    [q; k; v]); whether it had any."""
    fused = [key for key in state if re.search(r"(^|\.)attn\.qkv\.(weight|bias)$", key)]
    for key in fused:
        prefix, kind = key.rsplit("qkv.", 1)
        for name, part in zip("qkv", state.pop(key).chunk(3), strict=True):
            state[f"{prefix}{name}.{kind}"] = part
    return bool(fused)


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Linear(4 * width, width),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer: (B, T) token ids -> (B, T, vocab) next-token logits.

    The head is tied to the token embedding (as GPT-2 and nanoGPT): it saves vocab x width
    parameters and trains as well at this size, and both tensors stay in the root's FSDP
    unit, so the shared weight never crosses a shard boundary.
    """

    def __init__(
        self, vocab_size: int, context: int, layers: int, heads: int, width: int, dropout: float
    ) -> None:
        super().__init__()
        self.context = context
        self.width = width
        self.heads = heads
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self._init_weights(layers)

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_stages(self) -> list[nn.Module]:
        """The pieces trainyard.parallel.pipeline groups into stages, in order: the
        embeddings, each block, then the final norm and the head (tied to the embedding)."""
        return [_Embed(self), *self.blocks, _Head(self)]

    def tensor_plan(self, degree: int) -> dict[str, str]:
        """How trainyard.parallel.tensor splits it across `degree` workers (Megatron-LM's
        split): queries, keys, values and the MLP's first layer by output, so each worker
        holds whole heads; the attention's output and the MLP's second layer by input; the
        tied embedding and head by vocabulary row, the logits gathered whole."""
        if self.heads % degree:
            raise ValueError(
                f"the transformer's {self.heads} heads do not split into {degree} equal parts: set "
                f"train.parallel.tensor to a divisor of model.options.heads"
            )
        return {
            "tok": "rows",
            "head": "columns_gathered",
            **{f"blocks.*.attn.{name}": "columns" for name in ("q", "k", "v")},
            "blocks.*.attn.proj": "rows",
            "blocks.*.mlp.0": "columns",
            "blocks.*.mlp.2": "rows",
        }

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = _embed(self.tok, self.pos, self.drop, self.context, idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _init_weights(self, layers: int) -> None:
        """nanoGPT's scheme: N(0, 0.02), zero biases, and residual projections scaled by
        1/sqrt(2 * layers) so the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in cast("list[Block]", list(self.blocks)):
            for proj in cast("list[nn.Linear]", [block.attn.proj, block.mlp[2]]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))


def _embed(
    tok: nn.Module, pos: nn.Module, drop: nn.Module, context: int, idx: torch.Tensor
) -> torch.Tensor:
    time = idx.shape[1]
    if time > context:
        raise ValueError(f"sequence length {time} exceeds the model's context {context}")
    positions = torch.arange(time, device=idx.device)
    return drop(tok(idx) + pos(positions))


class _Embed(nn.Module):
    """The transformer's first pipeline piece: token ids -> the residual stream."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.context = model.context
        self.tok, self.pos, self.drop = model.tok, model.pos, model.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _embed(self.tok, self.pos, self.drop, self.context, idx)


class _Head(nn.Module):
    """The transformer's last pipeline piece: the residual stream -> next-token logits."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def transformer(
    spec: DataSpec,
    layers: int = 2,
    heads: int = 4,
    width: int = 64,
    context: int | None = None,
    dropout: float = 0.0,
) -> GPT:
    if spec.kind != "tokens" or spec.vocab_size is None:
        raise ValueError(f"model transformer needs token data with a vocab_size, got {spec.kind!r}")
    context = context or spec.context
    if context is None or context < 1:
        raise ValueError("model transformer needs a context: set model.options.context")
    if layers < 1 or heads < 1 or width % heads:
        raise ValueError(
            f"transformer layers={layers}, heads={heads}, width={width}: "
            "need layers >= 1 and width divisible by heads"
        )
    return GPT(spec.vocab_size, context, layers, heads, width, dropout)


def transformer_flops_per_token(model: GPT, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6N for the matmuls of forward + backward, plus 12*L*T*width
    for attention scores (PaLM appendix B, nanoGPT's estimate_mfu). N leaves out the
    position embedding, a lookup; the tied token embedding counts as the head's matmul."""
    n_params = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    time = seq_len or model.context
    return 6.0 * n_params + 12.0 * len(model.blocks) * time * model.width


SPEC_FACTORIES = {"mlp": mlp_for, "linear": linear_for, "cnn": cnn, "transformer": transformer}
