"""qarl's QWeights in compressed-tensors' layout: names, dtypes, shapes, the packing order
against hand-computed words, the config block, and a bit-exact round trip for every format.
None of this needs the compressed-tensors package (tests/vllm_engine checks against its code)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from qarl.export import ct_layer_tensors, ct_state, quantization_config, read_ct
from qarl.export.compressed_tensors import pack_int4_to_int32, unpack_int4_from_int32
from qarl.quant import QWeight, make_scheme

FORMATS = ["w8a8-int8", "w8a8-fp8", "w8a8-fp8-block", "w4a16-int4", "w4a8-int", "w4a16-nvfp4"]


def _weight(n=160, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _same(a: QWeight, b: QWeight) -> bool:
    fields = ("codes", "scales", "zeros", "global_scale")
    tensors_equal = all(
        (getattr(a, f) is None and getattr(b, f) is None)
        or (getattr(a, f) is not None and getattr(b, f) is not None
            and getattr(a, f).dtype == getattr(b, f).dtype
            and getattr(a, f).shape == getattr(b, f).shape
            and torch.equal(getattr(a, f).reshape(-1).view(torch.uint8),
                            getattr(b, f).reshape(-1).view(torch.uint8)))
        for f in fields)
    return tensors_equal and (a.scheme, a.shape, a.group_size, a.symmetric) == (
        b.scheme, b.shape, b.group_size, b.symmetric)


def test_int4_packing_matches_hand_computed_words():
    """compressed-tensors' pack_to_int32: q + 8 as nibbles, element 8j + i in bits 4i..4i+3
    of word j, the word read as a signed int32."""
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 7, -1], [7, 7, 7, 7, 7, 7, 7, 7]])
    u = (q + 8).to(torch.uint8)
    expected0 = 0x7FBA9810  # nibbles 0, 1, 8, 9, 10, 11, 15, 7 from bit 0 up
    expected1 = sum(15 << (4 * i) for i in range(8)) - 2**32  # 0xFFFFFFFF -> -1
    packed = pack_int4_to_int32(u)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert packed.flatten().tolist() == [expected0, expected1]
    assert torch.equal(unpack_int4_from_int32(packed), u)


@pytest.mark.parametrize("scheme, expected", [
    ("w8a8-int8", {"weight": (torch.int8, (160, 256)), "weight_scale": (torch.float32, (160, 1))}),
    ("w8a8-fp8", {"weight": (torch.float8_e4m3fn, (160, 256)),
                  "weight_scale": (torch.float32, (160, 1))}),
    ("w8a8-fp8-block", {"weight": (torch.float8_e4m3fn, (160, 256)),
                        "weight_scale": (torch.float32, (2, 2))}),
    ("w4a16-int4", {"weight_packed": (torch.int32, (160, 32)),
                    "weight_scale": (torch.bfloat16, (160, 4)),
                    "weight_shape": (torch.int64, (2,))}),
    ("w4a8-int", {"weight": (torch.int8, (160, 256)), "weight_scale": (torch.bfloat16, (160, 4))}),
    ("w4a16-nvfp4", {"weight_packed": (torch.uint8, (160, 128)),
                     "weight_scale": (torch.float8_e4m3fn, (160, 16)),
                     "weight_global_scale": (torch.float32, (1,))}),
])
def test_layer_tensor_names_dtypes_shapes(scheme, expected):
    """Each format's leaves have vLLM's names, dtypes and shapes (N=160 makes a ragged FP8
    block row; int4 groups of 64)."""
    qw = make_scheme(scheme).quantize(_weight())
    out = ct_layer_tensors(qw)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in out.items()} == expected


def test_layer_values_are_qarls_codes_and_scales():
    """The tensors hold qarl's codes and scales: int8 codes as they are, int4 as q = u - 8
    (w4a8) and packed words (w4a16), the NVFP4 bytes and global scale unchanged."""
    w = _weight()
    int8 = make_scheme("w8a8-int8").quantize(w)
    t = ct_layer_tensors(int8)
    assert torch.equal(t["weight"], int8.codes) and torch.equal(t["weight_scale"][:, 0], int8.scales)
    w4a8 = make_scheme("w4a8-int").quantize(w)
    u = torch.stack([w4a8.codes & 15, w4a8.codes >> 4], -1).reshape(160, 256)
    assert torch.equal(ct_layer_tensors(w4a8)["weight"], u.to(torch.int8) - 8)
    int4 = ct_layer_tensors(make_scheme("w4a16-int4").quantize(w))
    assert torch.equal(unpack_int4_from_int32(int4["weight_packed"]), u)  # same codes as w4a8
    assert int4["weight_shape"].tolist() == [160, 256]
    fp4 = make_scheme("w4a16-nvfp4").quantize(w)
    t = ct_layer_tensors(fp4)
    assert torch.equal(t["weight_packed"], fp4.codes)
    assert t["weight_global_scale"].item() == fp4.global_scale.item()
    assert fp4.global_scale == torch.tensor(448.0 * 6) / w.abs().max()  # g = 448 * 6 / max|w|


def test_asymmetric_int4_is_refused_with_the_alternative():
    """qarl's float zero point has no compressed-tensors form: a ValueError that says why and
    names symmetric=true and --format hf."""
    for scheme in ("w4a16-int4", "w4a8-int"):
        qw = make_scheme(scheme, symmetric=False).quantize(_weight())
        with pytest.raises(ValueError, match="integer zero points.*symmetric = true.*--format hf"):
            ct_layer_tensors(qw)


def _state(schemes: dict[str, str]) -> dict:
    """A small export_state-like dict: two layers' QWeights, a norm, a tied lm_head."""
    emb = _weight(256, 128, seed=9)
    state = {"model.embed_tokens.weight": emb}
    for i, (name, scheme) in enumerate(schemes.items()):
        state[f"{name}.weight"] = make_scheme(scheme).quantize(_weight(128, 128, seed=i))
    state["model.norm.weight"] = torch.ones(128)
    state["model.layers.0.mlp.down_proj.weight"] = _weight(128, 128, seed=5)
    state["lm_head.weight"] = emb
    return state


