"""The decode layout is a type: `decode_layout` returns `DecodeParams` whose `.layout` says what was done (unrolled,
fused, unembedding pre-transposed), and every function reads that rather than which keys happen to be present."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdecode.config import ModelConfig
from pdecode.model.attention import padded_self_mask
from pdecode.model.transformer import (CANONICAL, DecodeLayers, DecodeParams, Layout, decode_layout, forward,
                                       init_params, layout_of, unembed, unrolled)


@pytest.fixture(scope="module", autouse=True)
def _layout():
    from tests.helpers import unrolled_layout

    with unrolled_layout():  # the production layout (the suite otherwise runs layers under lax.scan)
        yield


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, family="llama", tie_word_embeddings=True)
    return ModelConfig(**{**base, **kw})


def _logits(params, cfg, toks):
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return unembed(params, cfg, forward(params, cfg, toks, pos, padded_self_mask(jnp.full((b,), t), t)).hidden)


@pytest.mark.parametrize("cfg_kw,fuse,want", [
    ({}, True, Layout(unrolled=True, fused=True, unembed_t=True)),
    ({}, False, Layout(unrolled=True, fused=False, unembed_t=True)),
    ({"tie_word_embeddings": False}, True, Layout(unrolled=True, fused=True, unembed_t=False)),
    ({"num_layers": 17}, True, Layout(unrolled=False, fused=False, unembed_t=True)),  # deep: keeps lax.scan
])
def test_decode_layout_states_its_layout_and_computes_the_same(cfg_kw, fuse, want):
    cfg = _cfg(**cfg_kw)
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert layout_of(params) == CANONICAL and not unrolled(params)
    dp = jax.jit(lambda p: decode_layout(p, cfg, fuse=fuse))(params)  # the type survives jit
    assert isinstance(dp, DecodeParams) and dp.layout == want and unrolled(dp) == want.unrolled
    assert isinstance(dp["layers"], DecodeLayers) == want.unrolled
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda p: _logits(p, cfg, toks))(dp)),
                               np.asarray(_logits(params, cfg, toks)), rtol=2e-5, atol=2e-5)
    assert decode_layout(dp, cfg) is dp  # idempotent


def test_decode_params_refuse_a_layout_that_does_not_match():
    cfg = _cfg()
    params = init_params(cfg, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="does not match"):
        DecodeParams(dict(params), Layout(unrolled=False, fused=False, unembed_t=True))  # no unembed_t given
