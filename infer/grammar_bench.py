"""Structured output: what a grammar costs.

1. **Per-step mask cost** of the grammar libraries, walking one constrained answer token by token (the mask of the
   allowed next tokens, then the token taken): outlines-core's automaton read from pdecode's device tables inside a
   compiled program (what the decode loops do; no host round trip) against the host-side matchers — outlines-core's
   own index, llguidance and xgrammar where installed (``pip install llguidance xgrammar``; xgrammar also needs
   apache-tvm-ffi and torch). A host matcher would also need a device->host sync per step and a rollback per drafted
   node, which the figures leave out.
2. **Generation overhead**: ``pdecode.generate`` with a JSON schema against without, ar and sd, the same prompts and
   budget, runs interleaved, medians over repeats: seconds per new token and per target forward (a step of the
   batch: the grammar's own cost, whatever the answers' lengths), and tokens per target forward (sd's drafts masked
   by the grammar, forced tokens written in).

    python -m infer.grammar_bench [--model code-target --draft code-draft --repeats 5 --out runs/grammar_bench.json]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from pdecode.cli_args import ArgumentParser

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "id": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                           "ok": {"type": "boolean"}}, "required": ["name", "id", "ok"]}
PROMPTS = ["def f(x):\n    return", "# one record\nrecord = ", "import os\n", "config = ", "class Item:\n",
           "data = load(", "result = {", "# settings\n"]


def _median_us(fn, steps: int, repeats: int = 5) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) / steps * 1e6)
    return statistics.median(ts)


def mask_costs(m, tokens: list[int], repeats: int = 5) -> dict:
    """Microseconds per step (mask + advance) along ``tokens`` (a constrained answer), per library."""
    import jax
    import jax.numpy as jnp

    from pdecode import api, grammar

    v, eos = m.cfg.vocab_size, api.eos_ids(m)
    schema = json.dumps(SCHEMA)
    regex = grammar.schema_regex(SCHEMA)
    out = {}
    t = time.perf_counter()
    g = grammar.compile_regex(regex + " ", m.tokenizer, v, eos)  # (a fresh compile: not the cached one)
    out["pdecode_compile_ms"] = (time.perf_counter() - t) * 1e3
    tables, (start,) = grammar.pack([g], v)
    seq = jnp.asarray(tokens, jnp.int32)
    for b in (1, 16):
        @jax.jit
        def walk(tables, seq, b=b):
            def one(s, tok):
                mask = grammar.allowed(tables, s, v)
                return grammar.advance(tables, s, jnp.broadcast_to(tok, s.shape)), jnp.sum(mask)
            return jax.lax.scan(one, jnp.full((b,), start, jnp.int32), seq)

        jax.block_until_ready(walk(tables, seq))
        out[f"pdecode_device_b{b}_us"] = _median_us(lambda: jax.block_until_ready(walk(tables, seq)), len(tokens),
                                                     repeats)
    # outlines-core's index on the host: allowed ids -> a boolean mask, then the next state
    import outlines_core as oc

    toks = grammar.token_bytes(m.tokenizer, v)
    index = oc.Index(regex, oc.Vocabulary(eos[0], grammar.vocabulary_map(toks, eos)))

    def outlines_walk():
        s = index.get_initial_state()
        for tok in tokens:
            mask = np.zeros((v,), bool)
            mask[index.get_allowed_tokens(s)] = True
            s = index.get_next_state(s, tok)

    out["outlines_host_us"] = _median_us(outlines_walk, len(tokens), repeats)
    try:
        import llguidance
        import llguidance.numpy as lln
        from llguidance.hf import from_tokenizer
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=m.tokenizer.backend, eos_token="<|endoftext|>")
        lt = from_tokenizer(hf, n_vocab=v)
        grm = llguidance.LLMatcher.grammar_from_json_schema(schema)
        bitmask = lln.allocate_token_bitmask(1, v)

        def llg_walk():
            mt = llguidance.LLMatcher(lt, grm)
            for tok in tokens:
                lln.fill_next_token_bitmask(mt, bitmask, 0)
                mt.consume_token(tok)

        out["llguidance_host_us"] = _median_us(llg_walk, len(tokens), repeats)
    except Exception as e:  # noqa: BLE001 (optional: reported, not fatal)
        out["llguidance_host_us"] = f"unavailable: {type(e).__name__}: {str(e)[:80]}"
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo([bts or b"" for bts in toks], vocab_type=xgr.VocabType.RAW, vocab_size=v,
                                 stop_token_ids=list(eos))
        compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
        bitmask = xgr.allocate_token_bitmask(1, v)

        def xgr_walk():
            mt = xgr.GrammarMatcher(compiled)
            for tok in tokens:
                mt.fill_next_token_bitmask(bitmask)
                mt.accept_token(tok)

        out["xgrammar_host_us"] = _median_us(xgr_walk, len(tokens), repeats)
    except Exception as e:  # noqa: BLE001
        out["xgrammar_host_us"] = f"unavailable: {type(e).__name__}: {str(e)[:80]}"
    return out


def generation_overhead(m, draft, repeats: int, max_new: int = 64) -> list[dict]:
    """Per method, seconds per new token with and without the schema (medians, runs interleaved) and tokens per
    target forward."""
    import pdecode

    cases = [("ar", {}), ("sd", {"draft": draft, "gamma": 4})]
    rows = {(meth, con): {"s_per_token": [], "s_per_forward": [], "tokens_per_forward": None}
            for meth, _ in cases for con in (0, 1)}
    for r in range(repeats + 1):
        for meth, kw in cases:
            for con in (0, 1):
                o = pdecode.generate(m, PROMPTS, method=meth, max_new_tokens=max_new, seed=r,
                                     json_schema=SCHEMA if con else None, **kw)
                row = rows[(meth, con)]
                row["tokens_per_forward"] = o.stats["tokens_per_forward"]
                row["new_tokens"] = o.stats["new_tokens"]
                if r:  # the first round compiles
                    row["s_per_token"].append(o.stats["wall_s"] / max(o.stats["new_tokens"], 1))
                    row["s_per_forward"].append(o.stats["wall_s"] / max(o.stats["target_forwards"], 1))
    return [{"method": meth, "grammar": bool(con), "ms_per_token": 1e3 * statistics.median(v["s_per_token"]),
             "ms_per_forward": 1e3 * statistics.median(v["s_per_forward"]),
             "tokens_per_forward": v["tokens_per_forward"], "new_tokens": v["new_tokens"]}
            for (meth, con), v in rows.items()]


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="code-target")
    ap.add_argument("--draft", default="code-draft")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/grammar_bench.json")
    a = ap.parse_args(argv)
    import pdecode

    m, d = pdecode.load(a.model), pdecode.load(a.draft)
    answer = pdecode.generate(m, PROMPTS[:1], max_new_tokens=96, json_schema=SCHEMA)
    tokens = answer.tokens[0][:-1]  # the answer's tokens before EOS
    print(f"answer walked: {answer.texts[0]!r} ({len(tokens)} tokens)", flush=True)
    masks = mask_costs(m, tokens, a.repeats)
    print("| mask + advance per step | us |\n|---|---|")
    for k, val in masks.items():
        print(f"| {k} | {val if isinstance(val, str) else f'{val:.1f}'} |")
    gen = generation_overhead(m, d, a.repeats)
    print("\n| method | grammar | ms / new token | ms / target forward (a step of the batch) | tokens / forward | "
          "new tokens |\n|---|---|---|---|---|---|")
    for row in gen:
        print(f"| {row['method']} | {'json_schema' if row['grammar'] else '-'} | {row['ms_per_token']:.2f} | "
              f"{row['ms_per_forward']:.2f} | "
              f"{row['tokens_per_forward']:.2f} | {row['new_tokens']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"mask_costs": masks, "generation": gen, "answer": answer.texts[0]}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
