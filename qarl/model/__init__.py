"""The decoder, its loading and the embedded model zoo. Knows nothing about quantization or RL."""

from qarl.model.cache import KVCache
from qarl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from qarl.model.decoder import CausalLM

__all__ = ["CausalLM", "KVCache", "ModelConfig", "SUPPORTED_ARCHITECTURES"]
