"""The spec-based model zoo: shapes, causality, learning on real data, determinism."""

from __future__ import annotations

import collections
import inspect
import json
import json.decoder
import math

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

from trainyard.data_spec import DataSpec
from trainyard.models import zoo as models
from trainyard.models.zoo import (
    GPT,
    cnn,
    linear_for,
    mlp_for,
    split_fused_qkv,
    transformer,
    transformer_flops_per_token,
)

DIGITS = DataSpec("image", (1, 8, 8), num_outputs=10)


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: on a shared 2-core machine a second intra-op thread only
    waits for the other processes (measured 0.8 s vs 6.9 s for the text run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokens_spec(context: int = 16) -> DataSpec:
    return DataSpec("tokens", (context,), num_outputs=256, vocab_size=256, context=context)


def tiny_gpt(seed: int = 0, context: int = 16, width: int = 32) -> GPT:
    torch.manual_seed(seed)
    return transformer(tokens_spec(context), layers=2, heads=4, width=width)


# ---------------------------------------------------------------- DataSpec


def test_data_spec_round_trips_through_json():
    for spec in (DIGITS, tokens_spec(), DataSpec("table", (13,), num_outputs=1)):
        assert DataSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "audio", "input_shape": (3,), "num_outputs": 2}, "use one of"),
        ({"kind": "image", "input_shape": (8, 8), "num_outputs": 2}, r"\(C, H, W\)"),
        ({"kind": "table", "input_shape": (0,), "num_outputs": 2}, "positive sizes"),
        ({"kind": "table", "input_shape": (4,), "num_outputs": 0}, "num_outputs"),
        ({"kind": "tokens", "input_shape": (8,), "num_outputs": 256}, "vocab_size and context"),
    ],
)
def test_data_spec_refuses_nonsense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataSpec(**kwargs)


def test_data_spec_from_dict_refuses_unknown_fields():
    with pytest.raises(ValueError, match="unknown fields"):
        DataSpec.from_dict({**DIGITS.to_dict(), "colour": "rgb"})


# ---------------------------------------------------------------- shapes


def test_output_shapes():
    assert cnn(DIGITS)(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    rgb = DataSpec("image", (3, 4, 7), num_outputs=3)
    assert cnn(rgb, channels=(4, 4, 4))(torch.zeros(2, 3, 4, 7)).shape == (2, 3)
    assert tiny_gpt()(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 256)
    assert tiny_gpt()(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, 256)
    assert mlp_for(DIGITS)(torch.zeros(4, 1, 8, 8)).shape == (4, 10)
    assert linear_for(DIGITS)(torch.zeros(4, 1, 8, 8)).shape == (4, 10)


def test_table_adapters_keep_todays_checkpoint_keys():
    table = DataSpec("table", (13,), num_outputs=3)
    torch.manual_seed(0)
    adapted = mlp_for(table, hidden_sizes=(8,), dropout=0.1).state_dict()
    torch.manual_seed(0)
    today = models.mlp(13, 3, hidden_sizes=(8,), dropout=0.1).state_dict()
    assert adapted.keys() == today.keys()
    assert all(torch.equal(adapted[k], today[k]) for k in today)
    assert isinstance(linear_for(table), nn.Linear)


def test_transformer_refuses_too_long_input_and_bad_options():
    with pytest.raises(ValueError, match="exceeds the model's context 16"):
        tiny_gpt()(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by heads"):
        transformer(tokens_spec(), heads=3, width=32)
    with pytest.raises(ValueError, match="needs image data"):
        cnn(tokens_spec())


# ---------------------------------------------------------------- transformer structure


def test_transformer_is_causal():
    model = tiny_gpt().eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    t = 6
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_same_seed_same_weights():
    a, b, c = tiny_gpt(seed=3), tiny_gpt(seed=3), tiny_gpt(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.q.weight"], sc["blocks.0.attn.q.weight"])
    assert sa["tok.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_shard_units_are_the_blocks_and_head_is_tied():
    model = tiny_gpt()
    units = model.shard_units()
    assert len(units) == 2 and all(u is b for u, b in zip(units, model.blocks, strict=True))
    assert model.head.weight is model.tok.weight


def test_flops_per_token_matches_the_formula():
    model = tiny_gpt(width=32)
    n = sum(p.numel() for p in model.parameters()) - 16 * 32  # minus position embedding
    assert transformer_flops_per_token(model) == 6 * n + 12 * 2 * 16 * 32


# ---------------------------------------------------------------- learning on real data


def test_transformer_learns_real_text_below_its_unigram_entropy():
    text = inspect.getsource(json.decoder).encode()
    counts = collections.Counter(text)
    unigram = -sum(c / len(text) * math.log(c / len(text)) for c in counts.values())
    data = torch.tensor(list(text))
    model, context = tiny_gpt(), 16
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)

    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(data) - context - 1, (size,), generator=generator)
        windows = torch.stack([data[s : s + context + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]

    for _ in range(200):
        x, y = batch(16)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    x, y = batch(128)
    with torch.no_grad():
        final = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert final < unigram - 0.3, (final, unigram)


def test_cnn_overfits_64_digits():
    digits = load_digits()
    x = torch.tensor(digits.data[:64] / 16.0, dtype=torch.float32).reshape(64, 1, 8, 8)
    y = torch.tensor(digits.target[:64])
    torch.manual_seed(0)
    model = cnn(DIGITS)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.95, accuracy


def test_models_build_on_the_meta_device():
    """check_model_builds validates options on meta: the init must not need real storage."""
    with torch.device("meta"):
        model = transformer(tokens_spec(), layers=1, heads=2, width=8)
        cnn(DIGITS)
    assert model.tok.weight.is_meta


def test_a_transformer_saved_with_a_fused_qkv_loads_into_three_projections():
    """Checkpoints from before the split hold `attn.qkv` = rows [q; k; v]: they load with the
    same outputs."""
    torch.manual_seed(0)
    model = GPT(vocab_size=50, context=8, layers=2, heads=4, width=16, dropout=0.0)
    old: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        prefix, _, rest = key.rpartition("attn.")
        if rest.startswith(("k.", "v.")):
            continue
        if rest.startswith("q."):
            kind = rest[2:]
            parts = [model.state_dict()[f"{prefix}attn.{n}.{kind}"] for n in "qkv"]
            old[f"{prefix}attn.qkv.{kind}"] = torch.cat(parts)
        else:
            old[key] = value
    fresh = GPT(vocab_size=50, context=8, layers=2, heads=4, width=16, dropout=0.0)
    assert split_fused_qkv(old) and not split_fused_qkv(dict(old))
    fresh.load_state_dict(old)
    tokens = torch.randint(0, 50, (3, 8))
    assert torch.equal(fresh(tokens), model(tokens))
