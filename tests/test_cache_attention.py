"""KV cache operations and mask builders, against brute-force NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdecode.config import ModelConfig
from pdecode.errors import ConfigError
from pdecode.model import attention
from pdecode.model import cache as kvc

CFG = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=4)


def _filled(b=3, s=16, seed=0, per_layer=False):
    c = kvc.init_cache(CFG, b, s)
    rng = np.random.default_rng(seed)
    k = rng.normal(size=c.k.shape).astype(np.float32)  # [L, B, KV, hd, S]
    v = rng.normal(size=c.v.shape).astype(np.float32)  # [L, B, KV, S, hd]
    if per_layer:
        c = kvc.init_cache(CFG, b, s, per_layer=True)
        return c.replace(k=tuple(jnp.asarray(x) for x in k), v=tuple(jnp.asarray(x) for x in v)), k, v
    return c.replace(k=jnp.asarray(k), v=jnp.asarray(v)), k, v


def _stacked(c):
    return (np.stack([np.asarray(x) for x in c.k]) if c.per_layer else np.asarray(c.k),
            np.stack([np.asarray(x) for x in c.v]) if c.per_layer else np.asarray(c.v))


@pytest.mark.parametrize("per_layer", [False, True])
def test_write_layer_at_per_row_offsets(per_layer):
    c, k0, v0 = _filled(per_layer=per_layer)
    new = np.arange(3 * 1 * 4 * 4, dtype=np.float32).reshape(3, 1, 4, 4) + 100  # [B, KV, T, hd]
    off = np.array([0, 5, 14])  # last row runs past max_len: slots 16, 17 are dropped
    c2 = kvc.write_layer(c, 1, jnp.asarray(new), jnp.asarray(-new), jnp.asarray(off))
    k, v = _stacked(c2)
    ek, ev = k0.copy(), v0.copy()
    for b in range(3):
        for t in range(4):
            if off[b] + t < 16:
                ek[1, b, :, :, off[b] + t] = new[b, :, t]
                ev[1, b, :, off[b] + t] = -new[b, :, t]
    np.testing.assert_array_equal(k, ek)
    np.testing.assert_array_equal(v, ev)
    np.testing.assert_array_equal(k[0], k0[0])  # other layer untouched


@pytest.mark.parametrize("per_layer", [False, True])
def test_commit_gathers_accepted_nodes_and_advances(per_layer):
    c, k0, v0 = _filled(per_layer=per_layer)
    c = kvc.set_lengths(c, jnp.array([2, 5, 9]))
    # fresh region at lengths..lengths+5; accepted paths (node indices) per row, n accepted per row
    idx = np.array([[0, 2, 4, 0], [0, 1, 2, 3], [0, 3, 1, 1]])
    n = np.array([3, 4, 1])
    c2 = kvc.commit(c, jnp.asarray(idx), jnp.asarray(n))
    np.testing.assert_array_equal(np.asarray(c2.lengths), [5, 9, 10])
    k, v = _stacked(c2)
    # compare the committed prefix, slot by slot (keys are stored [.., hd, S], values [.., S, hd])
    for b, start in enumerate([2, 5, 9]):
        for j in range(n[b]):
            np.testing.assert_array_equal(k[:, b, :, :, start + j], k0[:, b, :, :, start + idx[b, j]])
            np.testing.assert_array_equal(v[:, b, :, start + j], v0[:, b, :, start + idx[b, j]])
        np.testing.assert_array_equal(k[:, b, :, :, :start], k0[:, b, :, :, :start])


def test_commit_with_identity_is_advance_and_rollback():
    c, k0, _ = _filled()
    c = kvc.set_lengths(c, jnp.array([1, 2, 3]))
    idx = jnp.tile(jnp.arange(4), (3, 1))
    n = jnp.array([4, 0, 2])
    a = kvc.commit(c, idx, n)
    b = kvc.advance(c, n)
    np.testing.assert_array_equal(np.asarray(a.k), np.asarray(b.k))
    np.testing.assert_array_equal(np.asarray(a.lengths), [5, 2, 5])
    r = kvc.rollback(a, jnp.array([2, 5, 1]))
    np.testing.assert_array_equal(np.asarray(r.lengths), [3, 0, 4])


def test_commit_is_jittable_and_static_shaped():
    c, _, _ = _filled()
    f = jax.jit(kvc.commit)
    c2 = f(c, jnp.zeros((3, 5), jnp.int32), jnp.array([1, 1, 1]))
    assert c2.k.shape == c.k.shape and c2.lengths.dtype == jnp.int32


def _brute_ancestors(parents):
    n = len(parents)
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("per_layer", [False, True])
def test_grow_keeps_slots_and_appends_zeros(per_layer):
    c, k, v = _filled(per_layer=per_layer)
    c = kvc.set_lengths(c, jnp.array([3, 16, 0]))
    g = jax.jit(kvc.grow, static_argnums=1)(c, 24)
    gk, gv = _stacked(g)
    assert g.max_len == 24 and g.per_layer == per_layer
    np.testing.assert_array_equal(gk[..., :16], k)
    np.testing.assert_array_equal(gv[..., :16, :], v)
    assert not gk[..., 16:].any() and not gv[..., 16:, :].any()
    np.testing.assert_array_equal(g.lengths, [3, 16, 0])
    assert kvc.grow(c, 16) is c
    with pytest.raises(ValueError, match="more than"):
        kvc.grow(c, 8)


def test_tree_mask_matches_brute_force():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 26, 64):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        np.testing.assert_array_equal(np.asarray(attention.tree_intra(jnp.asarray(parents))), _brute_ancestors(parents))
    # batched: one tree per row
    ps = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    got = np.asarray(attention.tree_intra(jnp.asarray(ps)))
    for r in range(2):
        np.testing.assert_array_equal(got[r], _brute_ancestors(ps[r]))


def test_cache_mask_brute_force():
    rng = np.random.default_rng(1)
    b, t, s = 3, 4, 12
    prev = np.array([0, 3, 8])
    intra = rng.random((b, t, t)) < 0.5
    valid = rng.random((b, t)) < 0.8
    got = np.asarray(attention.cache_mask(jnp.asarray(prev), jnp.asarray(intra), s, jnp.asarray(valid)))
    exp = np.zeros((b, t, s), bool)
    for r in range(b):
        for q in range(t):
            for k in range(s):
                if k < prev[r]:
                    exp[r, q, k] = True
                elif k - prev[r] < t:
                    j = k - prev[r]
                    exp[r, q, k] = intra[r, q, j] and valid[r, j]
    np.testing.assert_array_equal(got, exp)


def test_attention_matches_naive_softmax():
    rng = np.random.default_rng(2)
    b, t, s, h, kv, d = 2, 3, 5, 4, 2, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k = rng.normal(size=(b, kv, s, d)).astype(np.float32)
    v = rng.normal(size=(b, kv, s, d)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.6
    mask[..., 0] = True
    got = np.asarray(attention.attend(jnp.asarray(q), jnp.asarray(k.transpose(0, 1, 3, 2)), jnp.asarray(v),
                                      jnp.asarray(mask)))
    exp = np.zeros_like(got)
    for r in range(b):
        for i in range(t):
            for hh in range(h):
                g = hh // (h // kv)
                sc = k[r, g] @ q[r, i, hh] / np.sqrt(d)
                sc = np.where(mask[r, i], sc, -np.inf)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                exp[r, i, hh] = p @ v[r, g]
    np.testing.assert_allclose(got, exp, atol=1e-5)


def test_scale_softcap_and_sinks_match_naive_softmax():
    """attend's score scale (Gemma's query_pre_attn_scalar), tanh softcap (Gemma 2) and per-head sink logits
    (gpt-oss: in the denominator, reading no value) against a loop."""
    rng = np.random.default_rng(3)
    b, t, s, h, kv, d = 2, 3, 5, 4, 2, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32) * 3
    k = rng.normal(size=(b, kv, s, d)).astype(np.float32)
    v = rng.normal(size=(b, kv, s, d)).astype(np.float32)
    sinks = rng.normal(size=(h,)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.6
    mask[..., 0] = True
    got = np.asarray(attention.attend(jnp.asarray(q), jnp.asarray(k.transpose(0, 1, 3, 2)), jnp.asarray(v),
                                      jnp.asarray(mask), scale=0.2, softcap=2.0, sinks=jnp.asarray(sinks)))
    exp = np.zeros_like(got)
    for r in range(b):
        for i in range(t):
            for hh in range(h):
                g = hh // (h // kv)
                sc = 2.0 * np.tanh(k[r, g] @ q[r, i, hh] * 0.2 / 2.0)
                sc = np.where(mask[r, i], sc, -np.inf)
                top = max(sc.max(), sinks[hh])
                p = np.exp(sc - top)
                exp[r, i, hh] = p @ v[r, g] / (p.sum() + np.exp(sinks[hh] - top))
    np.testing.assert_allclose(got, exp, atol=1e-5)
    with pytest.raises(ConfigError, match="softcap or attention sinks"):
        attention.attend(jnp.asarray(q), jnp.asarray(k.transpose(0, 1, 3, 2)), jnp.asarray(v), jnp.asarray(mask),
                         impl="dot_product", softcap=2.0)


def test_layers_get_their_own_window_and_rope():
    """`transformer.attention_for`: a sliding layer's mask hides keys at or before position - window (the caller's
    mask is the full one) and its rope uses the local base; the traced lookup under scan picks the same as the
    static one."""
    from pdecode.config import ModelConfig
    from pdecode.model.transformer import attention_for

    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                      head_dim=8, family="gemma3_text", sliding_window=3, layer_types=("sliding", "full", "sliding"),
                      local_rope_theta=100.0, rope_theta=1e4)
    t = 6
    pos = jnp.arange(t)[None]
    full = attention.padded_self_mask(jnp.array([t]), t)
    att = attention_for(cfg, pos, full)
    for i, kind in enumerate(cfg.layer_kinds()):
        rope, m = att.for_layer(i)
        rope_t, m_t = jax.jit(lambda j: att.for_layer(j))(jnp.int32(i))
        np.testing.assert_array_equal(np.asarray(m), np.asarray(m_t))
        np.testing.assert_allclose(np.asarray(rope[0]), np.asarray(rope_t[0]))
        qq, kk = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
        want = (kk <= qq) & ((qq - kk < 3) if kind == "sliding" else True)
        np.testing.assert_array_equal(np.asarray(m)[0], want)
        cos1 = float(np.asarray(rope[0])[0, 1, 0, 1])  # position 1, second frequency
        base = 100.0 if kind == "sliding" else 1e4
        np.testing.assert_allclose(cos1, np.cos(base ** (-2 / 8)), rtol=1e-5)


@pytest.mark.parametrize("window", [None, 24])
def test_causal_self_mask_blocks_match_full_mask_values_and_grads(window):
    """Causal block skipping (training passes) gives the full-mask attention and its gradients."""
    rng = np.random.default_rng(3)
    b, t, h, kv, d = 2, 64, 4, 2, 8
    q, k, v, w = (jnp.asarray(rng.normal(size=s).astype(np.float32))
                  for s in ((b, t, h, d), (b, kv, d, t), (b, kv, t, d), (b, t, h, d)))
    mask = attention.padded_self_mask(jnp.full((b,), t), t, causal=True, window=window)

    def f(m):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(attention.attend(q, k, v, m) * w), argnums=(0, 1, 2))(
            q, k, v)

    full, blocked = f(mask), f(attention.CausalSelfMask(mask, blocks=4))
    for a, e in zip(jax.tree.leaves(blocked), jax.tree.leaves(full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-5, rtol=1e-5)
    # blocks that do not divide T, or are too short to pay, fall back to the full mask (same values)
    for n in (3, 8):
        np.testing.assert_allclose(np.asarray(attention.attend(q, k, v, attention.CausalSelfMask(mask, blocks=n))),
                                   np.asarray(attention.attend(q, k, v, mask)), atol=1e-5)


def test_causal_self_mask_refused_with_a_cache():
    from pdecode.model.transformer import forward, init_params

    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    params = init_params(cfg, jax.random.PRNGKey(0))
    cache = kvc.init_cache(cfg, 1, 32)
    tok = jnp.zeros((1, 4), jnp.int32)
    mask = attention.CausalSelfMask(attention.padded_self_mask(jnp.full((1,), 4), 4))
    with pytest.raises(ValueError, match="without a cache"):
        forward(params, cfg, tok, jnp.arange(4)[None], mask, cache=cache)


def test_attention_gradients_match_plain_softmax():
    """The max inside the softmax carries no gradient; the gradients still equal those of jax.nn.softmax."""
    rng = np.random.default_rng(4)
    b, t, s, h, kv, d = 2, 6, 9, 4, 2, 8
    q, k, v, w = (jnp.asarray(rng.normal(size=sh).astype(np.float32) * 3)
                  for sh in ((b, t, h, d), (b, kv, s, d), (b, kv, s, d), (b, t, h, d)))
    mask = jnp.asarray(rng.random((b, t, s)) < 0.6).at[..., 0].set(True)

    def plain(q, k, v):
        kk, vv = jnp.repeat(k, h // kv, axis=1), jnp.repeat(v, h // kv, axis=1)  # [B, H, S, d]
        sc = jnp.einsum("bthd,bhsd->bhts", q, kk) / np.sqrt(d)
        p = jax.nn.softmax(jnp.where(mask[:, None], sc, -jnp.inf), axis=-1)
        return jnp.sum(jnp.einsum("bhts,bhsd->bthd", p, vv) * w)

    def ours(q, k, v):
        return jnp.sum(attention.attend(q, jnp.swapaxes(k, 2, 3), v, mask) * w)

    for a, e in zip(jax.grad(ours, argnums=(0, 1, 2))(q, k, v), jax.grad(plain, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-4, rtol=1e-4)


def _view(c):
    """A paged cache's rows as a contiguous cache's arrays (stacked): every layer's gathered view."""
    ks, vs = zip(*(c.layer(i) for i in range(CFG.num_layers)))
    return np.stack([np.asarray(x) for x in ks]), np.stack([np.asarray(x) for x in vs])


