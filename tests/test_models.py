"""The Llama-style model: named sizes, shapes, causality, tying, and the rule on dimensions."""

import pytest
import torch

from blockscale.models import SIZES, ModelConfig, Transformer, model_config


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("small", 45e6, 55e6), ("base", 115e6, 135e6), ("1b", 0.9e9, 1.1e9)],
)
def test_named_sizes_have_their_advertised_parameter_counts(name, low, high):
    assert low <= SIZES[name].num_params() <= high


def test_num_params_matches_the_module():
    for tie in (False, True):
        cfg = model_config("tiny", tie_embeddings=tie)
        model = Transformer(cfg)
        unique = {id(p): p.numel() for p in model.parameters()}
        assert sum(unique.values()) == cfg.num_params()


@pytest.mark.parametrize("name", list(SIZES))
def test_every_linear_dimension_is_a_multiple_of_32(name):
    cfg = SIZES[name]
    for dim in (cfg.dim, 3 * cfg.dim, cfg.ffn_dim, 2 * cfg.ffn_dim, cfg.vocab_size):
        assert dim % 32 == 0


def test_dimensions_that_break_blocks_are_refused():
    with pytest.raises(ValueError, match="dim=48 is not a multiple of 32"):
        ModelConfig(dim=48, n_layers=1, n_heads=2, ffn_dim=96, seq_len=16)
    with pytest.raises(ValueError, match="model size 'huge' does not exist"):
        model_config("huge")


def test_forward_is_causal_and_shaped():
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", seq_len=32))
    tokens = torch.randint(0, 256, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 256)
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :20], logits[:, :20], rtol=0, atol=0)
    assert not torch.equal(model(changed)[:, 20:], logits[:, 20:])


def test_tied_head_shares_the_embedding():
    model = Transformer(model_config("tiny", tie_embeddings=True))
    assert model.lm_head.weight is model.tok_embeddings.weight


def test_too_long_sequences_are_refused():
    model = Transformer(model_config("tiny", seq_len=16))
    with pytest.raises(ValueError, match="exceeds seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
