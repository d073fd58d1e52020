"""ModelConfig: the decoder families qarl runs, read from and written to HF `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Hugging Face `architectures[0]` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
_HF_NAME = {family: hf for hf, family in SUPPORTED_ARCHITECTURES.items()}


@dataclass
class ModelConfig:
    """A decoder: Llama (plain), Qwen2 (bias on q/k/v), Qwen3 (RMSNorm on q and k), Qwen3-MoE
    (Qwen3 with sparse mixture-of-experts MLPs in the layers `moe_layers` names), Mixtral
    (Llama with a MoE MLP in every layer, top-k probabilities always renormalized)."""

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
    # MoE families only (Qwen3-MoE's HF names; Mixtral fixes norm_topk_prob = true,
    # decoder_sparse_step = 1, mlp_only_layers = [], intermediate_size = the expert width):
    # experts per MoE layer, experts per token, each expert's SwiGLU width, renormalize the
    # top-k router probabilities, every decoder_sparse_step-th layer is MoE except those in
    # mlp_only_layers (those keep a dense intermediate_size MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
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
        if self.family in MOE_FAMILIES:
            self._check_moe()

    def _check_moe(self) -> None:
        problems = []
        if self.num_experts < 1 or self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            problems.append(
                f"num_experts ({self.num_experts}), moe_intermediate_size "
                f"({self.moe_intermediate_size}) and decoder_sparse_step "
                f"({self.decoder_sparse_step}) must be >= 1")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                            f"[1, num_experts = {self.num_experts}]")
        if self.family == "mixtral" and (not self.norm_topk_prob or self.decoder_sparse_step != 1
                                         or self.mlp_only_layers or self.attention_bias):
            problems.append("mixtral has a MoE MLP in every layer, renormalized top-k "
                            "probabilities and no attention bias (norm_topk_prob = true, "
                            "decoder_sparse_step = 1, mlp_only_layers = [])")
        if problems:
            raise ValueError(f"invalid {self.family} config: " + "; ".join(problems))

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers with a sparse MoE MLP (HF's rule); () when dense."""
        if self.family not in MOE_FAMILIES:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

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
            "rope_parameters", *_MOE_KEYS, "num_local_experts",
        }
        if family == "mixtral":  # checked here (None: no sliding window), written by to_hf
            known.add("sliding_window")
            if hf.get("sliding_window") is not None:
                raise ValueError(f"Mixtral with sliding_window = {hf['sliding_window']} is not "
                                 f"supported; qarl's attention is full (sliding_window = null)")
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
            **(_moe_from_hf(hf) if family == "qwen3_moe" else
               _mixtral_from_hf(hf) if family == "mixtral" else {}),
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
        if self.family == "qwen3_moe":
            hf.update({key: getattr(self, key) for key in _MOE_KEYS})
        if self.family == "mixtral":
            hf.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      intermediate_size=self.moe_intermediate_size, sliding_window=None)
        if self.family == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        return hf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "decoder_sparse_step", "mlp_only_layers")


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes num_experts as `num_local_experts`; the Hub's configs say num_experts
    return dict(
        num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
        num_experts_per_tok=hf.get("num_experts_per_tok", 0),
        moe_intermediate_size=hf.get("moe_intermediate_size", 0),
        norm_topk_prob=hf.get("norm_topk_prob", False),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
    )


def _mixtral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # Mixtral: every layer MoE, experts of width intermediate_size, top-k always renormalized
    return dict(num_experts=hf.get("num_local_experts", hf.get("num_experts", 0)),
                num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
