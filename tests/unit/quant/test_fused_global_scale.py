"""NVFP4's global scale is shared by each fused group (q/k/v, gate/up), as vLLM decodes it."""

from __future__ import annotations

import copy
import warnings

import torch

from qarl.model import CausalLM, ModelConfig
from qarl.quant import SCHEMES, export_state, quant_layers, quantize_model
from qarl.quant import numerics as nm

CONFIG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(CONFIG).eval()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.normal_(0, 0.05 * (1 + i % 3))  # layers of different max|w|
    return model


def _members(model, layer: int, group) -> list:
    block = model.model.layers[layer]
    parent = block.self_attn if group[0] == "q_proj" else block.mlp
    return [getattr(parent, m) for m in group]


def test_fused_groups_share_the_largest_members_global_scale():
    """w4a16-nvfp4: every layer of a q/k/v or gate/up group holds the global scale
    448 * 6 / (max over the group of max|w|) (torch.equal across the group); the member with
    the largest max|w| gets exactly the codes of quantizing it alone, the others the codes of
    nvfp4 with the group's amax; o_proj / down_proj keep their own scale."""
    model = quantize_model(_model(), "w4a16-nvfp4", mode="fake")
    for layer in range(CONFIG.num_layers):
        for group in GROUPS:
            members = _members(model, layer, group)
            amaxes = [m.weight.detach().abs().amax() for m in members]
            top = max(range(len(members)), key=lambda i: float(amaxes[i]))
            assert len({float(a) for a in amaxes}) > 1  # the test would prove nothing otherwise
            qws = [m.qweight() for m in members]
            want = (nm.FP8_MAX * nm.FP4_MAX) / torch.stack(amaxes).amax()  # as nm.nvfp4 computes it
            for m, qw in zip(members, qws):
                assert torch.equal(qw.global_scale, want)
                codes, scales, _ = nm.nvfp4(m.weight.detach(), amax=torch.stack(amaxes).amax())
                assert torch.equal(qw.codes, nm.pack_nibbles(codes)) and torch.equal(qw.scales, scales)
            alone = SCHEMES["w4a16-nvfp4"].quantize(members[top].weight.detach())
            assert torch.equal(qws[top].codes, alone.codes) and torch.equal(qws[top].scales, alone.scales)
        o = model.model.layers[layer].self_attn.o_proj
        assert torch.equal(o.qweight().global_scale,
                           SCHEMES["w4a16-nvfp4"].quantize(o.weight.detach()).global_scale)


def test_a_peers_update_requantizes_the_group():
    """Changing only k_proj's master weight (here: making it the group's largest) changes the
    global scale q_proj quantizes with on its next qweight(): a layer's codes follow its
    peers' weights, not only its own."""
    model = quantize_model(_model(), "w4a16-nvfp4", mode="fake")
    q, k, _ = _members(model, 0, GROUPS[0])
    before = q.qweight().global_scale.clone()
    with torch.no_grad():
        k.weight[0, 0] = 10 * float(k.weight.abs().max() + q.weight.abs().max())
    after = q.qweight().global_scale
    assert torch.equal(after, k.qweight().global_scale) and not torch.equal(after, before)


def test_other_schemes_and_the_state_dict_are_unchanged():
    """Row-scaled schemes ignore the peers (w8a8-int8 codes equal quantizing each layer
    alone); the peers are not submodules (state_dict keys and named_modules are those of the
    plain model); a deepcopy's peers are the copy's own layers."""
    plain = _model()
    model = quantize_model(copy.deepcopy(plain), "w8a8-int8")
    assert list(model.state_dict()) == list(plain.state_dict())
    assert len(list(model.named_modules())) == len(list(plain.named_modules()))
    for name, layer in quant_layers(model).items():
        assert torch.equal(layer.qweight().codes,
                           SCHEMES["w8a8-int8"].quantize(layer.weight.detach()).codes), name
    clone = copy.deepcopy(model)
    q = clone.model.layers[0].self_attn.q_proj
    assert q.fused_peers == (clone.model.layers[0].self_attn.k_proj,
                             clone.model.layers[0].self_attn.v_proj)


def test_an_engine_copy_receives_the_shared_codes_without_a_split_warning():
    """export_state of an NVFP4 learner: no fused group has two global scales (the export
    check stays silent), and an engine copy that installs the state decodes with exactly the
    learner's QWeights."""
    from qarl.export.run import warn_split_global_scales
    from qarl.quant import load_state

    learner = quantize_model(_model(), "w4a16-nvfp4", mode="fake")
    engine = quantize_model(_model(seed=1), "w4a16-nvfp4", mode="kernel")
    state = export_state(learner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_split_global_scales(state)
    load_state(engine, state)
    for name, layer in quant_layers(engine).items():
        assert torch.equal(layer.qweight().global_scale, state[f"{name}.weight"].global_scale)
        assert torch.equal(layer.qweight().codes, state[f"{name}.weight"].codes)
