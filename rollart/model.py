"""The built-in tiny models and loading of Hugging Face model folders.

Consumes a text corpus and produces a model folder written with ``save_pretrained``:
``build_tiny_model(path, corpus)`` — a word-level tokenizer + tiny Qwen2 (raw
conversations; every word of the corpus is a token) — or ``build_tiny_model(path,
corpus, chat=True)`` — the chat toy: a byte-level BPE tokenizer trained on the corpus
(``rollart.corpus.chat_corpus``), ChatML special tokens, a Qwen2.5-style chat
template with tools, ``generation_config.json`` stopping on the end-of-turn token. Loads
``(tokenizer, model)`` from any folder (``load_tokenizer``: the folder's own tokenizer,
BPE or SentencePiece; ``load_model`` in ``default_dtype`` of the device: bf16 where
supported, fp32 on CPU). Called by examples/tests/``rollart.control.loop`` to make a model
offline, and by ``rollart.rollout.engine`` and the trainer to load one.
``check_model_folder`` turns a half-downloaded or mistyped folder, or one without an
eos/end-of-turn token, into a clear ``ModelFolderError``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
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
#: the output head's Hugging Face name (a tied one is the input embedding's tensor)
HEAD = "lm_head.weight"


def ties_head(model) -> bool:
    """Whether ``model``'s output head is its input embedding (``tie_word_embeddings``):
    one tensor under two names."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and emb is not None and head.weight is emb.weight


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


# -- chat toy tokenizer ---------------------------------------------------------------
#: ChatML specials (ids 0, 1, 2): end of text (pad), start and end of a turn (eos)
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: tool-call tags: added tokens, not special, so decoded text keeps them for the parser
CHAT_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2's pre-tokenizer split, except that a word never takes the whitespace before it
# (Qwen2: ``[^\r\n\p{L}\p{N}]?\p{L}+``, so " right" is one token and "right" another).
# Here an observation's "goal 2 right" holds the very token an assistant's "right" is, as
# in the word-level toy, so copying a word of the input is the same id (through the tied
# embeddings) for a model with no pretraining, not a mapping " right" -> "right" it must
# learn first. (Alone this did not make the chat toy learn to copy:
# docs/benchmarks/chat-graph.md.) ids survive AutoTokenizer's reload (it keeps the
# folder's pre-tokenizer; tests/env/test_chat_model.py).
CHAT_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\s\p{L}\p{N}]?\p{L}+|\p{N}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user "
                  "query.\n\nYou are provided with function signatures within "
                  "<tools></tools> XML tags:\n<tools>")
