"""Prometheus metrics of `pdecode serve` (``GET /metrics``, prometheus-client's text format).

One registry per server (not the process-wide default, so that servers built in one process do not collide). The
request-level figures are observed when a request's handler ends (`Metrics.finished`, from its access-log `Stats`);
inter-token latency as each streamed batch of tokens reaches the server (`Metrics.tokens`); the engine's own state
(slots in use, queue, compiles since warm-up) is read when scraped.
"""

from __future__ import annotations

from typing import Callable

# seconds; vLLM's buckets, roughly: a CPU here and a TPU there both land inside
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
TPF_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class Metrics:
    """The server's metrics. ``engine_state()`` returns (slots in use, slots, queued, compiles since warm-up);
    ``engine``: the `pdecode.Engine`, read for its step calls by kind and tau (draft-and-verify methods)."""

    def __init__(self, model: str, method: str, engine_state: Callable[[], tuple[int, int, int, int]],
                 engine=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        labels = {"model": model, "method": method}
        self._labels = labels
        names = list(labels)
        self.requests = Counter("pdecode_requests", "HTTP requests by endpoint and status code",
                                names + ["endpoint", "status"], registry=r)
        self.finished_reqs = Counter("pdecode_request_finished", "completions by finish reason",
                                     names + ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("pdecode_prompt_tokens", "prompt tokens of completion requests", names,
                                     registry=r)
        self.generation_tokens = Counter("pdecode_generation_tokens", "tokens generated", names, registry=r)
        self.forwards = Counter("pdecode_target_forwards", "target forwards of the requests (prefill's included)",
                                names, registry=r)
        self.ttft = Histogram("pdecode_time_to_first_token_seconds", "arrival to the first token", names,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdecode_inter_token_latency_seconds", "time between a request's tokens (a batch of "
                             "k tokens after t seconds: k observations of t / k)", names, buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("pdecode_e2e_request_latency_seconds", "arrival to the last byte of the answer", names,
                             buckets=E2E_BUCKETS, registry=r)
        self.tpf = Histogram("pdecode_request_tokens_per_forward", "a request's tokens per target forward", names,
                             buckets=TPF_BUCKETS, registry=r)
        self.spec_steps = Counter("pdecode_spec_verify_steps", "draft-and-verify steps of finished requests", names,
                                  registry=r)
        self.spec_accepted = Counter("pdecode_spec_accepted_tokens", "verify steps whose drafted token at this "
                                     "position (1 = the first after the root) was accepted", names + ["position"],
                                     registry=r)
        state = engine_state
        g = Gauge("pdecode_slots_in_use", "engine slots holding a request", names, registry=r)
        g.labels(**labels).set_function(lambda: state()[0])
        g = Gauge("pdecode_slots", "engine slots", names, registry=r)
        g.labels(**labels).set_function(lambda: state()[1])
        g = Gauge("pdecode_queue_length", "requests waiting for a slot", names, registry=r)
        g.labels(**labels).set_function(lambda: state()[2])
        g = Gauge("pdecode_compiles_since_warmup", "XLA compiles after warm-up (0 when every shape was warmed)",
                  names, registry=r)
        g.labels(**labels).set_function(lambda: state()[3])
        g = Gauge("pdecode_prefix_cache_lookups", "long prompts looked up in the kept prefixes (--prefix-cache), "
                  "by result", names + ["result"], registry=r)
        for res in ("hit", "miss"):
            g.labels(**labels, result=res).set_function(lambda k=res: engine.stats[f"prefix_{k}es" if k == "miss"
                                                                                    else f"prefix_{k}s"])
        g = Gauge("pdecode_prefix_cache_tokens_reused", "prompt tokens taken from kept prefixes (not prefilled)",
                  names, registry=r)
        g.labels(**labels).set_function(lambda: engine.stats["prefix_tokens_reused"])
        if getattr(engine, "kv_pages", None) is not None:
            g = Gauge("pdecode_kv_pages_in_use", "paged KV cache: pages held by requests (of --kv-pages)", names,
                      registry=r)
            g.labels(**labels).set_function(lambda: engine.kv_pages - engine.pages_free)
            g = Gauge("pdecode_kv_page_waits", "admissions that waited for free KV pages", names, registry=r)
            g.labels(**labels).set_function(lambda: engine.stats["page_waits"])
        g = Gauge("pdecode_grammar_table_uploads", "structured output: grammar table uploads (a new grammar placed)",
                  names, registry=r)
        g.labels(**labels).set_function(lambda: engine.stats["grammar_uploads"])
        if getattr(engine, "drafter", None) is not None:  # speculation by cost (pdecode.engine)
            g = Gauge("pdecode_engine_step_calls", "the engine's decode step calls by kind (drafted: draft and "
                      "verify; plain: the target alone, with speculation auto)", names + ["kind"], registry=r)
            for kind in ("drafted", "plain"):
                g.labels(**labels, kind=kind).set_function(lambda k=kind: engine.stats[f"{k}_steps"])
            g = Gauge("pdecode_spec_tokens_per_drafted_step", "tokens per row per drafted step, decayed over recent "
                      "drafted calls (NaN before the first)", names, registry=r)
            g.labels(**labels).set_function(lambda: float("nan") if engine.tau is None else engine.tau)

    def http(self, endpoint: str, status: int) -> None:
        self.requests.labels(**self._labels, endpoint=endpoint, status=str(status)).inc()

    def tokens(self, n: int, gap_s: float) -> None:
        """``n`` tokens reached the server ``gap_s`` after the request's previous ones."""
        for _ in range(n):
            self.itl.labels(**self._labels).observe(gap_s / n)

    def finished(self, st, e2e_s: float) -> None:
        """A completion request's figures (``st``: its `serve.Stats`) when its handler ended."""
        lb = self._labels
        self.prompt_tokens.labels(**lb).inc(st.prompt)
        self.generation_tokens.labels(**lb).inc(st.completion)
        self.forwards.labels(**lb).inc(st.forwards)
        for reason in st.finish:
            self.finished_reqs.labels(**lb, finish_reason=reason).inc()
        if st.ttft is not None:
            self.ttft.labels(**lb).observe(st.ttft)
        self.e2e.labels(**lb).observe(e2e_s)
        if st.forwards:
            self.tpf.labels(**lb).observe(st.completion / st.forwards)
        if st.accepted:
            self.spec_steps.labels(**lb).inc(sum(st.accepted))
            for k, n in enumerate(accepted_per_position(st.accepted), start=1):
                self.spec_accepted.labels(**lb, position=str(k)).inc(n)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def accepted_per_position(hist: list[int]) -> list[int]:
    """From a histogram of verify steps by drafted tokens accepted (k = 0..depth): per position 1..depth, the steps
    that accepted the drafted token there (those that accepted at least that many)."""
    out, run = [], 0
    for n in reversed(hist[1:]):
        run += n
        out.append(run)
    return out[::-1]
