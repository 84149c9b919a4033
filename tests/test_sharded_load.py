"""Loading straight to shards: a ~100 MB random checkpoint (sharded with an index) read onto 8 forced CPU devices.

Peak memory is measured in a fresh process: ``VmHWM`` (the kernel's high-water mark of resident memory, which
counts the memory maps' pages as well as the device buffers, which on the CPU backend live in host memory) minus
``VmRSS`` just before the load, divided by the checkpoint's bytes. The old way (every tensor on one device, then
resharded) is measured beside it in the same test, so the figure has a reference.

Run by hand: ``python tests/test_sharded_load.py DIR new|gather`` prints one JSON line.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from pdecode.model.family import config_to_hf
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cfg():
    from pdecode.config import ModelConfig

    # 27.3M params: 109 MB in float32; every sharded dimension divisible by 8
    return ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8,
                       num_kv_heads=8, head_dim=64, tie_word_embeddings=False, family="llama")


def write_sharded_checkpoint(out: Path, cfg, shards: int = 3, seed: int = 0) -> int:
    """A random checkpoint in HF's sharded layout (model-0000k-of-0000n.safetensors + index); returns its bytes."""
    from pdecode.checkpoint.hf import llama_rules, params_to_tensors
    from pdecode.checkpoint.safetensors_io import write_safetensors
    from pdecode.model.transformer import is_spec, param_specs

    import jax

    rng = np.random.default_rng(seed)
    specs = param_specs(cfg)
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)), specs, is_leaf=is_spec)
    tensors = params_to_tensors(params, llama_rules(cfg))
    names = sorted(tensors)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / fname, part, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        total += sum(a.nbytes for a in part.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg.replace(dtype="float32"))))
    return total


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(path: str, mode: str) -> dict:
    """In this process: load ``path`` on a 1 x 8 (data x model) mesh; the resident-memory growth it caused."""
    import jax

    import pdecode
    from pdecode.sharding import make_mesh

    mesh = make_mesh(data=1, model=8)
    jax.device_put(np.zeros(4), jax.devices()[7]).block_until_ready()  # every device initialised before the baseline
    rss0 = _status("VmRSS")
    if mode == "new":
        params = pdecode.load(path, mesh=mesh).params
    else:  # the old way: numpy tree on the host, every array on device 0, then resharded
        from pdecode.checkpoint.hf import load_hf
        from pdecode.model.transformer import param_specs
        from pdecode.sharding import shard_params

        cfg, np_params = load_hf(path)
        params = shard_params(jax.tree.map(jax.numpy.asarray, np_params), param_specs(cfg), mesh)
    jax.block_until_ready(params)
    per_device = {}
    for a in jax.tree.leaves(params):
        for s in a.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    return {"peak_growth": _status("VmHWM") - rss0, "device_bytes": sum(per_device.values()),
            "max_device_bytes": max(per_device.values()), "devices": len(per_device),
            "params": [str(a.sharding.spec) for a in jax.tree.leaves(params)]}


def _run(path: Path, mode: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, __file__, str(path), mode], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded_ckpt")
    return d, write_sharded_checkpoint(d, _cfg())


def test_sharded_load_peaks_near_model_size(big_ckpt):
    path, nbytes = big_ckpt
    assert 95e6 < nbytes < 130e6
    new = _run(path, "new")
    old = _run(path, "gather")
    print(f"checkpoint {nbytes / 1e6:.1f} MB; peak growth: shard by shard {new['peak_growth'] / 1e6:.1f} MB "
          f"({new['peak_growth'] / nbytes:.2f}x), gathered then resharded {old['peak_growth'] / 1e6:.1f} MB "
          f"({old['peak_growth'] / nbytes:.2f}x)")
    # the params really are spread: 8 devices, the largest holding well under the whole model
    assert new["devices"] == 8 and new["max_device_bytes"] < 0.3 * nbytes
    assert new["device_bytes"] < 1.1 * nbytes  # only norms are replicated
    # peak: the model's own bytes (its shards) plus a slice or two in flight, not a multiple of it
    assert new["peak_growth"] < 1.35 * nbytes, new
    assert new["peak_growth"] < old["peak_growth"]


def test_sharded_load_matches_plain_load_and_auto_dtype(big_ckpt, tmp_path):
    """Shard by shard gives the same values as the plain numpy reader; "auto" keeps the stored dtype."""
    import jax

    import pdecode
    from pdecode.checkpoint.hf import load_hf
    from pdecode.sharding import make_mesh

    path, _ = big_ckpt
    cfg, ref = load_hf(path)
    m = pdecode.load(path, mesh=make_mesh(data=2, model=4))
    assert m.dtype == np.float32
    for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(m.params)):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(kp))
    # bf16 on disk -> bf16 by default; an explicit dtype converts
    z = pdecode.load("code-target")
    assert str(z.dtype) == "bfloat16"
    assert str(pdecode.load("code-target", dtype="float32").dtype) == "float32"
    with pytest.raises(pdecode.errors.InputError, match="auto or one of"):
        pdecode.load("code-target", dtype="float64")


def test_orbax_restore_auto_dtype_and_mesh(tmp_path):
    import jax

    import pdecode
    from pdecode.checkpoint import orbax as orbax_ckpt
    from pdecode.sharding import make_mesh

    z = pdecode.load("code-target")  # bfloat16
    orbax_ckpt.save(z.cfg, z.params, tmp_path / "ob", tokenizer_dir=z.path)
    mesh = make_mesh(data=1, model=4)
    r = pdecode.load(tmp_path / "ob", mesh=mesh)
    assert str(r.dtype) == "bfloat16"
    for a, b in zip(jax.tree.leaves(z.on_mesh(mesh).params), jax.tree.leaves(r.params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    wq = r.params["layers"]["wq"]
    assert "model" in str(wq.sharding.spec) and len(wq.addressable_shards) == 4


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
