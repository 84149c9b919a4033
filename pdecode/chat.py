"""Chat prompts: a conversation rendered into the text a chat model was trained on.

The template is the tokenizer's own (``chat_template`` in tokenizer_config.json, or a ``chat_template.jinja`` file
beside it), rendered as Hugging Face renders it: Jinja2 in a sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and the tokenizer's other named
special tokens, and the helpers ``raise_exception`` and ``strftime_now``. Jinja2 is the optional ``chat`` extra
(``pip install pdecode[chat]``); it is needed only when a template is present.

Without a template, the plain format (`PLAIN_FORMAT`)::

    <role>: <content>

    <role>: <content>

    assistant:

every message as its role, a colon, a space and its content, messages separated by a blank line, and
``assistant:`` last when a generation prompt is asked for. Rendered text already holds the template's special
tokens, so it is encoded without the tokenizer's own (`encode_chat`).
"""

from __future__ import annotations

from typing import Any, Sequence

from pdecode.errors import InputError

ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": OpenAI's newer name for system
PLAIN_FORMAT = "<role>: <content>, messages separated by a blank line, then 'assistant:'"


def check_messages(messages: Any) -> list[dict]:
    """``messages`` as a list of {"role", "content"} dicts, or an InputError that says what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InputError(f"messages[{i}] must be an object with role and content, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise InputError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InputError(f"messages[{i}].content parts must all be {{\"type\": \"text\", \"text\": ...}}")
            content = "".join(texts)
        if not isinstance(content, str):
            raise InputError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({**msg, "role": "system" if role == "developer" else role, "content": content})
    return out


def _environment():
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise InputError("this tokenizer has a chat template, which needs Jinja2: pip install 'pdecode[chat]'") \
            from None

    def raise_exception(message):
        raise InputError(f"the chat template refused the conversation: {message}")

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    import json

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


def render(tok, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The conversation as text: through ``tok.chat_template`` when the tokenizer has one, else `PLAIN_FORMAT`."""
    messages = check_messages(messages)
    template = getattr(tok, "chat_template", None) if tok is not None else None
    if not template:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return text + ("\n\nassistant:" if add_generation_prompt else "")
    compiled = getattr(tok, "_chat_compiled", None)
    if compiled is None or compiled[0] != template:
        env = _environment()
        import jinja2

        try:
            compiled = (template, env.from_string(template))
        except jinja2.TemplateSyntaxError as e:
            raise InputError(f"the tokenizer's chat template does not parse (line {e.lineno}): {e.message}") from None
        tok._chat_compiled = compiled
    specials = dict(getattr(tok, "special_tokens", {}) or {})
    return compiled[1].render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)


def encode_chat(tok, text: str) -> list[int]:
    """Ids of rendered chat text: a template writes its own special tokens, so the tokenizer adds none."""
    return tok.encode(text, add_special_tokens=not getattr(tok, "chat_template", None))
