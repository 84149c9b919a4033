"""One process of a multi-process run for tests/test_pods.py: ``python tests/pods_worker.py ID PORT OUT [N]``.

Joins the run (N processes, 2 by default, on 127.0.0.1:PORT), then decodes the same prompts with ar, sd, eagle,
dico and decompose on a 2x4 mesh over every process's devices (the data axis across the processes, the model axis
within each); process 0 writes the tokens to OUT (JSON), and the errors a mesh short of the run's devices and
prompts that differ between processes give. With ID "single" it runs alone (its own 8 devices) and writes the
reference."""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["def fib(n):", "class Stack:\n    def push(self, x):"]
DECOMPOSE = "import os\n\n\ndef a(x):\n    \"\"\"A.\"\"\"\n\n\ndef b(y):\n    \"\"\"B.\"\"\""


def run(mesh) -> dict:
    import pdecode

    t = pdecode.load("code-target", mesh=mesh)
    d = pdecode.load("code-draft", mesh=mesh, indivisible="replicate")
    e = pdecode.load("code-target-eagle", mesh=mesh)
    dl = pdecode.load("code-dllm", mesh=mesh, indivisible="replicate")
    kw = dict(max_new_tokens=8, stop_at_eos=False, mesh=mesh)
    out = {"ar": pdecode.generate(t, PROMPTS, **kw).tokens,
           "sd": pdecode.generate(t, PROMPTS, method="sd", draft=d, gamma=3, **kw).tokens,
           "eagle": pdecode.generate(e, PROMPTS, method="eagle", tree_top_k=2, depth=3, total_tokens=6, **kw).tokens,
           "dico": pdecode.generate(dl, PROMPTS, method="dico", max_new_tokens=8, mesh=mesh).tokens,
           "decompose": pdecode.decompose(t, DECOMPOSE, method="ar", max_new_tokens=8, mesh=mesh).fill_tokens}
    return out


def _ts_bytes_read() -> int:
    """Bytes tensorstore (orbax's reader) has read from files in this process, by its own counter."""
    import tensorstore as ts

    got = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return int(got[0]["values"][0]["value"]) if got else 0


def sums(m) -> list[float]:
    """One float per param (its sum), from wherever its shards live."""
    import jax
    import jax.numpy as jnp

    from pdecode.api import to_host

    return [float(to_host(jax.jit(lambda a: jnp.sum(a.astype(jnp.float32)))(a))) for a in jax.tree.leaves(m.params)]


def reads(wide: str, mesh) -> dict:
    """Load the checkpoints in ``wide`` (hf/, orbax/) on ``mesh``: what this process read, and param sums."""
    import pdecode
    from pdecode.checkpoint import hf

    m = pdecode.load(os.path.join(wide, "hf"), mesh=mesh)
    got = {"hf_slice": hf.LAST_LOAD["slice_bytes"], "hf_pages": hf.LAST_LOAD["page_bytes"], "hf_sums": sums(m)}
    r0 = _ts_bytes_read()
    m = pdecode.load(os.path.join(wide, "orbax"), mesh=mesh)
    got["orbax_read"] = _ts_bytes_read() - r0
    got["orbax_sums"] = sums(m)
    return got


def commands(work: str) -> dict:
    """The CLI commands on this process of the run (already joined): each one's exit code and what it printed."""
    import contextlib
    import io

    from infer import cli

    w = os.path.join
    runs = {
        "generate": ["generate", "--prompt", "def fib(n):", "--max-new-tokens", "8", "--json", "--mesh", "2x4"],
        "bench": ["bench", "--methods", "ar", "--batch", "2", "--prompts", "2", "--new-tokens", "4", "--repeats", "1",
                  "--no-limit", "--mesh", "2x4", "--out", w(work, "bench")],
        "plan": ["plan", "--config", w(work, "plan"), "--devices", "8", "--batch", "4", "--max-len", "256", "--json"],
        "heads": ["train", "heads", *HEADS_ARGS, "--data", w(work, "data.txt"), "--out", w(work, "heads_multi"),
                  "--work", w(work, "heads_work")],
    }
    got = {}
    for name, argv in runs.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(argv)
        got[name] = {"rc": rc, "stdout": buf.getvalue()}
    return got


HEADS_ARGS = ["--base", "code-target", "--kind", "mtp", "--steps", "4", "--batch-size", "8", "--seq-len", "32",
              "--mesh", "2x4"]


def main() -> None:
    who, port, path = sys.argv[1], sys.argv[2], sys.argv[3]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    import pdecode

    if who != "single":
        pdecode.init_distributed(f"127.0.0.1:{port}", n, int(who), timeout_s=60)
    import jax

    from pdecode.sharding import make_mesh

    out = run(make_mesh(2, 4))
    if who != "single":
        from pdecode.errors import InputError

        t = pdecode.load("code-target")
        for name, call in (("mesh_error", lambda: pdecode.generate(t, PROMPTS, mesh=make_mesh(1, 4, jax.local_devices()))),
                           ("prompt_error", lambda: pdecode.generate(t, [PROMPTS[int(who)]], mesh=make_mesh(2, 4)))):
            try:
                call()
                out[name] = None
            except InputError as e:
                out[name] = str(e)
    wide = os.environ.get("PODS_WIDE")
    if wide and who != "single":  # each process's reads of a checkpoint split over both (the model axis spans them)
        import numpy as np
        from jax.experimental import multihost_utils

        got = reads(wide, make_mesh(1, 8))
        figs = np.asarray([got["hf_slice"], got["hf_pages"], got["orbax_read"]], np.int64)
        every = np.asarray(multihost_utils.process_allgather(figs)).reshape(-1, 3)
        out["reads"] = {"hf_slice": every[:, 0].tolist(), "hf_pages": every[:, 1].tolist(),
                        "orbax_read": every[:, 2].tolist(), "hf_sums": got["hf_sums"],
                        "orbax_sums": got["orbax_sums"]}
    work = os.environ.get("PODS_WORK")
    if work and who != "single":  # every command on both processes; each process writes what it printed
        with open(os.path.join(work, f"commands.{who}.json"), "w") as f:
            json.dump(commands(work), f)
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump({"devices": jax.device_count(), "processes": jax.process_count(), **out}, f)


if __name__ == "__main__":
    main()
