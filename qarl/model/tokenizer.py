"""Tokenizer: one place for encode / decode, chat templates and EOS / padding ids.

Wraps a transformers tokenizer (`.hf`) read from a local folder or the tokenizer embedded in
a `.gguf` file (`qarl.model.load_tokenizer` also takes zoo names, see sources.py). Rollout code
needs three ids from it: the tokens that end a response (`eos_token_ids`, which include the
chat end token such as `<|im_end|>`), the id used to pad (`pad_token_id`), and `vocab_size`.
"""

from __future__ import annotations

import json
from pathlib import Path

from qarl.errors import UserError

# Tokens that end an assistant turn in common chat templates; any of them that the template
# writes is an end of response too.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class Tokenizer:
    def __init__(self, hf, extra_eos_ids: list[int] | tuple[int, ...] = ()):
        self.hf = hf  # the transformers tokenizer
        self.eos_token_ids = _eos_ids(hf, extra_eos_ids)
        if not self.eos_token_ids:
            raise ValueError(
                f"tokenizer {hf.name_or_path!r} defines no end-of-sequence token; set "
                f"eos_token in its tokenizer_config.json"
            )
        self.pad_token_id = hf.pad_token_id if hf.pad_token_id is not None else self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included (the model may have more rows)."""
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as written: no BOS/EOS is added, special tokens in the text
        (chat markers from `apply_chat`) are recognised."""
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat(
        self,
        messages: str | list[dict[str, str]],
        system: str | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        template: str | None = None,
    ) -> str | list[int]:
        """The chat template applied to `messages` (a list of {"role", "content"} dicts, or one
        user prompt string), with an optional system message first; the text, or its ids
        when `tokenize`. `template` (Jinja text, as transformers reads `chat_template`) is used
        instead of the tokenizer's own."""
        if template is None and self.hf.chat_template is None:
            raise ValueError(
                f"tokenizer {self.hf.name_or_path!r} has no chat template; format the prompt "
                f"yourself and call encode(), or add chat_template to the tokenizer folder"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        text = self.hf.apply_chat_template(messages, tokenize=False, chat_template=template,
                                           add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.hf.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={self.eos_token_ids}, pad_token_id={self.pad_token_id})"
        )


def is_template_text(value: str) -> bool:
    """Whether a `task.chat_template` string is Jinja text (it has a `{{` or `{%` tag) rather
    than the path of a file that holds it."""
    return "{{" in value or "{%" in value


def read_chat_template(value: str) -> str:
    """The Jinja text of a `task.chat_template` string: the string itself, or the file it names
    (UTF-8). Raises ValueError naming the problem: a missing or unreadable file, or a
    template that does not compile (transformers' own sandboxed Jinja environment)."""
    if is_template_text(value):
        text = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a Jinja template (no '{{{{' or '{{%' tag) nor "
                             "an existing file; give the template text or the path of a file "
                             "that holds it")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read the chat template file {value!r}: {err}") from None
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as err:
        where = "" if is_template_text(value) else f" in {value!r}"
        raise ValueError(f"the chat template{where} is not valid Jinja: {err}") from None
    return text


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a HF model folder or a `.gguf` file."""
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return Tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise UserError(
            f"{path} has no tokenizer.json or tokenizer_config.json; a tokenizer folder is what "
            f"tokenizer.save_pretrained writes"
        )
    return Tokenizer(AutoTokenizer.from_pretrained(path), _config_eos_ids(path))


def _config_eos_ids(folder: Path) -> list[int]:
    """EOS ids named by the model's config.json and generation_config.json, if present."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return ids


def _eos_ids(hf, extra_eos_ids) -> list[int]:
    """Tokenizer EOS first, then config EOS ids, then chat end tokens the template writes."""
    ids = [] if hf.eos_token_id is None else [hf.eos_token_id]
    ids += list(extra_eos_ids)
    template = hf.chat_template if isinstance(hf.chat_template, str) else ""
    vocab = hf.get_vocab()
    ids += [vocab[t] for t in CHAT_END_TOKENS if t in template and t in vocab]
    return list(dict.fromkeys(ids))


# ---- training a small byte-level BPE (the zoo's `tiny` tokenizer) ------------------------

# ChatML, as Qwen and SmolLM write it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_byte_bpe(corpus: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `corpus`: the 256 byte symbols are
    always in the vocabulary, so any text encodes; digits are split one per token; the special
    tokens get ids 0, 1, ... Deterministic for a given corpus."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = RawTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    return bpe


def save_byte_bpe(bpe, folder: Path, eos_token: str, pad_token: str, chat_template: str,
                  model_max_length: int) -> None:
    """Save a trained `tokenizers.Tokenizer` as a transformers tokenizer folder."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=eos_token, pad_token=pad_token,
        chat_template=chat_template, model_max_length=model_max_length,
    )
    hf.save_pretrained(folder)
