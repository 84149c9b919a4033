"""Test set-up: 8 forced CPU devices (multi-device tests), tiny random HF checkpoints built locally."""

import os

# XLA:CPU without its expensive LLVM passes: the suite is mostly compiling tiny programs, which this makes ~25%
# faster (what runs is a little slower; scripts/test.sh sets the same)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false")
# shallow models' layers run under `lax.scan` here (the stacked layout), not unrolled as in production: their
# programs compile in about half the time. The unrolled (fused) layout has its own tests (tests/test_unrolled.py).
os.environ.setdefault("PDECODE_UNROLL_MAX_LAYERS", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `pdecode generate` keeps compiled executables on disk; tests that want it say so (tests/test_cli.py)
os.environ.setdefault("PDECODE_COMPILE_CACHE_DIR", "off")
# jacobi's and lookahead's "auto" windows are sized by the verify cost measured on the device (pdecode.decode.cost):
# here every verify is priced as one token, so they run the largest windows (the papers'), as the tests expect;
# tests/test_selfdraft.py prices and measures it for real
os.environ.setdefault("PDECODE_VERIFY_COST", "1:1")

import pytest  # noqa: E402

from tests.helpers import make_hf_model  # noqa: E402


def _map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


# compiled programs are shared across test modules (a model and shape compiled by one module is reused by the
# next) until the process holds this share of the kernel's map-count limit
MAP_SHARE = 0.5


@pytest.fixture(autouse=True)
def _release_executables():
    """Free compiled executables once the process nears the kernel's map-count limit (vm.max_map_count): every
    executable holds JIT code pages (memory maps), and a whole suite's worth in one process (or one large module's)
    would run into the limit, which crashes XLA mid-compile. Until then they stay cached, so later tests and
    modules reuse what earlier ones compiled."""
    yield
    if _map_count() < MAP_SHARE * _map_limit():
        return
    import gc

    import pdecode

    pdecode.clear_compile_cache()
    gc.collect()


# the fast tier (`pytest -m fast`, a minute or two): unit tests of verification, the cache, masks, attention,
# routing and trees against brute-force references; everything else is the end-to-end tier (`-m "not fast"`)
FAST = ("tests/test_cache_attention.py", "tests/test_config.py", "tests/test_attention_impl.py", "tests/test_layout.py",
        "tests/test_speculative.py::test_greedy_verify_matches_brute_force",
        "tests/test_speculative.py::test_sampled_verify_is_lossless",
        "tests/test_speculative.py::test_wrong_acceptance_rule_is_detected",
        "tests/test_speculative.py::test_verify_rule_must_fit_the_proposal",
        "tests/test_speculative.py::test_lookup_finds_latest_longest_match",
        "tests/test_speculative.py::test_static_tree_from_choices",
        "tests/test_speculative.py::test_dynamic_tree_keeps_ancestors",
        "tests/test_families.py::test_moe_expert_paths_agree",
        "tests/test_families.py::test_moe_decode_step_computes_only_selected_experts",
        "tests/test_families.py::test_unsupported_features_fail_at_load")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(FAST):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """family -> (directory, torch model) of tiny random checkpoints saved with `save_pretrained`."""
    out = {}
    for fam in ("llama", "llama3", "qwen2", "qwen3", "mistral"):
        d = tmp_path_factory.mktemp(fam)
        out[fam] = (d, make_hf_model(fam, d))
    return out


@pytest.fixture(scope="session")
def tiny(hf_dirs):
    """A loaded tiny Llama (pdecode.Model) for decode tests."""
    import pdecode

    return pdecode.load(hf_dirs["llama"][0])


@pytest.fixture(scope="session")
def zoo_model_name():
    """The shipped default model (committed in zoo/)."""
    import pdecode

    if "code-target" not in pdecode.zoo_names():
        pytest.fail("zoo/code-target is missing: the shipped models are part of the repository")
    return "code-target"
