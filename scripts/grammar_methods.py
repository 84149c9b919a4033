"""Structured output on every token-loop method: greedy output under a 3-property JSON schema against constrained ar
(the same model; the heads' own base for EAGLE / Medusa / MTP / layer skip), and tokens per target forward.

    python scripts/grammar_methods.py
"""

from __future__ import annotations


def main() -> None:
    import pdecode

    m, d = pdecode.load("code-target"), pdecode.load("code-draft")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"},
                                               "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}
    prompts = ["def f(x):\n    return", "# one record\nrecord = ", "import os\nimport sys\n\n\ndef main():\n"]
    ref = pdecode.generate(m, prompts, max_new_tokens=40, json_schema=schema)
    cases = [("eagle", "code-target-eagle", {}), ("eagle", "code-target-eagle3", {}),
             ("medusa", "code-target-medusa", {}), ("mtp", "code-target-mtp", {}), ("tree", None, {"draft": d}),
             ("lookahead", None, {}), ("jacobi", None, {}), ("layerskip", "code-target-layerskip", {}),
             ("pearl", None, {"draft": d}), ("sd", None, {"draft": d, "gamma": 4}),
             ("diffusion_draft", None, {"draft": pdecode.load("code-dllm")})]
    print("| method | model | = constrained ar | tokens / forward |\n|---|---|---|---|")
    for meth, name, kw in cases:
        mm = m if name is None else pdecode.load(name)
        base = ref if name is None else pdecode.generate(mm, prompts, max_new_tokens=40, json_schema=schema)
        r = pdecode.generate(mm, prompts, method=meth, max_new_tokens=40, json_schema=schema, **kw)
        print(f"| {meth} | {name or 'code-target'} | {r.tokens == base.tokens} | "
              f"{r.stats['tokens_per_forward']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
