"""Registers the built-in decoding methods."""

from __future__ import annotations

from pdecode.decode import ar
from pdecode.decode.registry import Method, Plan, register


def _prepare_ar(model, draft, opts, samp):
    return Plan(fn=ar.generate, params=model.params, static={"cfg": model.cfg})


register(Method("ar", _prepare_ar, options={}, summary="autoregressive, one token per forward"))
