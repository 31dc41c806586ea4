"""Bring your own model: a chat model folder rollart did not build trains from the CLI.

The folder is made here, the way a user's download looks: a tiny ``transformers`` Llama
saved with ``save_pretrained``, a byte-level BPE tokenizer trained here with
``tokenizers``, a Llama-3-like chat template (``<|start_header_id|>role<|end_header_id|>``
… ``<|eot_id|>``; tool results as ``ipython`` turns) and a ``generation_config.json``
whose eos list holds the end-of-turn token (the tokenizer's own eos is
``<|end_of_text|>``, as in a base Llama-3). ``rollart train graphs/chat.py --model PATH
--steps 2`` trains it (no warm-up: that is for the built-in toy) on a real in-process
cluster, and every Parquet row decodes to a well-formed conversation in that template.
"""

import json
import re
from dataclasses import replace

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rollart.buffer import read_samples
from rollart.app.cli import main
from rollart.config.graph import load_graph
from rollart.model import load_tokenizer
from rollart.runtime.resources import load_resources

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>")
# Llama-3.1-like: content trimmed, tools listed in the system turn, tool results as
# "ipython" turns, bos rendered by the template
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content | trim + '\\n\\n' }}"
    "{%- endif %}"
    "{{- 'You have access to these functions. To call one, reply with <tool_call>'"
    "    '{\"name\": ..., \"arguments\": ...}</tool_call>.\\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + messages[0].content | trim"
    "    + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role != 'system' %}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m.content | trim"
    "    + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
TEXT = ["gridnav : goal 2 right 1 up . act :", "guess : higher . left 6 8 9 7 . act :",
        "boxpush : box 2 right target 1 right . act :", "up", "down", "left", "right",
        "calc : what is 7 * 8 ? use python or answer . act :", "answer 56",
        '<tool_call>{"name": "python", "arguments": {"code": "7 * 8"}}</tool_call>',
        "system", "user", "assistant", "ipython", "You have access to these functions."]
HEADER = re.compile(r"<\|start_header_id\|>(system|user|assistant|ipython)<\|end_header_id\|>"
                    r"\n\n")


def build_llama3_folder(path) -> str:
    """A tiny Llama chat folder with its own tokenizer and template (not rollart's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.train_from_iterator(TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        chat_template=LLAMA3_TEMPLATE, clean_up_tokenization_spaces=False)
    eot, end = fast.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=fast.bos_token_id,
                         eos_token_id=[eot, end], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=fast.bos_token_id,
                                               eos_token_id=[eot, end])
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    folder = build_llama3_folder(root / "my-llama")
    run_dir = root / "run"
    res = replace(load_resources("laptop"), processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster:
        code = main(["train", "graphs/chat.py", "--model", folder, "--steps", "2",
                     "--resources", cluster.scheduler_address, "--run-dir", str(run_dir),
                     "--eval-seeds", "0", "--no-progress"])
    return code, folder, run_dir


def test_the_folder_is_not_rollarts(run):
    _, folder, _ = run
    config = json.load(open(f"{folder}/config.json"))
    assert config["model_type"] == "llama"
    tok = load_tokenizer(folder)
    assert "<|im_start|>" not in tok.get_vocab() and tok.eos_token == "<|end_of_text|>"
    # the end-of-turn token is declared only in generation_config.json
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert eot in json.load(open(f"{folder}/generation_config.json"))["eos_token_id"]


def test_trains_two_steps_without_warmup(run):
    code, _, run_dir = run
    assert code == 0
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert not (run_dir / "warmup_model").exists()  # a user's model gets no warm-up
    assert not (run_dir / "init_model").exists()  # and no toy is built
    assert load_tokenizer(run_dir / "model").chat_template == LLAMA3_TEMPLATE


def _spans(mask):
    """(start, end, value) runs of equal loss-mask values."""
    out, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            out.append((start, j, mask[start]))
            start = j
    return out


def check_row(tok, row, stops, eot, max_new):
    """Assert ``row`` is a well-formed Llama-3 conversation; return its roles."""
    prompt = tok.decode(row["prompt_ids"], skip_special_tokens=False)
    assert prompt.startswith("<|begin_of_text|>"), prompt[:80]
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    roles = HEADER.findall(prompt)
    assert roles[-2:] == ["user", "assistant"] and set(roles[:-2]) <= {"system"}
    resp, mask = row["response_ids"], row["loss_mask"]
    assert len(mask) == len(resp) and set(mask) <= {0, 1}
    spans = _spans(mask)
    assert spans and spans[0][2] == 1  # the response opens with the first generation
    for k, (a, b, m) in enumerate(spans):
        ids = resp[a:b]
        if m == 1:  # a generation: verbatim, ended by a stop id or cut at max_new_tokens
            roles.append("gen")
            cut = not any(t in stops for t in ids)
            assert ids[-1] in stops or (cut and len(ids) == max_new), (ids, max_new)
            assert not any(t in stops for t in ids[:-1])  # nothing after the stop
            continue
        # rollart's ids between generations: [<|eot_id|> when the turn was not closed by
        # it], then one env turn and the next assistant header, as the template renders
        text = tok.decode(ids, skip_special_tokens=False)
        prev = resp[spans[k - 1][1] - 1]
        closed = prev == eot
        head = "" if closed else "<|eot_id|>"
        assert text.startswith(head + "<|start_header_id|>"), (text[:80], prev)
        turns = HEADER.findall(text)
        assert turns in (["user", "assistant"], ["ipython", "assistant"]), text
        assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        roles += turns[:1]
    return roles


def test_parquet_rows_decode_to_llama3_conversations(run):
    _, folder, run_dir = run
    tok = load_tokenizer(folder)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    stops = {eot, tok.convert_tokens_to_ids("<|end_of_text|>")}
    samples = read_samples(run_dir)
    rows = [r for r in samples.to_pylist() if r["state"] == "trained"]
    assert len(rows) >= 2 * 96
    graph, _ = load_graph("chat")
    max_new = {t.name: t.max_new_tokens for t in graph.tasks}
    seen = set()
    for row in rows:
        roles = check_row(tok, row, stops, eot, max_new[row["task"]])
        assert roles.count("gen") == len([s for s in _spans(row["loss_mask"]) if s[2]])
        seen.add(row["task"])
        if row["task"] == "calc":  # the tools are declared in the system turn
            prompt = tok.decode(row["prompt_ids"], skip_special_tokens=False)
            assert '"name": "python"' in prompt
    assert seen == {"gridnav", "guess", "boxpush", "calc"}
