"""Writes tests/data/tiny_chat's tokenizer: character level, lower-cased,
55 ids (4 special tokens, a-z, 0-9, space, newline and punctuation), so
that its ids fit the tiny test models' vocabulary of 64, with a ChatML
chat template that refuses roles it does not know.

    /opt/shardd/venv/bin/python tests/data/tiny_chat/make_tokenizer.py
"""

import json
import os
import string

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.ascii_lowercase + string.digits + " \n.,?!:'-+=*/()")

TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # Every character its own word.
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(here, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "eos_token": "<|im_end|>",
        "model_max_length": 4096,
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(here, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(len(vocab), "ids")


if __name__ == "__main__":
    main()
