"""The policy pair as the trainer (and `qarl parity`) builds it: which layers are quantized, how."""

from __future__ import annotations

import pytest
from torch import nn

from qarl.config import QuantSection
from qarl.model import load_model
from qarl.quant import SCHEMES, quant_layers
from qarl.train.policy import engine_copy, quantize_learner


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def _modes(model) -> dict[str, str]:
    return {name: layer.mode for name, layer in quant_layers(model).items()}


@pytest.mark.parametrize("align", ["naive", "fake", "kernel"])
def test_learner_matches_engine_layers_in_its_align_mode(tiny, align):
    """The engine copy quantizes the selected layers (include / exclude honoured) in kernel
    mode; the learner quantizes the same layers in its align mode, and the naive learner has
    no QuantLinear at all. The model passed in is copied, never changed, by engine_copy."""
    quant = QuantSection(scheme="w8a8-int8", align=align, exclude=["mlp"])
    engine = _modes(engine_copy(tiny, quant))
    assert quant_layers(tiny) == {}
    assert engine and not any("mlp" in name for name in engine)
    assert set(engine.values()) == {"kernel"}
    learner = _modes(quantize_learner(engine_copy(tiny, QuantSection(scheme="none")), quant))
    assert learner == ({} if align == "naive" else {name: align for name in engine})


def test_identity_scheme_leaves_both_sides_plain(tiny):
    """With the identity scheme neither side has a QuantLinear, whatever the align mode."""
    identity = next(name for name, scheme in SCHEMES.items() if scheme.is_identity)
    quant = QuantSection(scheme=identity, align="kernel")
    engine = engine_copy(tiny, quant)
    learner = quantize_learner(engine_copy(tiny, quant), quant)
    assert quant_layers(engine) == quant_layers(learner) == {}
    assert any(type(m) is nn.Linear for m in learner.modules())


def test_prompts_over_the_token_limit_are_counted_at_load(tmp_path, tiny_dir):
    """A dataset prompt whose templated tokens exceed task.max_prompt_tokens (in characters it
    passes the file check) is left out when the run's data is built and counted as a
    `too_long` bad row with its line number; a file left with no training row is refused
    naming the limit."""
    import json

    from qarl.config import load_config
    from qarl.errors import UserError
    from qarl.model import load_tokenizer
    from qarl.train.data import prompt_side

    rows = [{"prompt": f"{a} + {a} =", "answer": str(2 * a)} for a in range(60)]
    rows[5]["prompt"] = "1 + " * 200 + "1 ="  # 800 characters, ~600 tokens
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {"model.name": str(tiny_dir), "task.name": None, "task.options": {},
                 "task.dataset": str(path), "task.max_prompt_tokens": 64, "sft.steps": 0}
    config = load_config("tiny", overrides)
    task, encoder = prompt_side(config, load_tokenizer(tiny_dir))
    assert task.report.bad["too_long"] == 1 and task.report.bad_rows["too_long"] == [6]
    assert task.report.kept == 59
    drawn = task.examples("train", 200, seed=0) + task.examples("eval", 50, seed=0)
    assert all(len(ids) <= 64 for ids in encoder.encode_prompts(drawn))
    with pytest.raises(UserError, match="no usable rows left.*max_prompt_tokens = 4"):
        prompt_side(load_config("tiny", {**overrides, "task.max_prompt_tokens": 4}),
                    load_tokenizer(tiny_dir))