@pytest.mark.parametrize("per_layer", [False, True])
def test_paged_cache_equals_the_contiguous_one(per_layer):
    """Rows in shuffled pages of a shared pool (one row owning fewer pages than its view): put_rows, write_layer,
    commit, head / put_head give, through each layer's gathered view, the contiguous cache's content wherever the row
    owns pages (zeros elsewhere: writes there dropped), and leave pages of other rows alone."""
    page, n, pool = 4, 4, 13
    c, _, _ = _filled(b=3, s=n * page, per_layer=per_layer)
    c = kvc.set_lengths(c, jnp.array([3, 6, 2]))
    rng = np.random.default_rng(1)
    perm = rng.permutation(pool)
    table = np.full((3, n), pool, np.int32)
    table[0], table[1], table[2, :2] = perm[:4], perm[4:8], perm[8:10]  # row 2 owns its first 2 pages only
    owned = (np.arange(n * page)[None, :] // page) < np.array([4, 4, 2])[:, None]  # [B, S]
    p = kvc.init_paged(CFG, 3, n * page, pool, page, per_layer=per_layer)
    p = kvc.put_rows(p, c, jnp.arange(3), jnp.asarray(table))
    spare = [np.asarray(x)[..., perm[10:], :, :, :] for x in jax.tree.leaves(p.k)]  # pages nobody owns

    def same(paged, contig):
        pk, pv = _view(paged)
        ck, cv = _stacked(contig)
        np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(contig.lengths))
        np.testing.assert_array_equal(pk, np.where(owned[None, :, None, None, :], ck, 0))
        np.testing.assert_array_equal(pv, np.where(owned[None, :, None, :, None], cv, 0))

    same(p, c)
    new = rng.normal(size=(3, 1, 5, 4)).astype(np.float32)  # [B, KV, T, hd]: row 2's slots 7.. fall past its pages
    c = kvc.write_layer(c, 1, jnp.asarray(new), jnp.asarray(-new), c.lengths)
    p = kvc.write_layer(p, 1, jnp.asarray(new), jnp.asarray(-new), p.lengths)
    same(p, c)
    idx, acc = jnp.array([[0, 2, 4, 0], [0, 1, 2, 3], [0, 3, 1, 1]]), jnp.array([3, 4, 1])
    c, p = kvc.commit(c, idx, acc), kvc.commit(p, idx, acc)
    same(p, c)
    ph = kvc.head(p, 2 * page, gather=False)  # a shorter view: the first two pages of each row, nothing copied
    assert ph.max_len == 2 * page and ph.k is p.k
    ph = kvc.write_layer(ph, 0, jnp.asarray(new[:, :, :2]), jnp.asarray(new[:, :, :2]), jnp.array([0, 2, 1]))
    c = kvc.write_layer(c, 0, jnp.asarray(new[:, :, :2]), jnp.asarray(new[:, :, :2]), jnp.array([0, 2, 1]))
    p = kvc.put_head(p, kvc.rollback(ph, jnp.array([1, 0, 0])))
    c = kvc.rollback(c, jnp.array([1, 0, 0]))
    assert p.max_len == n * page
    same(p, c)
    # a gathered head: a contiguous copy of the first 3 pages; steps write in it; only each row's window goes back
    # (row 1's window reaches past the head: dropped; a write below the lengths stays in the copy)
    gp, gc = kvc.head(p, 3 * page), kvc.head(c, 3 * page)
    assert isinstance(gp, kvc.KVCache) and gp.max_len == 3 * page
    np.testing.assert_array_equal(_stacked(gp)[0], _view(p)[0][..., : 3 * page])
    fresh = jnp.asarray(rng.normal(size=(3, 1, 3, 4)).astype(np.float32))
    below = jnp.asarray(rng.normal(size=(3, 1, 1, 4)).astype(np.float32))
    gp, gc = ((kvc.write_layer(kvc.write_layer(g, 1, fresh, -fresh, g.lengths), 0, below, below,
                               jnp.zeros((3,), jnp.int32))) for g in (gp, gc))
    gp, gc = kvc.advance(gp, jnp.array([3, 2, 1])), kvc.advance(gc, jnp.array([3, 2, 1]))
    before = _stacked(c)
    p, c = kvc.put_head(p, gp, window=3), kvc.put_head(c, gc, window=3)
    same(p, c)
    np.testing.assert_array_equal(_stacked(c)[0][0, :, :, :, 0], before[0][0, :, :, :, 0])  # slot 0 not written back
    assert not np.array_equal(_stacked(c)[0][1, :, :, :, 5:8], before[0][1, :, :, :, 5:8])  # the window was
    np.testing.assert_array_equal(_stacked(c)[0][1, 1, :, :, 12], before[0][1, 1, :, :, 12])  # past the head: dropped
    for a, b in zip(spare, [np.asarray(x)[..., perm[10:], :, :, :] for x in jax.tree.leaves(p.k)]):
        np.testing.assert_array_equal(a, b)  # the pages no row owns were never written
    with pytest.raises(TypeError, match="contiguous"):
        kvc.grow(p, 32)
