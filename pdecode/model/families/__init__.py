"""The built-in model families (`pdecode.model.family`): one module each, registered by HF ``model_type``."""
