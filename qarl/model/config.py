"""ModelConfig: the decoder families qarl runs, read from and written to HF `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Hugging Face `architectures[0]` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_HF_NAME = {family: hf for hf, family in SUPPORTED_ARCHITECTURES.items()}


@dataclass
class ModelConfig:
    """A dense decoder: Llama (plain), Qwen2 (bias on q/k/v), Qwen3 (RMSNorm on q and k)."""

    family: str = "qwen3"
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF form; rope_type "llama3" or "default"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v bias (Qwen2); o_proj never has one
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other HF keys, written back as-is

    def __post_init__(self) -> None:
        if self.family not in _HF_NAME:
            raise ValueError(
                f"unsupported model family {self.family!r}; supported: {sorted(_HF_NAME)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            model_type = hf.get("model_type")
            raise ValueError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}); qarl runs "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "bos_token_id", "eos_token_id", "architectures", "model_type",
            "rope_parameters",
        }
        # transformers >= 5 writes rope_theta and the scaling together as `rope_parameters`.
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaled = rope.get("rope_type") not in (None, "default")
        rope_scaling = hf.get("rope_scaling") or (rope if scaled else None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
            "llama3", "default"
        ):
            raise ValueError(
                f"unsupported rope_scaling {rope_scaling!r}; qarl supports 'llama3' and 'default'"
            )
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias (its HF config has no key for it).
            attention_bias=hf.get("attention_bias", family == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf(self) -> dict[str, Any]:
        hf = dict(self.extra)
        hf.update(
            architectures=[_HF_NAME[self.family]],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            hidden_act="silu",
        )
        if self.family == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        return hf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
