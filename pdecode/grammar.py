"""Structured output: a grammar (a regular expression, a JSON schema, any JSON object, a choice among strings)
compiled to a token-level automaton whose tables live on the device, so every decode loop applies it inside its
compiled program, at every drafted and verified position, with no host round trip.

The grammar library is outlines-core (the ``grammar`` extra): it turns a JSON schema into a regular expression and a
regular expression plus the tokenizer's vocabulary into a DFA over token ids (docs/serving.md, "Structured output",
says why this one). Here that DFA becomes three arrays (`Tables`), several grammars side by side in one table:

- ``allow`` [S, W] uint32: bit t of state s is set when token t may come next (W = ceil(V / 32)); the model's EOS ids
  are allowed exactly in accepting states;
- ``base`` [S, W] int32 and ``nexts`` [T] int32: the state after token t is ``nexts[base[s, t // 32] + rank]``,
  ``rank`` the number of allowed tokens below t in that word (a popcount): O(1), T = the allowed transitions;
- ``forced`` [S] int32: the one token a state allows, or -1.

State 0 is free (every token allowed, it stays 0): a row without a grammar, in the same batch as rows with one.
A token a state does not allow also leads to state 0 (a drafted node off the grammar is never accepted: its
distribution masks it, so whatever follows it is never reached).

Masking turns the processed distribution into the *constrained* one (`sampling.penalize`'s ban); speculative
methods verify every node against it, each node's state found by walking its path from the committed state, so they
are lossless with respect to constrained AR sampling (tests/test_grammar.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pdecode.errors import InputError

FREE = 0  # the unconstrained state


@struct.dataclass
class Tables:
    """One or more compiled grammars on the device (see the module's docstring). Shapes are static per program."""

    allow: jax.Array  # [S, W] uint32
    base: jax.Array  # [S, W] int32
    nexts: jax.Array  # [T] int32
    forced: jax.Array  # [S] int32


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """One compiled grammar on the host: its states numbered 0..n-1 (0 the start), before packing (`pack`)."""

    allow: np.ndarray  # [n, W] uint32
    nexts: list  # per state: int32 array of next states for its allowed tokens, ascending token order
    spec: str  # what it was compiled from (for messages and caching)

    @property
    def num_states(self) -> int:
        return self.allow.shape[0]

    @property
    def num_transitions(self) -> int:
        return int(sum(len(x) for x in self.nexts))


# ------------------------------------------------------------------------------------------------ host: compile
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = printable[:], 0
    order = printable[:]
    for b in range(256):
        if b not in printable:
            order.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(order, chars)}


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id stands for (None: a special token or an id the tokenizer lacks). Byte-level BPE
    (GPT-2 / Llama 3 / Qwen) maps its printable alphabet back to bytes; SentencePiece-style vocabularies (Llama 2,
    Gemma) turn ``▁`` into a space and ``<0xNN>`` byte fallbacks into that byte."""
    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {}) or "ByteLevel" in json.dumps(
        spec.get("pre_tokenizer") or {})
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    table = _byte_decoder() if byte_level else None
    out: list[bytes | None] = [None] * vocab_size
    for s, i in tokenizer.vocab().items():
        if i >= vocab_size or i in special:
            continue
        if table is not None:
            if all(c in table for c in s):
                out[i] = bytes(table[c] for c in s)
            else:  # an added (non-special) token written as plain text
                out[i] = s.encode()
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out[i] = bytes([int(s[3:5], 16)])
        else:
            out[i] = s.replace("\u2581", " ").encode()
    return out


def _outlines():
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError as e:
        raise InputError("structured output needs outlines-core: pip install 'pdecode[grammar]' "
                         "(or pip install outlines-core)") from e
    return outlines_core, build_regex_from_schema


def schema_regex(schema: Any) -> str:
    """The regular expression of a JSON schema (a dict or its JSON text); a schema outlines-core cannot read is an
    InputError."""
    _, build = _outlines()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return build(text)
    except Exception as e:  # noqa: BLE001 (the library raises ValueError or its own types)
        raise InputError(f"json_schema: cannot compile this schema ({str(e).splitlines()[0][:200]})") from None


def check_schema(schema: dict) -> None:
    """``schema`` against its meta-schema (its ``$schema``, else JSON Schema 2020-12), or one InputError naming where
    it breaks the spec and how (``{"type": "objekt"}``, ``"required": "name"``, ``"minimum": "ten"``)."""
    try:
        import jsonschema
    except ImportError as e:
        raise InputError("structured output needs jsonschema to check a schema: pip install 'pdecode[grammar]' "
                         "(or pip install jsonschema)") from e
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    except Exception as e:  # noqa: BLE001 (an unknown $schema URI)
        raise InputError(f"json_schema: unknown $schema {schema.get('$schema')!r} ({e})") from None
    errors = sorted(validator(validator.META_SCHEMA).iter_errors(schema),
                    key=lambda e: (len(e.path), list(map(str, e.path))))
    if not errors:
        return
    # the deepest error of the first failing place: "properties.a.minimum: 'ten' is not of type 'number'"
    e = max((x for x in errors if list(x.path) == list(errors[0].path)), key=lambda x: len(x.schema_path))
    while e.context:  # anyOf/oneOf in the meta-schema: its branches say what was expected
        e = min(e.context, key=lambda x: (len(x.path), -len(x.schema_path)))
    where = ".".join(str(k) for k in errors[0].path) or "(the schema itself)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    raise InputError(f"json_schema breaks the JSON Schema spec at {where}: {e.message[:200]}{more}")


def json_object_regex() -> str:
    """Any JSON object (OpenAI's ``json_object``): outlines-core's regex of ``{"type": "object"}`` (JSON is not a
    regular language: its values nest to a bounded depth)."""
    return schema_regex({"type": "object"})


def choice_regex(choices: Sequence[str]) -> str:
    """One of ``choices`` exactly (vLLM's ``guided_choice``)."""
    import re

    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InputError("a choice must be a non-empty list of non-empty strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


MAX_STATES = 1 << 16  # per grammar: a larger automaton is refused (it would not fit a serving table)


def vocabulary_map(tokens: Sequence[bytes | None], eos_ids: Sequence[int]) -> dict[bytes, list[int]]:
    """outlines-core's vocabulary: each token text (bytes) -> the ids spelling it (no EOS, no special tokens)."""
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if b and i not in eos_ids:
            by_bytes.setdefault(b, []).append(i)
    return by_bytes


@functools.lru_cache(maxsize=64)
def _compile(regex: str, tokens: tuple, vocab_size: int, eos_ids: tuple[int, ...]) -> Grammar:
    oc, _ = _outlines()
    by_bytes = vocabulary_map(tokens, eos_ids)
    fake_eos = eos_ids[0] if eos_ids else vocab_size  # outlines' end token; replaced by the model's EOS ids below
    try:
        index = oc.Index(regex, oc.Vocabulary(fake_eos, by_bytes))
    except Exception as e:  # noqa: BLE001
        raise InputError(f"grammar: cannot compile {regex[:80]!r} for this tokenizer "
                         f"({str(e).splitlines()[0][:200]})") from None
    trans = {s: {t: n for t, n in e.items() if t != fake_eos} for s, e in index.get_transitions().items()}
    return from_transitions(trans, index.get_initial_state(), index.get_final_states(), vocab_size, eos_ids, regex)


def from_transitions(trans: dict, initial: int, finals, vocab_size: int, eos_ids: Sequence[int],
                     spec: str = "") -> Grammar:
    """A `Grammar` from a token-level DFA: ``trans`` {state: {token id: next state}} (any hashable state names),
    its ``initial`` state and accepting ``finals``. The ``eos_ids`` are allowed in accepting states (and in any
    state with no way on, so a row never has nothing to draw)."""
    finals = set(finals)
    order = [initial] + sorted((s for s in set(trans) | finals if s != initial), key=repr)
    order += sorted({n for e in trans.values() for n in e.values()} - set(order), key=repr)
    if len(order) > MAX_STATES:
        raise InputError(f"grammar: {len(order)} states, more than {MAX_STATES}; simplify the schema or pattern")
    num = {s: k for k, s in enumerate(order)}
    w = (vocab_size + 31) // 32
    allow = np.zeros((len(order), w), np.uint32)
    nexts = []
    for s in order:
        k = num[s]
        edges = {int(t): num[n] for t, n in trans.get(s, {}).items() if 0 <= t < vocab_size}
        if s in finals or not edges:  # EOS ends a complete match (and any dead end: never an empty row)
            edges.update({int(e): k for e in eos_ids if 0 <= e < vocab_size})
        toks = np.asarray(sorted(edges), np.int64)
        if len(toks):
            np.bitwise_or.at(allow[k], toks // 32, (np.uint32(1) << (toks % 32).astype(np.uint32)))
        nexts.append(np.asarray([edges[t] for t in toks], np.int32))
    return Grammar(allow=allow, nexts=nexts, spec=spec)


def compile_regex(regex: str, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> Grammar:
    """A regular expression over the output's text, for ``tokenizer``'s ids (compiled once per regex and
    tokenizer). ``eos_ids``: the tokens that may end the output, allowed once the text matches."""
    if not isinstance(regex, str) or not regex:
        raise InputError("a grammar's regex must be a non-empty string")
    if not eos_ids:
        raise InputError("structured output needs the model's EOS id (config.json eos_token_id) to end a match")
    cached = getattr(tokenizer, "_token_bytes", None)
    if cached is None or len(cached) != vocab_size:
        cached = tuple(token_bytes(tokenizer, vocab_size))
        tokenizer._token_bytes = cached
    return _compile(regex, cached, int(vocab_size), tuple(sorted(int(e) for e in eos_ids)))


def regex_of(kind: str, value: Any = None) -> str:
    """The regex of a grammar given as ``kind``: "regex" (value: the pattern), "json_schema" (value: the schema),
    "json_object" (no value), "choice" (value: the strings)."""
    if kind == "regex":
        return value
    if kind == "json_schema":
        return schema_regex(value)
    if kind == "json_object":
        return json_object_regex()
    if kind == "choice":
        return choice_regex(value)
    raise InputError(f"unknown grammar kind {kind!r}: use regex, json_schema, json_object or choice")


# ------------------------------------------------------------------------------------------------ host: pack
def _popcount_prefix(allow: np.ndarray) -> np.ndarray:
    """[S, W] int64: per state, the allowed tokens in the words before each word."""
    counts = np.zeros(allow.shape, np.int64)
    for bit in range(32):
        counts += (allow >> np.uint32(bit)) & np.uint32(1)
    return (np.cumsum(counts, axis=1) - counts).astype(np.int64)


def pack(grammars: Sequence[Grammar], vocab_size: int) -> tuple[Tables, list[int]]:
    """Put ``grammars`` into one `Tables` (state 0 free) and return it with each grammar's start state. The tables'
    sizes are the sizes needed rounded up to powers of two (nearby sizes share one compiled program)."""
    rnd = lambda x: 1 << max(0, int(x - 1).bit_length())  # noqa: E731
    pool = Pool(vocab_size, rnd(1 + sum(g.num_states for g in grammars)),
                rnd(max(1, sum(g.num_transitions for g in grammars))))
    starts = [pool.acquire(g) for g in grammars]
    return jax.device_put(pool.tables()), starts


# ------------------------------------------------------------------------------------------------ device
def allowed(t: Tables, state: jax.Array, vocab_size: int) -> jax.Array:
    """[..., V] bool: the tokens each ``state`` [...] allows."""
    words = t.allow[state]  # [..., W]
    bits = (words[..., :, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return bits.reshape(*state.shape, -1)[..., :vocab_size].astype(bool)


def advance(t: Tables, state: jax.Array, token: jax.Array) -> jax.Array:
    """The state after ``token`` in each ``state`` (same shapes); a token the state does not allow, or state 0,
    gives 0."""
    token = token.astype(jnp.int32)
    w = jnp.clip(token >> 5, 0, t.allow.shape[1] - 1)
    bit = (token & 31).astype(jnp.uint32)
    word = t.allow[state, w]
    ok = ((word >> bit) & jnp.uint32(1)).astype(bool) & (token >= 0) & (state != FREE)
    below = word & ((jnp.uint32(1) << bit) - jnp.uint32(1))
    rank = jax.lax.population_count(below).astype(jnp.int32)
    idx = jnp.clip(t.base[state, w] + rank, 0, t.nexts.shape[0] - 1)
    return jnp.where(ok, t.nexts[idx], FREE)


def advance_taken(t: Tables, state_B: jax.Array, tokens_BK: jax.Array, n_B: jax.Array) -> jax.Array:
    """The state after each row's first ``n[b]`` tokens of ``tokens`` (K static and small: a short unrolled walk)."""
    for k in range(tokens_BK.shape[1]):
        state_B = jnp.where(k < n_B, advance(t, state_B, tokens_BK[:, k]), state_B)
    return state_B


def ban(t: Tables, state: jax.Array, vocab_size: int) -> jax.Array:
    """[..., V] bool: the tokens each state forbids (what `sampling.penalize` masks)."""
    return ~allowed(t, state, vocab_size)


def node_states(t: Tables, state_B: jax.Array, tokens_BN: jax.Array, parents_BN: jax.Array, max_depth: int,
                force: bool = False):
    """Each drafted node's state after its own token, walking the tree from the root's ``state`` (node 0 is the
    root: its state is ``state``). Returns (tokens, states [B, N]). ``force``: deterministic drafts get the
    grammar's forced tokens written in: a node whose parent's state allows one token alone gets that token (the
    target's constrained distribution there is a point mass on it, so it is accepted: forced tokens are free
    drafts)."""
    b, n = tokens_BN.shape
    states = jnp.broadcast_to(state_B[:, None], (b, n))
    par = jnp.maximum(parents_BN, 0)
    drafted = tokens_BN
    for _ in range(max_depth):  # depth by depth: a node's parent is settled one round before it
        ps = jnp.take_along_axis(states, par, axis=1)
        if force:
            f = t.forced[ps]
            tokens_BN = drafted.at[:, 1:].set(jnp.where(f[:, 1:] >= 0, f[:, 1:], drafted[:, 1:]))
        states = advance(t, ps, tokens_BN).at[:, 0].set(state_B)
    return tokens_BN, states


# ------------------------------------------------------------------------------------------------ host: specs
KINDS = ("regex", "json_schema", "json_object", "choice")


def parse_spec(spec: Any) -> tuple[str, Any]:
    """A grammar as `pdecode.generate` takes it -> (kind, value): a string is a regular expression; a dict has one
    of the keys ``regex`` (a pattern), ``json_schema`` (a schema: a dict or its JSON text), ``json_object`` (true:
    any JSON object) or ``choice`` (a list of strings, the output one of them)."""
    if isinstance(spec, str):
        return "regex", spec
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, value), = spec.items()
        if kind in KINDS:
            if kind == "json_object" and value is not True:
                raise InputError("grammar {'json_object': ...} takes true")
            if kind == "json_schema" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise InputError(f"json_schema is not valid JSON ({e.msg} at character {e.pos})") from None
            if kind == "json_schema" and not isinstance(value, dict):
                raise InputError(f"json_schema must be a JSON object (a schema), got {type(value).__name__}")
            if kind == "json_schema":
                check_schema(value)
            return kind, value
    raise InputError(f"a grammar is a regex string or a dict with one key of {', '.join(KINDS)}; got {spec!r:.80}")


def compile_spec(spec: Any, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> Grammar:
    """`parse_spec` then `compile_regex` (a `Grammar` already compiled is returned as it is)."""
    if isinstance(spec, Grammar):
        if spec.allow.shape[1] != (vocab_size + 31) // 32:
            raise InputError("this Grammar was compiled for another vocabulary size")
        return spec
    if tokenizer is None:
        raise InputError("structured output from a regex or schema needs the model's tokenizer (tokenizer.json): grammars are over text")
    kind, value = parse_spec(spec)
    return compile_regex(regex_of(kind, value), tokenizer, vocab_size, eos_ids)


# ------------------------------------------------------------------------------------------------ host: a pool
def default_states(vocab_size: int) -> int:
    """A serving engine's default table size in states: 4096, fewer for large vocabularies (the allowed bits and
    the transition bases take 8 bytes per 32 tokens per state: at most 64 MiB)."""
    w = (vocab_size + 31) // 32
    return int(max(256, min(4096, (64 << 20) // (8 * w))))


DEFAULT_TRANSITIONS = 1 << 22  # 16 MiB of int32 next states


class Pool:
    """The tables of a serving engine: fixed capacity (one shape: no compile when grammars come and go), grammars
    placed in free ranges of states and transitions as requests bring them and kept while any request uses them
    (then evicted, least recently used first, when a new one needs the room). Host-side numpy; ``version`` moves
    whenever the arrays change (the engine then uploads them)."""

    def __init__(self, vocab_size: int, states: int, transitions: int):
        self.vocab, self.states, self.transitions = vocab_size, int(states), int(transitions)
        w = (vocab_size + 31) // 32
        self.allow = np.zeros((self.states, w), np.uint32)
        self.allow[0] = np.uint32(0xFFFFFFFF)
        self.base = np.zeros((self.states, w), np.int32)
        self.nexts = np.zeros((self.transitions,), np.int32)
        self.forced = np.full((self.states,), -1, np.int32)
        self.placed: dict[int, list] = {}  # id(grammar) -> [grammar, s0, t0, users, last use]
        self.dirty: list[tuple[int, int, int, int]] = []  # (s0, states, t0, transitions) written since `take_dirty`
        self.version = 0
        self._clock = 0

    def tables(self) -> Tables:
        return Tables(allow=self.allow, base=self.base, nexts=self.nexts, forced=self.forced)

    def fits_ever(self, g: Grammar) -> bool:
        return g.num_states <= self.states - 1 and g.num_transitions <= self.transitions

    def _free_range(self, used: list[tuple[int, int]], need: int, lo: int, hi: int) -> int | None:
        at = lo
        for a, n in sorted(used):
            if a - at >= need:
                return at
            at = max(at, a + n)
        return at if hi - at >= need else None

    def acquire(self, g: Grammar) -> int | None:
        """``g``'s start state, placing it if it is not in the tables (evicting unused grammars as needed); None
        when the grammars in use leave no room (try again once some finish)."""
        self._clock += 1
        e = self.placed.get(id(g))
        if e is None:
            while True:
                s0 = self._free_range([(x[1], x[0].num_states) for x in self.placed.values()], g.num_states, 1,
                                      self.states)
                t0 = self._free_range([(x[2], x[0].num_transitions) for x in self.placed.values()],
                                      g.num_transitions, 0, self.transitions)
                if s0 is not None and t0 is not None:
                    break
                idle = [x for x in self.placed.values() if x[3] == 0]
                if not idle:
                    return None
                victim = min(idle, key=lambda x: x[4])
                del self.placed[id(victim[0])]
            self._write(g, s0, t0)
            e = self.placed[id(g)] = [g, s0, t0, 0, 0]
        e[3] += 1
        e[4] = self._clock
        return e[1]

    def release(self, g: Grammar) -> None:
        e = self.placed.get(id(g))
        if e is not None:
            e[3] = max(0, e[3] - 1)

    def _write(self, g: Grammar, s0: int, t0: int) -> None:
        n = g.num_states
        self.allow[s0:s0 + n] = g.allow
        lens = np.asarray([len(x) for x in g.nexts], np.int64)
        row_off = t0 + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        self.base[s0:s0 + n] = (row_off[:, None] + _popcount_prefix(g.allow)).astype(np.int32)
        for k, x in enumerate(g.nexts):
            self.nexts[row_off[k]:row_off[k] + len(x)] = x + s0
        self.forced[s0:s0 + n] = _forced(g)
        self.dirty.append((s0, n, t0, int(lens.sum())))
        self.version += 1

    def take_dirty(self) -> list[tuple[int, int, int, int]]:
        """The ranges written since the last call, (first state, states, first transition, transitions) each."""
        out, self.dirty = self.dirty, []
        return out

    def windows(self, dirty, rows: int, width: int) -> list[tuple[int, int]]:
        """Start (state, transition) pairs of windows of ``rows`` states and ``width`` transitions (within the
        tables) that cover ``dirty`` (`take_dirty`): what an upload in fixed-size pieces writes."""
        out = []
        for s0, n, t0, m in dirty:
            ss = [min(s0 + i, self.states - rows) for i in range(0, max(n, 1), rows)]
            ts = [min(t0 + i, self.transitions - width) for i in range(0, max(m, 1), width)]
            out += [(ss[min(i, len(ss) - 1)], ts[min(i, len(ts) - 1)]) for i in range(max(len(ss), len(ts)))]
        return out


def _forced(g: Grammar) -> np.ndarray:
    out = np.full((g.num_states,), -1, np.int32)
    for k, x in enumerate(g.nexts):
        if len(x) == 1:
            word = int(np.flatnonzero(g.allow[k])[0])
            out[k] = word * 32 + int(g.allow[k, word]).bit_length() - 1
    return out
