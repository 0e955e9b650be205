"""Tiny randomly initialised Llama models with a char-level tokenizer, built offline.

Tests and demos need a real Hugging Face causal LM that loads with `AutoModelForCausalLM` and
`AutoTokenizer` like any other, but is small enough to train on two CPU cores in seconds.
`make_tiny_model` writes one into a folder; `plexrl tiny-model FOLDER` is its command.

Invariants:
- Same arguments (seed included) -> bitwise identical weights. Initialisation draws from a
  private `torch.Generator`, so the process-wide RNG is neither read nor changed.
- The tokenizer maps every character of `ALPHABET` to exactly one token and back; decoding
  round-trips. It adds NO special tokens on encode: a caller that wants `<bos>` prepends it.
- `<pad>` is token 0 (critics read their value from token 0's logit, see backends/losses.py).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import string

import torch
import transformers
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
PUNCTUATION = "+-*/=()<>[]{}.,:;?!'\"_#%$@&^|\\~"
ALPHABET = string.digits + PUNCTUATION + " \n" + string.ascii_lowercase + string.ascii_uppercase
INIT_STD = 0.02  # Llama's initializer_range


def char_vocab() -> dict[str, int]:
    """Special tokens first (so `<pad>` is 0), then one token per character of ALPHABET."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}


def make_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """A char-level tokenizer: every character is its own word; decoding concatenates."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # would turn "1 ." into "1." and break round-trips
    )


def make_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                intermediate_size: int | None, max_position_embeddings: int) -> LlamaConfig:
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}")
    vocab = char_vocab()
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=INIT_STD,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        dtype="float32",
    )


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Llama's init (normal(0, 0.02) matrices, unit norms) drawn from a private generator.

    Parameters are visited in `named_parameters` order, which is fixed by the config, so the
    same seed gives the same bits whatever the transformers version does in its own init.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)


def make_tiny_model(folder, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, intermediate_size: int | None = None,
                    max_position_embeddings: int = 256) -> pathlib.Path:
    """Write a tiny Llama (safetensors, float32) and its char tokenizer into `folder`; return it."""
    folder = pathlib.Path(folder)
    tokenizer = make_tokenizer(max_position_embeddings)
    config = make_config(len(tokenizer), hidden_size, num_layers, num_heads,
                         intermediate_size, max_position_embeddings)
    with torch.random.fork_rng(devices=[]):  # the constructor's own init draws from the global RNG
        model = LlamaForCausalLM(config).to(torch.float32)
    init_weights(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def parameter_count(folder) -> int:
    """Number of weights stored in the folder's safetensors files (read from headers only)."""
    total = 0
    for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plexrl tiny-model",
                                     description="Write a small random Llama with a char tokenizer.")
    parser.add_argument("folder", help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="number of layers (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    args = parser.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()  # a command's output is its result line
    try:
        folder = make_tiny_model(args.folder, seed=args.seed, hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=args.heads)
    except ValueError as error:
        parser.error(str(error))
    print(f"{folder}  ({parameter_count(folder):,} parameters)")
    return 0
