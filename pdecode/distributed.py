"""Multi-host runs: one process per host on JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program: `init_distributed` joins the processes into one runtime (before anything else
touches JAX), after which ``jax.devices()`` lists every process's devices, a `jax.sharding.Mesh` over them spans
the hosts, and each compiled step runs on all of them in lockstep. pdecode's side of it:

* loading reads on each process only the slices its own devices hold (`pdecode.checkpoint.hf.load_hf_arrays`
  builds every param from its addressable shards);
* `pdecode.generate` takes the same prompts on every process (checked: a mismatch is one error on every process),
  and returns the same `GenerateOutput` on each (results sharded over other hosts' devices are gathered);
* `pdecode generate` prints its results once, on process 0.

On CPU (tests, and this machine) the processes talk over gloo; ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
gives each process 4 devices, two processes one 8-device mesh. Flags and environment: ``--coordinator HOST:PORT``
(``PDECODE_COORDINATOR``), ``--num-processes N`` (``PDECODE_NUM_PROCESSES``), ``--process-id I``
(``PDECODE_PROCESS_ID``); with none of them on a Cloud TPU slice of several hosts (``TPU_WORKER_HOSTNAMES`` lists
more than one), JAX's own detection. docs/pods.md has the commands.
"""

from __future__ import annotations

import hashlib
import os

from pdecode.errors import InputError

ENV = {"coordinator": "PDECODE_COORDINATOR", "num_processes": "PDECODE_NUM_PROCESSES",
       "process_id": "PDECODE_PROCESS_ID"}
_STATE = {"initialized": False}


class DistributedError(InputError):
    """The processes could not form (or keep) one runtime: a wrong address, an id out of range, a peer gone."""


def settings(coordinator=None, num_processes=None, process_id=None) -> dict | None:
    """The run's (coordinator, num_processes, process_id) from the arguments, else the environment; None when
    neither gives any (a single process). A partial or malformed set is one InputError naming what to fix."""
    vals = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for k, env in ENV.items():
        if vals[k] is None and os.environ.get(env):
            vals[k] = os.environ[env]
    if all(v is None for v in vals.values()):
        return None
    missing = [k for k, v in vals.items() if v is None]
    if missing:
        raise InputError(f"a multi-process run needs --coordinator, --num-processes and --process-id (or "
                         f"{', '.join(ENV.values())}); missing: {', '.join('--' + m.replace('_', '-') for m in missing)}")
    host, _, port = str(vals["coordinator"]).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.2:8476), got {vals['coordinator']!r}")
    try:
        n, i = int(vals["num_processes"]), int(vals["process_id"])
    except (TypeError, ValueError):
        raise InputError(f"--num-processes and --process-id must be integers, got {vals['num_processes']!r} and "
                         f"{vals['process_id']!r}") from None
    if n < 1:
        raise InputError(f"--num-processes must be >= 1, got {n}")
    if not 0 <= i < n:
        raise InputError(f"--process-id must be in 0..{n - 1} for --num-processes {n}, got {i}")
    return {"coordinator": str(vals["coordinator"]), "num_processes": n, "process_id": i}


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, timeout_s: int = 60) -> bool:
    """Join this process to the others of the run (call it first, before any JAX work). Returns whether the run has
    several processes. The arguments default to ``PDECODE_COORDINATOR`` / ``PDECODE_NUM_PROCESSES`` /
    ``PDECODE_PROCESS_ID``; with none given, a multi-host Cloud TPU slice is joined by JAX's own detection and
    anything else stays a single process. A peer that does not show up within ``timeout_s`` (a wrong address, a
    process not started) is one `DistributedError`, not a hang."""
    import jax

    if _STATE["initialized"]:
        return jax.process_count() > 1
    s = settings(coordinator, num_processes, process_id)
    tpu_hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if s is None and len(tpu_hosts) <= 1:
        return False
    if s is not None:
        _reach(s, timeout_s)
    try:  # CPU devices talk over gloo (no effect on accelerators); must be set before the backend starts
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (RuntimeError, AttributeError):
        pass
    try:
        if s is None:
            jax.distributed.initialize(initialization_timeout=timeout_s)
        else:
            jax.distributed.initialize(s["coordinator"], s["num_processes"], s["process_id"],
                                       initialization_timeout=timeout_s)
    except Exception as e:  # noqa: BLE001  (jax raises RuntimeError / XlaRuntimeError with long logs)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        where = f" at {s['coordinator']}" if s else ""
        raise DistributedError(f"could not join the multi-process run{where} within {timeout_s}s: {first} (check "
                               "that every process got the same --coordinator and --num-processes, that process 0 "
                               "runs on that host, and that the port is open)") from None
    _STATE["initialized"] = True
    return jax.process_count() > 1


def _reach(s: dict, timeout_s: float) -> None:
    """Fail with one line, before JAX's runtime (which aborts the process on a missing peer), when the coordinator
    cannot be served (process 0: its address is not this host's) or reached (others: nothing listens there within
    ``timeout_s``)."""
    import socket

    host, _, port = s["coordinator"].rpartition(":")
    if s["process_id"] == 0:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host.strip("[]"), int(port)))
        except OSError as e:
            raise DistributedError(f"process 0 cannot serve the coordinator at {s['coordinator']}: {e.strerror} (give "
                                   "process 0's own host and a free port)") from None
        return
    connect((host.strip("[]"), int(port)), timeout_s, f"the coordinator at {s['coordinator']}",
            "is process 0 running, with the same --coordinator?").close()


def connect(address: tuple[str, int], timeout_s: float, what: str, hint: str):
    """A TCP connection to ``address``, retried until ``timeout_s``; then one `DistributedError` naming ``what``."""
    import socket
    import time

    end = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(address, timeout=2)
        except OSError as e:
            if time.monotonic() >= end:
                raise DistributedError(f"could not reach {what} within {timeout_s:g}s: {e.strerror or e} "
                                       f"({hint})") from None
            time.sleep(0.5)


def is_main() -> bool:
    """Whether this is process 0 (the one that prints, writes files, serves HTTP)."""
    import jax

    return jax.process_index() == 0


def multi_process() -> bool:
    import jax

    return jax.process_count() > 1


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (after process 0 wrote a file the others read); a
    no-op in a single process."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def check_same_everywhere(what: str, value) -> None:
    """Raise the same one-line InputError on every process when ``value`` (anything with a stable repr) differs
    between processes; a no-op in a single process."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(repr(value).encode()).digest()[:8], np.int64)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    if len(set(every.tolist())) > 1:
        differ = [i for i, d in enumerate(every.tolist()) if d != every[0]]
        raise InputError(f"the {what} differ between processes (process 0 and {differ}): every process of a "
                         "multi-process run must be given the same ones")


def check_mesh(mesh) -> None:
    """On a multi-process run, a mesh must exist and cover every process's devices (one line otherwise)."""
    import jax

    if jax.process_count() == 1:
        return
    if mesh is None:
        raise InputError(f"a multi-process run ({jax.process_count()} processes, {jax.device_count()} devices) needs "
                         "a mesh over every device: pass mesh= (pdecode generate: --mesh, default 1xN)")
    if mesh.devices.size != jax.device_count():
        raise InputError(f"the mesh covers {mesh.devices.size} of the run's {jax.device_count()} devices; a "
                         "multi-process mesh must cover every process's devices")
