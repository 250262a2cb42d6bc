"""A user's model folder in miniature: a tiny random-weight model saved with ``save_pretrained`` beside a
tokenizer trained on the spot (the ``tokenizers`` library) with a ChatML chat template, no downloads."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``: ChatML, eos ``<|im_end|>``, pad ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model_folder(
    path: str | os.PathLike,
    texts: Iterable[str],
    family: str = "qwen2",
    vocab_size: int = 300,
    seed: int = 0,
    **config: Any,
) -> str:
    """Save a tiny ``family`` causal LM (:func:`~nereus_lightning.testing.tiny.tiny_model`, weights from
    ``seed``) and a tokenizer of ``texts`` into ``path``.

    The model's vocabulary is the tokenizer's size, as in a real checkpoint.
    """
    from nereus_lightning.testing.tiny import tiny_model

    tokenizer = train_tokenizer(texts, vocab_size)
    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **config,
    }
    model: Any = tiny_model(  # a transformers PreTrainedModel (save_pretrained)
        family,
        seed,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        attn_implementation=None,  # (a saved folder keeps transformers' default)
        **shape,
    )
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return os.fspath(path)
