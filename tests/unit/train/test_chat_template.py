"""task.chat_template as a template string or file: the prompt ids the trainer's encoder gives
are transformers' `apply_chat_template` on the same template, and bad values are refused at
load with the key named."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError, TaskSection, load_config
from qarl.model import load_tokenizer
from qarl.model.tokenizer import CHATML_TEMPLATE, save_byte_bpe, train_byte_bpe
from qarl.tasks import Example, make_task
from qarl.train.data import PromptEncoder

# Not ChatML: roles upper-cased, a system block, a filter, a special token inside the text.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_start|>SYS: {{ m['content'] }}\n"
    "{% else %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
EXAMPLES = [Example(prompt=" What is 1 + 2? ", answer="3"),
            Example(prompt="What is 4 + 5?", answer="9", system="Answer: a number")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    bpe = train_byte_bpe(["What is 1 + 2?", "Answer: 3", "[USER] [ASSISTANT]"] * 20, 300,
                         ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    save_byte_bpe(bpe, folder, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                  chat_template=CHATML_TEMPLATE, model_max_length=64)
    return load_tokenizer(folder)


def reference_ids(tokenizer, example: Example, template: str, system: str | None) -> list[int]:
    """transformers' own token ids of the templated prompt."""
    messages = [{"role": "user", "content": example.prompt}]
    system = example.system if example.system is not None else system
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    out = tokenizer.hf.apply_chat_template(messages, chat_template=template,
                                          add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("system", [None, "Be brief."])
@pytest.mark.parametrize("as_file", [False, True])
def test_template_string_or_file_matches_transformers(tokenizer, tmp_path, as_file, system):
    """The encoder's prompt ids equal apply_chat_template's on the same template, given as
    text or as a file, with and without a system prompt (a row's own system wins), and differ
    from the tokenizer's own template's (so the given one is the one used)."""
    value = TEMPLATE
    if as_file:
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "chat.jinja")
    section = TaskSection(name="addition", chat_template=value, system_prompt=system)
    encoder = PromptEncoder(section, tokenizer, make_task("addition"))
    own = PromptEncoder(TaskSection(name="addition", system_prompt=system), tokenizer,
                        make_task("addition"))
    for example in EXAMPLES:
        ids = encoder.template(example)
        assert ids == reference_ids(tokenizer, example, TEMPLATE, system)
        assert ids != own.template(example)


def test_true_and_false_keep_their_meaning(tokenizer):
    """true: the tokenizer's own template (ChatML here); false: the plain text, with the
    system prompt and a blank line before it."""
    own = PromptEncoder(TaskSection(name="addition"), tokenizer, make_task("addition"))
    assert own.template(EXAMPLES[0]) == reference_ids(tokenizer, EXAMPLES[0], CHATML_TEMPLATE,
                                                      None)
    plain = PromptEncoder(TaskSection(name="addition", chat_template=False,
                                      system_prompt="S"), tokenizer, make_task("addition"))
    assert plain.template(EXAMPLES[0]) == tokenizer.encode("S\n\n" + EXAMPLES[0].prompt)


def test_file_path_saved_absolute(tmp_path, monkeypatch):
    """A relative template path is made absolute on load, so the saved recipe finds it."""
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    monkeypatch.chdir(tmp_path)
    config = load_config("tiny", {"task.chat_template": "chat.jinja"})
    assert config.task.chat_template == str(tmp_path / "chat.jinja")


@pytest.mark.parametrize("value, words", [
    ("{% for m in messages %}{{ m['content'] }}", "not valid Jinja"),
    ("missing/chat.jinja", "neither a Jinja template"),
])
def test_bad_template_refused_at_load(value, words):
    """A template that does not compile, or a path to no file, is refused at load, naming
    task.chat_template and what to give instead."""
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", {"task.chat_template": value})
    message = str(caught.value)
    assert "task.chat_template" in message and words in message and "true" in message
