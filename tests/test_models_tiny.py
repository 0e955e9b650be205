"""make_tiny_model: loads with the Auto classes, char tokenizer round-trips, seeded bitwise."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from plexrl.models import make_tiny_model
from plexrl.models import tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_model_loads_with_auto_class_as_float32_llama(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    assert config.num_attention_heads == 4 and config.intermediate_size == 256
    assert config.tie_word_embeddings is False
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert config.vocab_size == len(tiny.char_vocab())
    assert model.num_parameters() == tiny.parameter_count(folder)


TEXT_CASES = {
    "addition prompt": "12+7=",
    "empty": "",
    "every character": tiny.ALPHABET,
    "spaces around punctuation": "a , b . c ? ( 1 )",
    "newlines and quotes": "x = 'a'\n\"b\"\n",
    "backslash and tilde": "\\~\\",
}


@pytest.mark.parametrize("text", TEXT_CASES.values(), ids=TEXT_CASES.keys())
def test_one_token_per_character_and_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == [tiny.char_vocab()[c] for c in text]  # also: no <bos>/<eos> added implicitly
    assert tokenizer.decode(ids) == text


def test_special_tokens_have_fixed_ids(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([1, *tokenizer.encode("7"), 2], skip_special_tokens=True) == "7"


def test_unknown_character_maps_to_unk(tokenizer):
    assert tokenizer.encode("é") == [tokenizer.unk_token_id]


def test_same_seed_gives_bitwise_identical_weights(folder, tmp_path):
    again = weights(make_tiny_model(tmp_path / "again", seed=0))
    first = weights(folder)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_other_seed_gives_other_weights(folder, tmp_path):
    other = weights(make_tiny_model(tmp_path / "other", seed=1))
    first = weights(folder)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_making_a_model_leaves_the_global_rng_alone(tmp_path):
    before = torch.get_rng_state()
    make_tiny_model(tmp_path / "m", seed=3)
    assert torch.equal(before, torch.get_rng_state())


def test_init_is_llama_style(folder):
    state = weights(folder)
    assert torch.equal(state["model.norm.weight"], torch.ones(64))
    std = state["model.embed_tokens.weight"].std().item()
    assert abs(std - tiny.INIT_STD) < 0.003, f"embedding std {std} should be close to {tiny.INIT_STD}"


def test_cli_writes_model_and_prints_folder_and_count(tmp_path, capsys):
    target = tmp_path / "cli"
    assert tiny.main([str(target), "--seed", "2", "--hidden", "32", "--layers", "1", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert str(target) in out and f"{tiny.parameter_count(target):,} parameters" in out
    assert AutoModelForCausalLM.from_pretrained(target).config.hidden_size == 32


def test_cli_rejects_heads_not_dividing_hidden(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tiny.main([str(tmp_path / "bad"), "--hidden", "30", "--heads", "4"])
    assert "hidden_size=30 must be a multiple of num_heads=4" in capsys.readouterr().err
