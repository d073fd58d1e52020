"""rollout.engine = 'vllm' is refused at config load, before any work, where it cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qarl.config import ConfigError, load_config

_SPEC = importlib.util.find_spec("vllm")
HAS_VLLM = _SPEC is not None and _SPEC.origin is not None


def problems(base_toml, write_recipe, *overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe(base_toml), ["--rollout.engine=vllm", *overrides])
    return {p.path: str(p) for p in caught.value.problems}


def test_kernel_align_is_refused(base_toml, write_recipe):
    """The learner cannot run vLLM's kernels: align 'kernel' is refused, naming 'fake'."""
    found = problems(base_toml, write_recipe, "--quant.align=kernel")
    assert "use 'fake'" in found["quant.align"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU rule")
def test_gpu_only_scheme_is_refused_on_cpu(base_toml, write_recipe):
    """FP8 is served by vLLM only with CUDA: refused on CPU, naming what runs here."""
    found = problems(base_toml, write_recipe, "--quant.align=fake", "--quant.scheme=w8a8-fp8")
    assert "not served by rollout.engine = 'vllm' on this machine" in found["quant.scheme"]
    assert "none, w8a8-int8" in found["quant.scheme"]


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_missing_vllm_is_refused(base_toml, write_recipe):
    """Without the vllm package the recipe fails at load with the install command."""
    found = problems(base_toml, write_recipe, "--quant.align=fake")
    assert "pip install 'qarl[vllm]'" in found["rollout.engine"]
    assert "make test-vllm" in found["rollout.engine"]


@pytest.mark.skipif(not HAS_VLLM, reason="needs vllm")
def test_vllm_recipe_is_valid(base_toml, write_recipe):
    """With vllm installed, fake + w8a8-int8 loads."""
    config = load_config(write_recipe(base_toml), ["--rollout.engine=vllm", "--quant.align=fake",
                                                   "--quant.scheme=w8a8-int8"])
    assert config.rollout.engine == "vllm"


def test_moe_model_is_refused(base_toml, write_recipe):
    """A mixture-of-experts model with vLLM is refused at load, naming the model and 'local'
    (qarl cannot sync weights into vLLM's fused expert layers); the dense model is not."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe(base_toml), ["--rollout.engine=vllm", "--quant.align=fake",
                                              "--model.name=tiny-moe"])
    moe = [str(p) for p in caught.value.problems if "mixture-of-experts" in str(p)]
    assert len(moe) == 1 and "'tiny-moe'" in moe[0] and "rollout.engine = 'local'" in moe[0]
    dense = problems(base_toml, write_recipe, "--quant.align=fake") if not HAS_VLLM else {}
    assert not any("mixture-of-experts" in text for text in dense.values())


def test_float32_int8_is_refused_on_an_amx_cpu(base_toml, write_recipe, monkeypatch):
    """On an x86 CPU with AMX (probed as vLLM probes it) vLLM's int8 kernel takes only 16-bit
    activations: vllm_dtype = 'float32' with w8a8-int8 is refused at load, naming AMX and the
    alternatives; 'auto' and 'bfloat16' are not refused, nor float32 with scheme 'none'."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr("qarl.rollout.vllm_support.is_x86", lambda: True)
    found = problems(base_toml, write_recipe, "--quant.align=fake", "--rollout.vllm_dtype=float32")
    text = found["rollout.vllm_dtype"]
    assert "AMX" in text and "'auto' or 'bfloat16'" in text and "rollout.engine = 'local'" in text
    for ok in (["--rollout.vllm_dtype=auto"], ["--rollout.vllm_dtype=bfloat16"],
               ["--rollout.vllm_dtype=float32", "--quant.scheme=none"]):
        found = problems(base_toml, write_recipe, "--quant.align=fake", *ok) if not HAS_VLLM else {}
        assert "rollout.vllm_dtype" not in found, ok
