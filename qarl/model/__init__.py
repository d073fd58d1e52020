"""The decoder, its loading and the embedded model zoo. Knows nothing about quantization or RL."""

from qarl.model.cache import KVCache
from qarl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from qarl.model.decoder import CausalLM
from qarl.model.loading import DTYPES, save_model
from qarl.model.sources import load_model, load_skeleton, load_tokenizer
from qarl.model.tokenizer import Tokenizer
from qarl.model.zoo import ZOO, prepare

__all__ = [
    "CausalLM", "DTYPES", "KVCache", "ModelConfig", "SUPPORTED_ARCHITECTURES", "Tokenizer", "ZOO",
    "load_model", "load_skeleton", "load_tokenizer", "prepare", "save_model",
]
