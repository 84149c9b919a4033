"""The model families against transformers, as a table: each family's tiny random checkpoint (tests/helpers.py),
its max logit difference (float32, 2 x 40 tokens), whether greedy output equals transformers' generate (3 prompts
of mixed lengths, 16 new tokens; sliding windows of 8), and which decoding methods give AR's tokens exactly.

    python scripts/family_parity.py [--families gemma2,mixtral] [--out docs/bench/families.md]

Needs the test extras (transformers, CPU torch). tests/test_families.py asserts the same facts."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pdecode  # noqa: E402
from pdecode.model.transformer import init_from_specs  # noqa: E402
from tests.helpers import NEW_FAMILIES, VOCAB, make_hf_model  # noqa: E402
from tests.test_families import HEADS, METHODS, NEW, PROMPTS, _draft_of  # noqa: E402  (the test's own cases)

def row(fam: str, d: Path) -> str:
    import torch

    ref = make_hf_model(fam, d, seed=3)
    m = pdecode.load(d)
    ids = np.random.default_rng(1).integers(3, VOCAB, size=(2, 40))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    diff = float(np.abs(np.asarray(pdecode.forward_logits(m, ids)) - want).max())
    ar = pdecode.generate(m, PROMPTS, max_new_tokens=NEW, stop_at_eos=False).tokens
    hf = []
    for p in PROMPTS:
        with torch.no_grad():
            o = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))
        hf.append(o[0, len(p):].tolist())
    draft = _draft_of(m)
    equal, differ = [], []
    for method, opts in METHODS:
        t = m
        if method in HEADS:
            hp = init_from_specs(HEADS[method].specs(m.cfg), jax.random.PRNGKey(0), std=0.05)
            t = dataclasses.replace(m, extras={method: (HEADS[method], hp)})
        kw = {"draft": draft} if method in ("sd", "tree") else {}
        out = pdecode.generate(t, PROMPTS, method=method, max_new_tokens=NEW, stop_at_eos=False, **kw, **opts)
        (equal if out.tokens == ar else differ).append(method)
    kinds = "/".join(sorted(set(m.cfg.layer_kinds())))
    return (f"| {fam} | {m.cfg.family} | {kinds} | {diff:.1e} | {'yes' if ar == hf else 'NO'} | "
            f"{len(equal)}/{len(METHODS)} {'(' + ', '.join(equal) + ')' if equal else ''}"
            f"{' DIFFER: ' + ', '.join(differ) if differ else ''} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(("llama", "llama3", "qwen2", "qwen3", "mistral") + NEW_FAMILIES))
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    lines = ["| checkpoint | family | layer kinds | max logit diff | greedy = transformers | methods = ar |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            lines.append(row(fam, Path(tmp) / fam))
            print(lines[-1], flush=True)
            pdecode.clear_compile_cache()  # each family's programs hold memory maps; a process has a limited number
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