TOOLS_SUFFIX = ("\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
# Our ChatML template, structured like Qwen2.5's: tools listed in the system message,
# assistant tool_calls rendered as <tool_call> blocks, consecutive tool messages grouped
# into one user turn of <tool_response> blocks. No default system prompt.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- set ns.start = 1 %}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_SUFFIX) + " + '<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- set ns.start = 1 %}{%- endif %}"
    "{%- for message in messages[ns.start:] %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: text the template adds around messages: in the BPE corpus so its merges cover it
TEMPLATE_TEXT = ("system\n", "user\n", "assistant\n", TOOLS_PREAMBLE, TOOLS_SUFFIX,
                 "\n<tool_response>\n", "\n</tool_response>", '\n<tool_call>\n{"name": "')


def build_chat_tokenizer(corpus: Iterable[str], vocab_size: int = 1024
                         ) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus`` (Qwen2's pre-tokenizer with words
    split from the space before them, ``CHAT_SPLIT``: every byte is representable, digits
    are single tokens) with ``CHAT_SPECIALS``,
    ``CHAT_TAGS`` and ``CHAT_TEMPLATE``; ``eos`` is ``<|im_end|>``."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials + merges), got "
                         f"{vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CHAT_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t for t in corpus if t]
    # the template's text is in every conversation: weigh it like the most common text
    texts = corpus + list(TEMPLATE_TEXT) * max(1, len(corpus) // 8)
    tok.train_from_iterator(sorted(texts), trainer)  # sorted: deterministic merges
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=1 << 30)


# -- tiny model -----------------------------------------------------------------------
def build_tiny_model(
    path,
    corpus: Iterable[str],
    *,
    chat: bool = False,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    vocab_size: int = 1024,
    max_positions: int | None = None,
) -> str:
    """Write a randomly initialised tiny Qwen2 + its tokenizer to ``path``; return it.

    ``chat=False``: the word-level toy (``corpus``: the tasks' words, ``task_corpus``).
    ``chat=True``: the chat toy (``corpus``: texts for BPE training, ``chat_corpus``;
    ``vocab_size`` caps its vocabulary), eos = the end-of-turn token, 2048 positions."""
    path = str(path)
    corpus = list(corpus)
    tokenizer = build_chat_tokenizer(corpus, vocab_size) if chat else build_tokenizer(corpus)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    bos = pad if chat else eos
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions or (2048 if chat else 512),
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # chat: stop on the end of a turn or the end of text, as instruct folders declare it
    model.generation_config = GenerationConfig(
        bos_token_id=bos, pad_token_id=pad, eos_token_id=[eos, pad] if chat else eos)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- loading --------------------------------------------------------------------------
ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter folder (a LoRA run's model/)


def adapter_base(path) -> str | None:
    """The base model folder of the peft adapter folder ``path`` (its
    ``adapter_config.json`` ``base_model_name_or_path``, else its ``base/``); None when
    ``path`` is a full model folder."""
    path = str(path)
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) or \
            os.path.isfile(os.path.join(path, "config.json")):
        return None
    base = _read_json(path, ADAPTER_CONFIG).get("base_model_name_or_path") or ""
    for candidate in (base, os.path.join(path, base), os.path.join(path, "base")):
        if candidate and os.path.isdir(candidate):
            return candidate
    raise ModelFolderError(
        f"adapter folder {path!r}: its base model {base!r} (adapter_config.json, "
        "base_model_name_or_path) is not a local folder: put the base model there, or "
        "set base_model_name_or_path to where it is")


def check_model_folder(path) -> None:
    """Raise ``ModelFolderError`` naming what is missing from the model folder ``path``
    (a peft adapter folder: from its base's folder, and its adapter weights)."""
    path = str(path)
    if not os.path.isdir(path):
        raise ModelFolderError(
            f"model folder {path!r} does not exist: pass a local folder written by "
            "save_pretrained (or build one with rollart.model.build_tiny_model)"
        )
    base = adapter_base(path)
    if base is not None:
        if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
            raise ModelFolderError(f"adapter folder {path!r} has no adapter_model."
                                   "safetensors: save the adapter with save_pretrained")
        check_model_folder(base)
        return
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
    if not declared_eos(path):
        raise ModelFolderError(_NO_EOS.format(path=path))


_NO_EOS = ("model folder {path!r} declares no eos / end-of-turn token (none in "
           "tokenizer_config.json, special_tokens_map.json, generation_config.json or "
           "config.json), so a generation could never stop: set the tokenizer's eos_token "
           "(e.g. '<|im_end|>' for a ChatML model) and save_pretrained, or add "
           '"eos_token_id" to generation_config.json')


def _read_json(path: str, name: str) -> dict:
    try:
        with open(os.path.join(path, name)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def declared_eos(path) -> list:
    """The eos tokens / ids the folder's files declare (tokens as str, ids as int):
    ``tokenizer_config.json`` and ``special_tokens_map.json`` first, then the eos ids of
    ``generation_config.json`` and ``config.json``."""
    path, out = str(path), []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        tok = _read_json(path, name).get("eos_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if isinstance(tok, str) and tok:
            out.append(tok)
    for name in ("generation_config.json", "config.json"):
        ids = _read_json(path, name).get("eos_token_id")
        out += [i for i in (ids if isinstance(ids, list) else [ids]) if isinstance(i, int)]
    return out


def _check_config(path: str) -> None:
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
    quant = config.get("quantization_config")
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    if method == "gguf":  # transformers refuses to save such a model: the first checkpoint would fail
        raise ModelFolderError(
            f"model folder {path!r}: config.json says quantization_config.quant_method = "
            "'gguf', and transformers refuses to save a model loaded from it, so the run's "
            "first checkpoint would fail: convert the .gguf file with `rollart model convert "
            "FILE.gguf DIR` (rollart.pretrained.convert_gguf), or delete quantization_config "
            "from config.json if the weights in the folder are plain")


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
    """Load the folder's own tokenizer (``tokenizer.json`` as written, else
    ``AutoTokenizer``: SentencePiece folders) without letting transformers re-interpret
    it. A tokenizer without an eos token takes the first eos id of the folder's
    generation/model config; with none at all, ``ModelFolderError``."""
    check_model_folder(path)
    path = str(path)
    base = adapter_base(path)
    if base and not os.path.exists(os.path.join(path, "tokenizer.json")):
        path = base  # an adapter folder saved without its tokenizer
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        ids = [i for i in declared_eos(path) if isinstance(i, int) and 0 <= i < len(tokenizer)]
        if not ids:
            raise ModelFolderError(_NO_EOS.format(path=path))
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(ids[0])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def default_dtype(device=None) -> torch.dtype:
    """bf16 on a device that supports it (CUDA with bf16), else fp32 (CPU stays fp32).

    >>> default_dtype("cpu")
    torch.float32
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_model(path, dtype: torch.dtype | None = torch.float32, device=None):
    """Load the folder's causal LM in eval mode (on ``device`` when given).
    ``dtype=None`` picks ``default_dtype(device)``. A peft adapter folder loads as its
    base with the adapter merged in (``merged_model``)."""
    check_model_folder(path)
    if adapter_base(path) is not None:
        return merged_model(path, dtype=dtype, device=device)
    dtype = default_dtype(device if device is not None else "cpu") if dtype is None else dtype
    # transformers patches process-global state while it builds a model (meta-device
    # init), so two threads loading at once — several actors on one in-process worker —
    # can leave parameters on the meta device. Serialise loads within the process.
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    if device is not None:
        model.to(device)
    model.eval()
    return model


def merged_model(path, dtype: torch.dtype | None = torch.float32, device=None):
    """The peft adapter folder ``path`` as a plain causal LM: its base (``adapter_base``)
    with the adapter merged into the weights (peft's ``merge_and_unload``)."""
    from peft import PeftModel

    model = load_model(adapter_base(path), dtype=dtype, device=device)
    model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    model.eval()
    return model


def export_merged(path, out) -> str:
    """Write the model of ``path`` (an adapter folder: merged; a model folder: as is)
    with its tokenizer as a full Hugging Face model folder ``out``."""
    model = load_model(path)
    model.save_pretrained(str(out))
    load_tokenizer(path).save_pretrained(str(out))
    return str(out)
