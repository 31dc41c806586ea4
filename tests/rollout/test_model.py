"""rollart.model: tokenizer round trips, deterministic tiny model, folder checks."""

import os
import shutil

import pytest
import torch

from rollart.model import (
    ModelFolderError,
    build_tiny_model,
    build_tokenizer,
    check_model_folder,
    decode,
    default_dtype,
    encode,
    load_model,
    load_tokenizer,
)

CORPUS = ["gridnav : goal 3 right 1 up ; act ?", "left down , stop ."]
TEXT = "gridnav : goal 3 right 1 up ; act ?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", CORPUS, hidden_size=32)


def test_vocabulary_layout():
    tok = build_tokenizer(CORPUS)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<eos>", "<unk>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    words = sorted({w for t in CORPUS for w in t.split()} | {str(d) for d in range(10)})
    assert tok.convert_ids_to_tokens(list(range(3, len(tok)))) == words
    assert build_tokenizer(reversed(CORPUS)).get_vocab() == tok.get_vocab()


def test_token_ids_survive_save_and_reload(model_dir):
    before = build_tokenizer(CORPUS)
    after = load_tokenizer(model_dir)
    assert encode(after, TEXT) == encode(before, TEXT)
    assert encode(after, TEXT) == [before.convert_tokens_to_ids(w) for w in TEXT.split()]
    assert after.get_vocab() == before.get_vocab()
    assert after.eos_token_id == 1 and after.pad_token_id == 0


def test_decode_encode_round_trip(model_dir):
    tok = load_tokenizer(model_dir)
    for text in [TEXT, "left , down . stop", "7 7 0 ?"]:
        assert decode(tok, encode(tok, text)) == text
    assert decode(tok, encode(tok, TEXT) + [tok.eos_token_id]) == TEXT
    assert encode(tok, "zebra up") == [tok.unk_token_id, tok.convert_tokens_to_ids("up")]


def test_model_reload_is_deterministic(model_dir, tmp_path):
    model = load_model(model_dir)
    assert not model.training
    assert model.config.vocab_size == len(load_tokenizer(model_dir))
    ids = torch.tensor([encode(load_tokenizer(model_dir), TEXT)])
    with torch.no_grad():
        a = load_model(model_dir)(ids).logits
        b = model(ids).logits
    assert torch.equal(a, b)
    again = build_tiny_model(tmp_path / "again", CORPUS, hidden_size=32)
    with torch.no_grad():
        assert torch.equal(load_model(again)(ids).logits, a)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        check_model_folder(tmp_path / "nope")
    assert issubclass(ModelFolderError, ValueError)


@pytest.mark.parametrize(
    "remove, message",
    [
        (["config.json"], "config.json"),
        (["model.safetensors"], "no weights"),
        (["tokenizer.json", "tokenizer_config.json"], "no tokenizer"),
    ],
)
def test_incomplete_folder(model_dir, tmp_path, remove, message):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for name in remove:
        os.remove(broken / name)
    with pytest.raises(ModelFolderError, match=message):
        check_model_folder(broken)
    with pytest.raises(ModelFolderError, match=message):
        load_model(broken) if message != "no tokenizer" else load_tokenizer(broken)


def test_tokenizer_config_alone_is_not_enough(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    os.remove(broken / "tokenizer.json")
    with pytest.raises(ModelFolderError, match="tokenizer"):
        load_tokenizer(broken)


def test_load_model_dtype(model_dir):
    """``dtype=None`` picks the device's dtype: fp32 on CPU (bf16 only where supported)."""
    assert default_dtype("cpu") == torch.float32
    assert load_model(model_dir, dtype=None).dtype == torch.float32
    assert load_model(model_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
    model = load_model(model_dir, dtype=None, device="cpu")
    assert next(model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        assert default_dtype("cuda") == default_dtype() == torch.float32


def test_word_level_folder_keeps_its_raw_settings(model_dir):
    """The word-level toy is unchanged by the chat toy: eos <eos>, 512 positions, no
    chat template (so conversation='auto' stays raw for it)."""
    import json

    tok = load_tokenizer(model_dir)
    assert tok.eos_token == "<eos>" and not getattr(tok, "chat_template", None)
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["max_position_embeddings"] == 512
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == tok.eos_token_id
