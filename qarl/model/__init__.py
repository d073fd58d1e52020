"""The decoder, its loading and the embedded model zoo. Knows nothing about quantization or RL."""

from qarl.model.cache import KVCache
from qarl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from qarl.model.decoder import CausalLM
from qarl.model.loading import load_model, save_model
from qarl.model.tokenizer import Tokenizer, load_tokenizer
from qarl.model.zoo import ZOO, prepare
from qarl.paths import qarl_home

__all__ = [
    "CausalLM", "KVCache", "ModelConfig", "SUPPORTED_ARCHITECTURES", "Tokenizer", "ZOO",
    "load_model", "load_tokenizer", "prepare", "qarl_home", "save_model",
]
