"""The built-in tiny model and loading of Hugging Face model folders.

Consumes a text corpus (to build a word-level tokenizer + tiny Qwen2) or a model folder
on disk; produces a folder written with ``save_pretrained`` and loaded ``(tokenizer,
model)`` pairs. Called by examples/tests to make a model offline, and by
``rollart.rollout.engine`` and the trainer to load one. ``check_model_folder`` turns a
half-downloaded or mistyped folder into a clear ``ModelFolderError``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2
_WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
_VOCAB_FILES = ("vocab.json", "vocab.txt", "tokenizer.model", "merges.txt")


_LOAD_LOCK = threading.Lock()


class ModelFolderError(ValueError):
    """A model folder is missing something needed to load it."""


# -- tokenizer ------------------------------------------------------------------------
def build_tokenizer(corpus: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: specials, then the corpus' words (sorted), plus digits."""
    words: set[str] = {str(d) for d in range(10)}
    for text in corpus:
        words.update(text.split())
    words.difference_update(SPECIAL_TOKENS)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in sorted(words):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder: `tokenizers` then joins tokens with single spaces, and no clean-up
    # pass may glue punctuation back on (that would break decode(encode(x)) == x).
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer, ids: Iterable[int]) -> str:
    """Text of ``ids``, special tokens skipped."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


# -- tiny model -----------------------------------------------------------------------
def build_tiny_model(
    path,
    corpus: Iterable[str],
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> str:
    """Write a randomly initialised tiny Qwen2 + its tokenizer to ``path``; return it."""
    path = str(path)
    tokenizer = build_tokenizer(corpus)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- loading --------------------------------------------------------------------------
def check_model_folder(path) -> None:
    """Raise ``ModelFolderError`` naming what is missing from the model folder ``path``."""
    path = str(path)
    if not os.path.isdir(path):
        raise ModelFolderError(
            f"model folder {path!r} does not exist: pass a local folder written by "
            "save_pretrained (or build one with rollart.model.build_tiny_model)"
        )
    names = set(os.listdir(path))
    if "config.json" not in names:
        raise ModelFolderError(
            f"model folder {path!r} has no config.json: it is not a Hugging Face model "
            "folder, or the download is incomplete"
        )
    has_weights = any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                      for n in names) or any(n in names for n in _WEIGHT_FILES)
    if not has_weights:
        raise ModelFolderError(
            f"model folder {path!r} has no weights (*.safetensors, "
            "*.safetensors.index.json or pytorch_model.bin): finish the download or "
            "save the model with save_pretrained"
        )
    _check_config(path)
    _check_safetensors(path, names)
    has_tokenizer = "tokenizer.json" in names or (
        "tokenizer_config.json" in names and any(n in names for n in _VOCAB_FILES)
    )
    if not has_tokenizer:
        raise ModelFolderError(
            f"model folder {path!r} has no tokenizer (tokenizer.json, or "
            "tokenizer_config.json with a vocabulary file): save the tokenizer into the "
            "folder with tokenizer.save_pretrained"
        )


def _check_config(path: str) -> None:
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"model folder {path!r}: config.json is not valid JSON ({e}); "
                               "re-download it or save the model again") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelFolderError(f"model folder {path!r}: config.json has no model_type; it is "
                               "not a transformers model config (save it with "
                               "save_pretrained)")


def _check_safetensors(path: str, names: set) -> None:
    """Read each weight file's header (cheap): a truncated download fails here, not
    inside an actor after the cluster started."""
    from safetensors import safe_open

    for name in sorted(n for n in names if n.endswith(".safetensors")):
        try:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                f.keys()
        except Exception as e:
            raise ModelFolderError(
                f"model folder {path!r}: {name} is unreadable ({type(e).__name__}: {e}); "
                "the download is incomplete or the file is corrupt: fetch it again") from None


def load_tokenizer(path):
    """Load the folder's tokenizer without letting transformers re-interpret it."""
    check_model_folder(path)
    path = str(path)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        tokenizer.add_special_tokens({"eos_token": "<eos>"})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path, dtype: torch.dtype = torch.float32):
    """Load the folder's causal LM in eval mode."""
    check_model_folder(path)
    # transformers patches process-global state while it builds a model (meta-device
    # init), so two threads loading at once — several actors on one in-process worker —
    # can leave parameters on the meta device. Serialise loads within the process.
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model
