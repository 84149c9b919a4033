"""`pdecode plan`: abstract params, AOT compile on a forced-device mesh, per-device bytes and a roofline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CFG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    (d / "config.json").write_text(json.dumps(CFG))
    return d


def _plan(*args):
    out = subprocess.run([sys.executable, "-m", "infer.cli", "plan", *args, "--json"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_plan_compiles_and_counts_per_device_bytes(cfg_dir, method):
    extra = ["--draft-config", str(cfg_dir)] if method == "sd" else []
    r = _plan("--config", str(cfg_dir), "--devices", "4", "--method", method, "--batch", "4", "--max-len", "512",
              *extra)
    assert r["compiled"] and r["mesh"] == "1x4" and r["per_device_bytes"] == r["per_device"]["total"] > 0
    # by count: bf16 weights sharded 4 ways (embed and lm_head over the vocab, heads and mlp over model; norms
    # replicated), and the bf16 caches [L, B, KV/4, hd, S] for k and v
    d, f, v, L = 64, 128, 512, 2
    sharded = (2 * v * d + L * (4 * d * d + 3 * d * f)) / 4
    replicated = L * 2 * d + d
    cache = 2 * L * 4 * (4 // 4) * 16 * 512
    n_models = 2 if method == "sd" else 1
    lengths = 4 * 4  # the cache's per-row int32 lengths
    assert r["per_device"]["weights_and_caches"] == n_models * (2 * (sharded + replicated + cache) + lengths)
    assert r["per_device"]["argument"] >= 2 * (sharded + replicated)  # XLA's own figure holds at least the weights
    assert set(r["projection"]) == {"tpu-v5e", "tpu-v5p", "h100", "h200"}
    for p in r["projection"].values():
        assert p["fits"] and p["tokens_per_s"] > 0
    if method == "sd":
        assert set(r["step_floor_per_device"]) == {"target_1", "target_verify", "draft_1"} and r["tau_assumed"]


def test_plan_bad_input_is_one_line(cfg_dir):
    out = subprocess.run([sys.executable, "-m", "infer.cli", "plan", "--config", "nope", "--devices", "2"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1


def test_plan_costs_follow_the_method_options(cfg_dir):
    """The verify step is costed at the gamma the plan compiled (an option overriding the default counts)."""
    import jax

    from infer.plan import plan

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (the test command forces 8)")
    r = plan(str(cfg_dir), 4, "sd", 4, 512, draft_config=str(cfg_dir), options={"gamma": 2})
    f = r["step_floor_per_device"]
    assert f["target_verify"]["flops"] == pytest.approx(3 * f["target_1"]["flops"])  # root + 2 drafted tokens


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_plan_heads_training_step_holds_no_large_constant(cfg_dir, kind):
    r = _plan("--config", str(cfg_dir), "--devices", "4", "--mesh", "2x2", "--train-heads", kind, "--batch", "4",
              "--seq-len", "64")
    assert r["compiled"] and r["per_device_bytes"] > 0 and r["fsdp"]
    assert r["largest_constant_bytes"] < 1 << 20, r["largest_constant_bytes"]
    # the base (bf16, split over both axes) and the heads + moments (fp32) by count, per device
    assert r["base_shard_bytes"] < r["base_param_bytes"] / 2


def test_largest_constant_sees_a_closed_over_weight():
    """The measure the plan reports can fail: a step that closes over a 4 MB weight shows a 4 MB constant."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from infer.plan import largest_constant

    w = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 1024), np.float32))
    closed = jax.jit(lambda x: x @ w).lower(jnp.ones((2, 1024))).as_text()
    passed = jax.jit(lambda x, w: x @ w).lower(jnp.ones((2, 1024)), w).as_text()
    assert largest_constant(closed) == 4 * 1024 * 1024 and largest_constant(passed) < 1024
