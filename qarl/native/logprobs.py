"""The learner's token log-probabilities from lm_head logits in one pass per row
(`token_logp`), and their gradient (`token_logp_backward`): logprobs.c."""

from __future__ import annotations

import torch
from torch import Tensor

from qarl.native.ffi import _lib, _threads


def _logits(z: Tensor, tokens: Tensor, what: str) -> tuple[Tensor, Tensor]:
    if (z.dim() != 2 or z.dtype not in (torch.float32, torch.bfloat16) or not z.is_cpu
            or tokens.shape != z.shape[:1]):
        raise ValueError(f"{what} expects CPU float32 or bfloat16 logits [C, V] and tokens [C], "
                         f"got {z.dtype} {tuple(z.shape)} on {z.device}, {tuple(tokens.shape)}")
    z = z if z.stride(1) == 1 else z.contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < z.shape[1]:
        raise ValueError(f"{what}: a token id is outside the vocabulary [0, {z.shape[1]})")
    return z, tokens


def token_logp(z: Tensor, tokens: Tensor, temperature: float = 1.0
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Logits z [C, V] (float32 or bfloat16), tokens [C] -> (logp [C], entropy [C], logz [C])
    float32 of softmax(z.float() / temperature): the tokens' log-probabilities, the entropy of
    each row's distribution and its log-normalizer (what `token_logp_backward` takes). Equal
    to torch's log_softmax and entropy to fp32 rounding (sums in another order, exp to ~1 ulp)."""
    z, tokens = _logits(z, tokens, "token_logp")
    C, V = z.shape
    logp, entropy, logz = (torch.empty(C, dtype=torch.float32) for _ in range(3))
    _lib().qarl_token_logp(z.data_ptr(), int(z.dtype == torch.bfloat16), C, V, z.stride(0),
                           tokens.data_ptr(), float(temperature), logp.data_ptr(),
                           entropy.data_ptr(), logz.data_ptr(), _threads())
    return logp, entropy, logz


def token_logp_backward(z: Tensor, tokens: Tensor, temperature: float, logz: Tensor,
                        grad: Tensor) -> Tensor:
    """d(sum_c grad[c] logp[c]) / dz for `token_logp`'s logp: [C, V] in z's dtype,
    (grad / T) (onehot(tokens) - softmax(z / T)), computed in fp32 and rounded once."""
    z, tokens = _logits(z, tokens, "token_logp_backward")
    C, V = z.shape
    logz, grad = logz.float().contiguous(), grad.float().contiguous()
    dz = torch.empty(C, V, dtype=z.dtype)
    _lib().qarl_token_logp_backward(z.data_ptr(), int(z.dtype == torch.bfloat16), C, V,
                                    z.stride(0), tokens.data_ptr(), float(temperature),
                                    logz.data_ptr(), grad.data_ptr(), dz.data_ptr(), V,
                                    _threads())
    return dz
