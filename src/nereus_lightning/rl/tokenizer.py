"""A byte-level tokenizer for the embedded default: 256 byte ids plus pad, bos and eos; no downloads."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from nereus_lightning.spec.errors import NereusConfigError, require


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; specials ``pad = 256``, ``bos = 257``, ``eos = 258``.

    ``vocab_size`` is rounded up to a multiple of ``pad_vocab_to`` (default 8, so 264) so that the
    embedding and LM head split evenly under tensor parallelism; the ids above ``eos`` are unused.
    The call signature mirrors the transformers tokenizers where the RL code needs it.
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    num_byte_tokens = 256

    def __init__(self, pad_vocab_to: int = 8) -> None:
        require(pad_vocab_to >= 1, "tokenizer.pad_vocab_to", f"must be >= 1, got {pad_vocab_to}")
        needed = self.eos_token_id + 1
        self.vocab_size = -(-needed // pad_vocab_to) * pad_vocab_to

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes), optionally framed by bos / eos."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def decode(
        self, ids: Sequence[int] | Tensor, skip_special_tokens: bool = True, stop_at_eos: bool = True
    ) -> str:
        """Text of ``ids``: stops at the first eos (unless told not to) and drops special ids."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        out = bytearray()
        for token in ids:
            token = int(token)
            if token == self.eos_token_id and stop_at_eos:
                break
            if token < self.num_byte_tokens:
                out.append(token)
            elif not skip_special_tokens:
                out.extend(self._special_text(token).encode())
        return out.decode("utf-8", errors="replace")

    def batch_decode(self, rows: Sequence[Sequence[int]] | Tensor, **kwargs: bool) -> list[str]:
        """:meth:`decode` of every row."""
        return [self.decode(row, **kwargs) for row in rows]

    def pad(
        self, sequences: Sequence[Sequence[int]], side: str = "left", length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Stack id lists into ``(input_ids, attention_mask)`` padded on ``side`` ("left" for generation)."""
        return pad_ids(sequences, self.pad_token_id, side, length)

    def __call__(
        self, texts: str | Sequence[str], padding_side: str = "left", add_bos: bool = True
    ) -> dict[str, Tensor]:
        """Encode and pad a batch: ``{"input_ids", "attention_mask"}`` (prompts start with bos by default)."""
        if isinstance(texts, str):
            texts = [texts]
        ids, mask = self.pad([self.encode(t, add_bos=add_bos) for t in texts], side=padding_side)
        return {"input_ids": ids, "attention_mask": mask}

    def _special_text(self, token: int) -> str:
        names = {self.pad_token_id: "<pad>", self.bos_token_id: "<bos>", self.eos_token_id: "<eos>"}
        return names.get(token, f"<unused{token}>")


def pad_ids(
    sequences: Sequence[Sequence[int]], pad_id: int, side: str = "left", length: int | None = None
) -> tuple[Tensor, Tensor]:
    """Stack id lists into ``(input_ids, attention_mask)`` of width ``length`` (default: the longest),
    padded with ``pad_id`` on ``side`` ("left" for prompts to generate from, "right" for responses)."""
    if side not in ("left", "right"):
        raise NereusConfigError(f"padding_side: {side!r} is not one of 'left', 'right'")
    longest = max((len(s) for s in sequences), default=0)
    width = longest if length is None else length
    require(width >= longest, "length", f"{width} is shorter than the longest sequence ({longest})")
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if not seq:
            continue
        span = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, span] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, span] = 1
    return ids, mask
