"""Reading a Gemma 4 assistant's checkpoint (``gemma4_assistant``; the network is `pdecode.model.families.gemma4_assistant`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdecode.checkpoint.hf import tensors_to_params
from pdecode.checkpoint.safetensors_io import read_checkpoint_dir
from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError
from pdecode.model.families import gemma4_assistant as A


def is_assistant_dir(path: Path) -> bool:
    f = Path(path) / "config.json"
    if not f.exists():
        return False
    try:
        return json.loads(f.read_text()).get("model_type") == "gemma4_assistant"
    except ValueError:
        return False


def load(path: str | Path, tcfg: ModelConfig, dtype=np.float32) -> tuple[A.AssistantConfig, dict]:
    """(AssistantConfig, numpy params) of a ``gemma4_assistant`` directory, checked against its target."""
    path = Path(path)
    acfg = A.config_from_hf(json.loads((path / "config.json").read_text()))
    A.check_pair(acfg, tcfg, str(path))
    tensors = read_checkpoint_dir(path)
    specs = acfg.specs(tcfg)
    params = tensors_to_params(tensors, {k: v for k, v in specs.items() if k != "token_ordering"},
                               A.rules(acfg, tensors), acfg.cfg.num_layers, dtype, source=str(path))
    if acfg.num_centroids:
        name = "masked_embedding.token_ordering"
        if name not in tensors:
            raise CheckpointError(f"{path}: use_ordered_embeddings needs the tensor {name!r}")
        order = np.asarray(tensors[name]).astype(np.int32)
        if sorted(order.tolist()) != list(range(acfg.cfg.vocab_size)) or \
                acfg.cfg.vocab_size % acfg.num_centroids:
            raise CheckpointError(f"{path}: {name} is not a permutation of the vocabulary in {acfg.num_centroids} "
                                  "equal clusters")
        params["token_ordering"] = order
    return acfg, params
