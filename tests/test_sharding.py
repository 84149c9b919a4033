"""Sharded generation on 8 forced CPU devices equals single-device generation."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pdecode
from pdecode.model.transformer import param_specs
from pdecode.sharding import make_mesh, param_shardings, spec_for

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def test_logical_rules_and_divisibility():
    mesh = make_mesh(2, 4)
    assert spec_for(("vocab", "embed"), (96, 64), mesh) == P("model", None)
    assert spec_for(("vocab", "embed"), (97, 64), mesh) == P(None, None)  # 97 % 4 != 0: replicated
    assert spec_for(("layers", "embed", "kv_heads", None), (3, 64, 2, 16), mesh) == P(None, None, None, None)
    assert spec_for(("batch", None), (8, 5), mesh) == P("data", None)
    # a model's own weights: an indivisible sharded dimension is an error naming it (kv heads / batch replicate)
    with pytest.raises(pdecode.errors.ConfigError, match=r"embed: its vocab dimension \(97\) is not divisible by "
                       r"the mesh's model axis \(4\)"):
        spec_for(("vocab", "embed"), (97, 64), mesh, indivisible="error", what="embed")
    assert spec_for(("kv_heads", None), (2, 16), mesh, indivisible="error") == P(None, None)


@pytest.mark.parametrize("shape", [(2, 4), (8, 1), (1, 8)])
def test_sharded_greedy_equals_single_device(tiny, shape):
    mesh = make_mesh(*shape)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [19, 20], [21, 22, 23, 24, 25, 26, 27],
               [28, 29, 30], [31]]
    single = pdecode.generate(tiny, prompts, max_new_tokens=16, stop_at_eos=False)
    if shape[1] > 1:  # the tiny vocab (97) does not divide the model axis: replication must be asked for
        with pytest.raises(pdecode.errors.ConfigError, match="vocab dimension"):
            pdecode.generate(tiny, prompts, max_new_tokens=16, mesh=mesh)
    on_mesh = tiny.on_mesh(mesh, indivisible="replicate")
    sharded = pdecode.generate(on_mesh, prompts, max_new_tokens=16, stop_at_eos=False, mesh=mesh)
    assert sharded.tokens == single.tokens
    # the params really are spread over the mesh
    w = on_mesh.params["layers"]["w_gate"]
    assert len(w.sharding.device_set) == 8
    if shape[1] > 1:
        assert w.sharding.spec == P(None, None, "model")
        assert w.addressable_shards[0].data.shape[-1] == w.shape[-1] // shape[1]


def test_load_with_mesh_and_orbax_round_trip(hf_dirs, tmp_path):
    from pdecode.checkpoint import orbax as orbax_ckpt

    m = pdecode.load(hf_dirs["qwen3"][0])
    orbax_ckpt.save(m.cfg, m.params, tmp_path / "ob")
    mesh = make_mesh(2, 4)
    with pytest.raises(pdecode.errors.ConfigError, match="vocab dimension"):
        pdecode.load(tmp_path / "ob", mesh=mesh)
    m2 = pdecode.load(tmp_path / "ob", mesh=mesh, indivisible="replicate")
    shard = param_shardings(param_specs(m2.cfg), mesh, indivisible="replicate")
    assert m2.params["layers"]["wq"].sharding == shard["layers"]["wq"]
    for a, b in zip(jax.tree.leaves(m.on_mesh(mesh, indivisible="replicate").params), jax.tree.leaves(m2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = [[3, 4, 5, 6]]
    assert pdecode.generate(m2, ids, max_new_tokens=8, mesh=mesh).tokens == \
        pdecode.generate(m, ids, max_new_tokens=8).tokens


def test_sharded_speculative_equals_single_device(tiny):
    mesh = make_mesh(2, 4)
    prompts = [[5, 6, 7, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 14, 15]]
    for method, opts in (("sd", dict(gamma=3)), ("lookup", dict(gamma=3))):
        draft = tiny if method == "sd" else None
        single = pdecode.generate(tiny, prompts, method=method, draft=draft, max_new_tokens=12, stop_at_eos=False,
                                  **opts)
        sharded = pdecode.generate(tiny.on_mesh(mesh, indivisible="replicate"), prompts, method=method, draft=draft,
                                   max_new_tokens=12, stop_at_eos=False, mesh=mesh, **opts)
        assert sharded.tokens == single.tokens


def test_attached_heads_are_sharded_by_on_mesh():
    """on_mesh places attached heads by their own logical specs, and EAGLE decodes the same on the mesh."""
    mesh = make_mesh(2, 4)
    m = pdecode.load("code-target-eagle", dtype="float32")
    placed = m.on_mesh(mesh)
    _, hp = placed.extras["eagle"]
    specs = {str(a.sharding.spec) for a in jax.tree.leaves(hp)}
    assert any("model" in s for s in specs), specs
    assert all(len(a.sharding.device_set) == 8 for a in jax.tree.leaves(hp))
    prompts = ["def fib(n):", "import os\n", "class Stack:"]
    single = pdecode.generate(m, prompts, method="eagle", max_new_tokens=20)
    sharded = pdecode.generate(m, prompts, method="eagle", max_new_tokens=20, mesh=mesh)
    assert sharded.tokens == single.tokens


def test_kv_heads_repeated_to_the_model_axis():
    """4 query / 2 kv heads on a model axis of 4: each kv head is repeated twice (same outputs), so weights and cache
    shard over the axis instead of sitting whole on every device; heads attached later get the same treatment."""
    from pdecode.sharding import kv_repeat

    mesh = make_mesh(1, 4)
    m = pdecode.load("code-target", dtype="float32")
    assert (m.cfg.num_heads, m.cfg.num_kv_heads) == (4, 2) and kv_repeat(m.cfg, mesh) == 2
    placed = m.on_mesh(mesh)
    wk = placed.params["layers"]["wk"]
    assert placed.cfg.num_kv_heads == 4 and wk.shape[2] == 4 and wk.sharding.spec[2] == "model"
    assert wk.addressable_shards[0].data.shape[2] == 1
    np.testing.assert_array_equal(np.asarray(wk)[:, :, 0::2], np.asarray(m.params["layers"]["wk"]))
    np.testing.assert_array_equal(np.asarray(wk)[:, :, 1::2], np.asarray(m.params["layers"]["wk"]))
    prompts = ["def fib(n):", "import os\n", "class Stack:", "x = [1, 2"]
    assert pdecode.generate(placed, prompts, max_new_tokens=16, mesh=mesh).tokens == \
        pdecode.generate(m, prompts, max_new_tokens=16).tokens
    # heads attached to the placed model are placed and repeated alike; EAGLE decodes the same
    with_heads = pdecode.attach_heads(placed, "code-target-eagle")
    assert with_heads.extras["eagle"][1]["layers"]["wk"].shape[2] == 4
    single = pdecode.attach_heads(m, "code-target-eagle")
    assert pdecode.generate(with_heads, prompts, method="eagle", max_new_tokens=16, mesh=mesh).tokens == \
        pdecode.generate(single, prompts, method="eagle", max_new_tokens=16).tokens


def test_saving_a_placed_model_writes_its_own_kv_heads(tmp_path):
    mesh = make_mesh(1, 4)
    m = pdecode.load("code-target", dtype="float32")
    placed = m.on_mesh(mesh)
    assert placed.cfg.num_kv_heads == 4
    back = pdecode.load(pdecode.save_hf(placed, tmp_path / "saved"))
    assert back.cfg.num_kv_heads == 2
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_TWO_PROGRAMS = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pdecode.engine import _OneAtATime

mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
sh, rep = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
w = jax.device_put(np.ones((256, 256), np.float32) / 256, NamedSharding(mesh, P("model", None)))
x = jax.device_put(np.ones((64, 256), np.float32), sh)
y = jax.device_put(np.ones((32, 256), np.float32), rep)

def chain(out):  # eight matmuls contracting the sharded axis: an all-reduce each
    def f(v, w):
        for _ in range(8):
            v = jax.lax.with_sharding_constraint(jnp.tanh(v @ w), out)
        return v
    return f

wrap = _OneAtATime if sys.argv[1] == "one at a time" else (lambda f: f)
a = wrap(jax.jit(chain(sh)).lower(x, w).compile())
b = wrap(jax.jit(chain(rep)).lower(y, w).compile())
for i in range(300):  # two independent programs dispatched back to back, nothing read in between
    xa, yb = a(x, w), b(y, w)
    if sys.argv[1] == "one at a time":
        assert xa.is_ready() and yb.is_ready()
jax.block_until_ready((xa, yb))
print("done")
"""


def test_programs_on_cpu_devices_run_one_at_a_time(tmp_path):
    """XLA:CPU's forced host devices: two independent sharded programs in flight may each hold some of the device
    threads waiting in a collective's rendezvous for the others, and XLA aborts the process (a CI worker killed in the
    engine's warm-up on a mesh: a prefill dispatched while admissions ran). The engine's programs on a CPU mesh
    return with their results ready, one at a time in the process (`engine._OneAtATime`): 300 pairs run through.
    (Without it — the same script, "as dispatched" — XLA ended the process in each of 3 runs here, within seconds.)"""
    import os
    import subprocess
    import sys

    script = tmp_path / "two_programs.py"
    script.write_text(_TWO_PROGRAMS)
    flags = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=10"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, str(script), "one at a time"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": path})
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
