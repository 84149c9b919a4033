"""The lower layers point one way: config <- model <- sharding <- checkpoint (and the tokenizer, which checkpoints
read, below them all but errors).

Every `import` / `from ... import` in their source counts, those inside functions too (a function-level import is
still a dependency; it only hides a circle from Python's import machinery). Parsed with `ast`, nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REAL_ROOT = ROOT = Path(__file__).resolve().parent.parent / "pdecode"

# layer -> the pdecode layers it may import (besides itself); everything else of pdecode is above them all
LAYERS = {
    "config": {"errors"},
    "tokenizer": {"errors"},
    "model": {"errors", "config"},
    "sharding": {"errors", "config", "model"},
    "checkpoint": {"errors", "config", "model", "sharding", "tokenizer"},
}
# modules of the model layer that import nothing of it (the leaves everything else may read)
LEAVES = ("model/spec.py", "model/rules.py")


def layer_of(module: str) -> str:
    """The layer of a dotted pdecode module name ("pdecode.model.family" -> "model")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported pdecode module) for every import statement in the file, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module_of(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "pdecode"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "pdecode":
                continue
            if mod == "pdecode":  # `from pdecode import checkpoint`: the names are modules (or the package's own)
                out += [(node.lineno, f"pdecode.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def files_of(layer: str) -> list[Path]:
    p = ROOT / layer
    if p.is_dir():
        return sorted(p.rglob("*.py"))
    f = ROOT / f"{layer}.py"
    assert f.exists() or ROOT != REAL_ROOT, f"no layer {layer} in pdecode/"
    return [f] if f.exists() else []


def violations() -> list[str]:
    bad = []
    for layer, allowed in LAYERS.items():
        for f in files_of(layer):
            for line, mod in imports(f):
                target = layer_of(mod)
                if target != layer and target not in allowed:
                    bad.append(f"{f.relative_to(ROOT.parent)}:{line} imports {mod} ({layer} may import "
                               f"{', '.join(sorted(allowed))})")
    for leaf in LEAVES:
        for line, mod in imports(ROOT / leaf):
            bad.append(f"pdecode/{leaf}:{line} imports {mod} (a leaf imports nothing of pdecode)")
    return bad


def test_lower_layers_point_one_way():
    bad = violations()
    assert not bad, "import circle between the lower layers:\n" + "\n".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The same check finds a function-level import that points the wrong way (and a relative one)."""
    root = tmp_path / "pdecode"
    for layer in ("config", "sharding"):
        (root / f"{layer}.py").parent.mkdir(parents=True, exist_ok=True)
    (root / "model").mkdir()
    (root / "checkpoint").mkdir()
    (root / "model" / "spec.py").write_text("X = 1\n")
    (root / "model" / "rules.py").write_text("def f():\n    from ..config import ModelConfig\n")
    (root / "config.py").write_text("def g():\n    from pdecode.model.family import family_of\n")
    (root / "sharding.py").write_text("import pdecode.model.spec\n")
    (root / "model" / "x.py").write_text("def h():\n    if True:\n        from pdecode.checkpoint import hf\n")
    monkeypatch.setitem(globals(), "ROOT", root)
    bad = violations()
    assert any("config.py:2 imports pdecode.model.family" in b for b in bad), bad
    assert any("model/x.py:3 imports pdecode.checkpoint" in b for b in bad), bad
    assert any("model/rules.py:2 imports pdecode.config" in b for b in bad), bad
    assert not any("sharding.py" in b for b in bad), bad


@pytest.mark.parametrize("module,layer", [("pdecode.model.family", "model"), ("pdecode.config", "config"),
                                          ("pdecode.checkpoint.hf", "checkpoint")])
def test_layer_of(module, layer):
    assert layer_of(module) == layer
