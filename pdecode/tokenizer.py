"""HF ``tokenizer.json`` through the `tokenizers` library, with the checkpoint's special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from pdecode.errors import CheckpointError


class Tokenizer:
    """Encode/decode text; ``bos_id``, ``eos_ids``, ``pad_id``, ``mask_id`` come from the checkpoint files."""

    def __init__(self, tok, bos_id=None, eos_ids=(), pad_id=None, mask_id=None, chat_template=None,
                 special_tokens=None):
        self._tok = tok
        self.chat_template = chat_template  # Jinja2 source (`pdecode.chat`), or None
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.mask_id = mask_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        return self._tok

    def vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def fingerprint(self) -> str:
        """A hash of `vocab` (computed once): two tokenizers with the same fingerprint map tokens to the same ids."""
        if getattr(self, "_fingerprint", None) is None:
            import hashlib

            blob = json.dumps(sorted(self.vocab().items()), ensure_ascii=False).encode()
            self._fingerprint = hashlib.sha256(blob).hexdigest()
        return self._fingerprint

    @classmethod
    def from_dir(cls, path: str | Path, hf_config: dict | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        f = path / "tokenizer.json"
        if not f.exists():
            raise CheckpointError(f"no tokenizer.json in {path}; pass token ids instead of text, or add the tokenizer")
        tok = HFTokenizer.from_file(str(f))
        tcfg = {}
        if (path / "tokenizer_config.json").exists():
            tcfg = json.loads((path / "tokenizer_config.json").read_text())
        hf_config = hf_config or {}

        def tid(name_cfg: str, name_tok: str):
            if hf_config.get(name_cfg) is not None:
                v = hf_config[name_cfg]
                return v
            t = tcfg.get(name_tok)
            if isinstance(t, dict):
                t = t.get("content")
            return tok.token_to_id(t) if isinstance(t, str) else None

        specials = {}
        for k, v in tcfg.items():
            if k.endswith("_token") and isinstance(v, dict):
                v = v.get("content")
            if k.endswith("_token") and isinstance(v, str):
                specials[k] = v
        eos = tid("eos_token_id", "eos_token")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(tok, bos_id=tid("bos_token_id", "bos_token"), eos_ids=eos_ids,
                   pad_id=tid("pad_token_id", "pad_token"), mask_id=tid("mask_token_id", "mask_token"),
                   chat_template=_chat_template(path, tcfg), special_tokens=specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))


def _chat_template(path: Path, tcfg: dict) -> str | None:
    """The default chat template: chat_template.jinja beside the tokenizer, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the one named "default", else the first)."""
    f = path / "chat_template.jinja"
    if f.exists():
        return f.read_text()
    t = tcfg.get("chat_template")
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default", next(iter(named.values()), None))
    return t if isinstance(t, str) and t else None
