"""Test set-up: 8 forced CPU devices (multi-device tests), tiny random HF checkpoints built locally."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `pdecode generate` keeps compiled executables on disk; tests that want it say so (tests/test_cli.py)
os.environ.setdefault("PDECODE_COMPILE_CACHE_DIR", "off")

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


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Free compiled executables once the process nears the kernel's map-count limit (vm.max_map_count): every
    executable holds JIT code pages (memory maps), and a whole suite's worth in one process would run into the
    limit, which aborts XLA mid-compile. Until then they stay cached, so later modules reuse what earlier ones
    compiled."""
    yield
    if _map_count() < MAP_SHARE * _map_limit():
        return
    import gc

    import pdecode

    pdecode.clear_compile_cache()
    gc.collect()


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
