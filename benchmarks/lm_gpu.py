"""8. The transformer on one GPU: model FLOP/s and its share of the card's dense bf16 peak,
with bf16 autocast and torch.compile, for trainyard's attention (queries, keys and values as
three projections, which tensor parallelism splits by head, computed in one matmul of their
concatenated weights) against the fused `qkv` projection it had before, and against three
separate matmuls (how a tensor-parallel worker computes them).

A GPT of 12 blocks, width 1024, 16 heads, context 1024 and a byte vocabulary (about 150M
parameters), AdamW, random tokens held in GPU memory, one process. FLOPs per token are
`trainyard.models.zoo.transformer_flops_per_token` (6N plus attention). Skipped without
CUDA; needs no store: `python -m benchmarks.run --only lm_gpu`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import interleaved, per_repetition, ratio, summary
from trainyard.models.zoo import GPT, CausalSelfAttention, transformer_flops_per_token

LAYERS, WIDTH, HEADS, CONTEXT, VOCAB, BATCH = 12, 1024, 16, 1024, 256, 8
# Dense bf16 tensor-core peaks (no sparsity), by the start of the device name.
PEAK_TFLOPS = {"NVIDIA H100": 989.0, "NVIDIA H200": 989.0, "NVIDIA A100": 312.0}


class FusedAttention(CausalSelfAttention):
    """The attention as it was: one `qkv` Linear, its output split into thirds."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__(width, heads, dropout)
        del self.q, self.k, self.v
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, width = x.shape
        shape = (batch, time_, width // self.head_width, self.head_width)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(batch, time_, width)))


class SeparateAttention(CausalSelfAttention):
    """Three projections, three matmuls: how a tensor-parallel worker computes its heads."""

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q(x), self.k(x), self.v(x)


def run(project: object, quick: bool) -> dict:
    if not torch.cuda.is_available():
        return {"figures": {}, "ratios": {}, "skipped": "no CUDA device"}
    steps, reps = (10, 2) if quick else (30, 3)
    device = torch.device("cuda")
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), device=device)
    # Unmeasured: the first model compiled and run paid for the compiler's own start and the
    # GPU's clocks rising (a first contender measured 0.75x of itself in a later repetition).
    _steps_per_s(_model(), tokens, steps)
    flops = transformer_flops_per_token(_model()) * BATCH * CONTEXT
    measured = interleaved(
        reps,
        {
            "three projections": lambda: _steps_per_s(_model(), tokens, steps),
            "fused qkv": lambda: _steps_per_s(_model(FusedAttention), tokens, steps),
            "three projections, separate matmuls": lambda: _steps_per_s(
                _model(SeparateAttention), tokens, steps
            ),
        },
    )
    name = torch.cuda.get_device_name(0)
    peak = next((p for prefix, p in PEAK_TFLOPS.items() if name.startswith(prefix)), None)
    figures = {}
    for label, values in measured.items():
        tflops = [v * flops / 1e12 for v in values]
        figures[f"{label}, model TFLOP/s"] = summary(tflops)
        if peak:
            figures[f"{label}, share of dense bf16 peak"] = summary([t / peak for t in tflops])
    return {
        "figures": figures,
        "ratios": {
            "three projections / fused qkv, steps/s": ratio(
                measured["three projections"], measured["fused qkv"]
            ),
            **per_repetition(
                "three projections / fused qkv",
                measured["three projections"],
                measured["fused qkv"],
            ),
        },
        "device": name,
    }


def _model(attention: type[CausalSelfAttention] | None = None) -> GPT:
    """The transformer, its attention replaced by `attention`'s where given."""
    torch.manual_seed(0)
    model = GPT(VOCAB, CONTEXT, LAYERS, HEADS, WIDTH, dropout=0.0)
    if attention is not None:
        for block in model.blocks:
            setattr(block, "attn", attention(WIDTH, HEADS, 0.0))  # noqa: B010
    return model


def _steps_per_s(model: GPT, tokens: torch.Tensor, steps: int) -> float:
    """Training steps per second after compiling and warming up, bf16 autocast."""
    model = model.to(tokens.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    compiled = torch.compile(model)

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            logits = compiled(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compile, then the allocator's steady state
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - started)
