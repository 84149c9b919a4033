"""The serving engine on several processes (one per host): process 0 decides, the others repeat.

Every process holds an `Engine` over the same model on one mesh; each compiled step runs on all of them at once.
The engine's host side is deterministic given the requests it is handed and when (`Engine.submit`,
`Engine.cancel`, `Engine.run_once`), so process 0 — the one with the HTTP server — sends every round's submissions
(prompt, controls, seed), cancellations and whether it runs a step to the others over one TCP connection each
(`Leader` / `follow`, newline-delimited JSON on ``--control-port``, by default the coordinator's port + 1); they
apply the same calls in the same order and run the same compiled programs in lockstep.

A follower that dies closes its connection: process 0 notices at once (`Leader.lost`), and the server answers
``/health`` with 503 and exits with one line (its engine may be blocked in a collective with the dead peer, which
nothing would end). A leader that dies or sends ``stop`` (SIGTERM on process 0, after draining) ends the followers.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from typing import Callable

from pdecode import generation
from pdecode.distributed import DistributedError, connect


TPU_CONTROL_PORT = 8477  # on a Cloud TPU slice joined without flags: next to JAX's own coordinator port (8476)


def control_address(coordinator: str, port: int | None) -> tuple[str, int]:
    """(host, port) of process 0's control channel: the coordinator's host, ``port`` or the coordinator's + 1."""
    host, _, cport = coordinator.rpartition(":")
    return host.strip("[]"), int(port) if port else int(cport) + 1


def _as_dict(controls: generation.Controls) -> dict:
    """Controls as JSON-able values; a grammar as the regular expression it was compiled from."""
    g = controls.grammar
    d = dataclasses.asdict(dataclasses.replace(controls, grammar=None))
    d["grammar"] = None if g is None else g.spec
    return d


def _controls(d: dict, engine=None) -> generation.Controls:
    tup = lambda v: tuple(tup(x) for x in v) if isinstance(v, list) else v  # noqa: E731 (JSON lists back to tuples)
    c = generation.Controls(**{k: tup(v) for k, v in d.items() if k != "grammar"})
    if d.get("grammar") is not None:  # compiled here as process 0 did (the same regex and tokenizer: same tables)
        c = dataclasses.replace(c, grammar=engine.compile_grammar({"regex": d["grammar"]}))
    return c


class Leader:
    """Process 0's side: accepts one connection from each other process, then sends every round to all of them."""

    def __init__(self, address: tuple[str, int], followers: int, timeout_s: float = 120.0,
                 on_lost: Callable[[str], None] | None = None):
        self.on_lost = on_lost
        self.lost: str | None = None
        self._lock = threading.Lock()
        srv = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind(address)
        except OSError as e:
            raise DistributedError(f"process 0 cannot listen for the other processes on {address[0]}:{address[1]}: "
                                   f"{e.strerror} (pass a free --control-port)") from None
        srv.listen(followers)
        self.conns: dict[int, socket.socket] = {}
        end = time.monotonic() + timeout_s
        try:
            while len(self.conns) < followers:
                srv.settimeout(max(0.1, end - time.monotonic()))
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    missing = followers - len(self.conns)
                    raise DistributedError(f"{missing} process(es) did not connect to process 0's control channel "
                                           f"on port {address[1]} within {timeout_s:.0f}s") from None
                hello = json.loads(conn.makefile("r").readline() or "{}")
                self.conns[int(hello.get("process", -1))] = conn
        finally:
            srv.close()
        for pid, conn in self.conns.items():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._watch, args=(pid, conn), name=f"pdecode-watch-{pid}", daemon=True).start()

    def _watch(self, pid: int, conn: socket.socket) -> None:
        """Followers send nothing after their hello: a read that returns is the connection closing (a dead peer)."""
        try:
            conn.recv(1)
        except OSError:
            pass
        self._fail(f"process {pid} of the run is gone (its control connection closed)")

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
        if self.on_lost is not None:
            self.on_lost(why)

    def send(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        for pid, conn in list(self.conns.items()):
            try:
                conn.sendall(data)
            except OSError:
                self._fail(f"process {pid} of the run is gone (sending to it failed)")

    def close(self) -> None:
        self.send({"stop": True})
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass


class LockstepEngine:
    """Process 0's engine calls, recorded and sent to the followers: `submit`, `cancel` and `run_once` as
    `Engine`'s, plus `flush` for rounds with no step (submissions and cancellations only)."""

    def __init__(self, engine, leader: Leader):
        self.engine, self.leader = engine, leader
        self._ops: list = []

    def submit(self, prompt, controls, seed=None, callback=None):
        if seed is None:  # drawn here, sent to all: every process samples with the same keys
            seed = self.engine.draw_seed()
        r = self.engine.submit(prompt, controls, seed=seed, callback=callback)
        self._ops.append(["submit", list(prompt), _as_dict(controls), int(seed)])
        return r

    def cancel(self, req) -> None:
        self.engine.cancel(req)
        self._ops.append(["cancel", req.id])

    def flush(self, run: bool = False) -> None:
        if self._ops or run:
            self.leader.send({"ops": self._ops, "run": run})
            self._ops = []

    def run_once(self):
        self.flush(run=True)
        return self.engine.run_once()


def follow(engine, address: tuple[str, int], process_id: int, timeout_s: float = 120.0) -> str:
    """A follower's whole life: connect to process 0, then apply each round it sends until ``stop`` (returns
    "stopped") or until process 0 is gone (returns a line saying so)."""
    conn = connect(address, timeout_s, f"process 0's control channel at {address[0]}:{address[1]}",
                   "is process 0 serving, with the same --coordinator and --control-port?")
    conn.settimeout(None)
    conn.sendall((json.dumps({"process": process_id}) + "\n").encode())
    reqs: dict = {}
    with conn.makefile("r") as f:
        for line in f:
            msg = json.loads(line)
            if msg.get("stop"):
                return "stopped"
            for op in msg["ops"]:
                if op[0] == "submit":
                    r = engine.submit(op[1], _controls(op[2], engine), seed=op[3])
                    reqs[r.id] = r
                else:
                    r = reqs.get(op[1])
                    if r is not None:
                        engine.cancel(r)
            if msg["run"]:
                for ev in engine.run_once():
                    if ev.finish_reason is not None:
                        reqs.pop(ev.request_id, None)
    return "process 0 is gone (its control connection closed)"