def test_config_block_lists_targets_ignore_and_one_group_per_scheme():
    """Targets are exactly the quantized modules, grouped per scheme; every other linear layer
    (lm_head included, the embedding and norms not) is ignored; mixed formats say so."""
    state = _state({"model.layers.0.self_attn.q_proj": "w8a8-int8",
                    "model.layers.0.self_attn.k_proj": "w8a8-int8",
                    "model.layers.0.mlp.up_proj": "w4a16-int4"})
    config = quantization_config(state)
    groups = list(config["config_groups"].values())
    assert [g["targets"] for g in groups] == [
        ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"],
        ["model.layers.0.mlp.up_proj"]]
    assert groups[0]["weights"] == {"num_bits": 8, "type": "int", "symmetric": True,
                                    "strategy": "channel", "dynamic": False}
    assert groups[0]["input_activations"]["strategy"] == "token"
    assert groups[0]["input_activations"]["dynamic"] is True
    assert groups[1]["weights"]["group_size"] == 64 and groups[1]["format"] == "pack-quantized"
    assert config["ignore"] == ["model.layers.0.mlp.down_proj", "lm_head"]
    assert (config["format"], config["quant_method"], config["quantization_status"]) == (
        "mixed-precision", "compressed-tensors", "compressed")
    flat = ct_state(state)
    assert "lm_head.weight" in flat and "model.layers.0.mlp.up_proj.weight_packed" in flat


def test_a_state_without_quantized_layers_is_refused():
    """Nothing quantized -> no compressed-tensors folder; the error names --format hf."""
    with pytest.raises(ValueError, match="--format hf"):
        quantization_config({"model.norm.weight": torch.ones(4)})


@pytest.mark.parametrize("scheme", FORMATS)
def test_round_trip_is_bit_exact(scheme, tmp_path):
    """ct_state + quantization_config written to a folder, read back by read_ct: every QWeight
    (codes, scales, global scale, layout) and every tensor bit for bit."""
    state = _state({"model.layers.0.self_attn.q_proj": scheme,
                    "model.layers.1.self_attn.q_proj": scheme})
    flat = ct_state(state)
    flat["lm_head.weight"] = flat["lm_head.weight"].clone()  # safetensors stores no shared memory
    save_file(flat, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config(state)}))
    back = read_ct(tmp_path)
    assert back.keys() == state.keys()
    for name, value in state.items():
        if isinstance(value, QWeight):
            assert _same(back[name], value), name
        else:
            assert torch.equal(back[name], value), name
