"""pdecode: parallel text generation in JAX — draft-and-verify, multi-token prediction, diffusion and DiCo,
behind one jit-compiled engine."""

from pdecode.api import (GenerateOutput, Model, attach_heads, clear_compile_cache, enable_disk_cache, forward_logits,
                         token_logprobs,
                         generate, load, methods, refine, save_hf, zoo_dir, zoo_names)
from pdecode.config import ModelConfig
from pdecode.decompose import DecomposeOutput, decompose
from pdecode.distributed import init_distributed
from pdecode.engine import Engine, Event, stream
from pdecode.errors import CheckpointError, ConfigError, InputError, PdecodeError

__version__ = "0.1.0"

__all__ = ["load", "attach_heads", "generate", "refine", "stream", "Engine", "Event", "decompose", "DecomposeOutput", "methods", "forward_logits", "token_logprobs", "save_hf", "clear_compile_cache", "enable_disk_cache", "init_distributed", "Model", "GenerateOutput", "ModelConfig", "zoo_dir",
           "zoo_names", "PdecodeError", "ConfigError", "CheckpointError", "InputError", "__version__"]
