"""Tokenizer: EOS / pad resolution and chat handling on small hand-built tokenizers."""

from __future__ import annotations

import json

import pytest

from qarl.errors import UserError
from qarl.model import load_tokenizer
from qarl.model.tokenizer import CHATML_TEMPLATE, Tokenizer, save_byte_bpe, train_byte_bpe

CORPUS = ["What is 1 + 2?", "Answer: 3", "carry the one"] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"]


def make_folder(folder, eos, pad, chat_template=CHATML_TEMPLATE, config_eos=None):
    bpe = train_byte_bpe(CORPUS, 300, SPECIALS)
    save_byte_bpe(bpe, folder, eos_token=eos, pad_token=pad, chat_template=chat_template, model_max_length=64)
    if config_eos is not None:
        (folder / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    return folder


def test_pad_falls_back_to_eos(tmp_path):
    """Without a pad token, pad_token_id is the first EOS id."""
    tok = load_tokenizer(make_folder(tmp_path, eos="<|endoftext|>", pad=None))
    assert tok.hf.pad_token_id is None
    assert tok.pad_token_id == tok.eos_token_ids[0] == 0


def test_eos_ids_include_chat_end_token_and_config(tmp_path):
    """eos_token_ids: the tokenizer's EOS, then config.json's, then the chat end token the
    template writes (<|im_end|>), without duplicates; an unused end token (<|eot_id|>) is not one."""
    tok = load_tokenizer(make_folder(tmp_path, eos="<|endoftext|>", pad="<|endoftext|>", config_eos=[0, 3]))
    assert tok.eos_token_ids == [0, 3, 2]


def test_apply_chat_messages_and_tokenize(tmp_path):
    """apply_chat takes a message list, prepends `system`, and with tokenize gives encode(text)
    with the chat markers as single special tokens; without a template it refuses clearly."""
    tok = load_tokenizer(make_folder(tmp_path, eos="<|im_end|>", pad="<|endoftext|>"))
    messages = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    text = tok.apply_chat(messages, system="Be brief.", add_generation_prompt=False)
    assert text.count("<|im_start|>") == 3 and not text.endswith("assistant\n")
    ids = tok.apply_chat(messages, system="Be brief.", add_generation_prompt=False, tokenize=True)
    assert ids == tok.encode(text) and ids.count(1) == 3 and ids.count(2) == 3
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat("hi")


def test_no_eos_is_an_error(tmp_path):
    """A tokenizer with no EOS token anywhere is refused (generation could never stop)."""
    from transformers import AutoTokenizer

    folder = make_folder(tmp_path, eos=None, pad=None, chat_template=None)
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        Tokenizer(AutoTokenizer.from_pretrained(folder))


def test_folder_without_tokenizer_files(tmp_path):
    """A folder with no tokenizer files says what it needs (a user's error: UserError)."""
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
