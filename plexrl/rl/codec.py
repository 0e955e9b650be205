"""Text <-> token ids for a job, from the model folder's own tokenizer.

Prompts start with the tokenizer's `<bos>` (the tiny char tokenizer adds no special tokens on
its own); a model turn ends with the token of `TURN_END`, which is what sampling stops on.
"""

from __future__ import annotations

from transformers import AutoTokenizer

from plexrl.tasks import TURN_END


class Codec:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ids = self.encode(TURN_END)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer maps the turn end {TURN_END!r} to {ids} (expected exactly one token)")
        self.turn_end = ids[0]
        self.bos = tokenizer.bos_token_id

    @classmethod
    def from_model(cls, folder) -> "Codec":
        return cls(AutoTokenizer.from_pretrained(str(folder)))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        return ([self.bos] if self.bos is not None else []) + self.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
