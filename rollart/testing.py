"""Builders for tests: rollart's own, and yours when you test a task, env or reward.

Consumes nothing but arguments; produces the pieces tests of the rollout stages set up
again and again, each built for real (no mocks):

* ``tagged_cluster``: an in-process Dask cluster, one worker per resource tag (the tags
  of ``rollart.types``), and a client to it;
* ``unique_key``: a Dask key of a test's own for an actor it submits (a module's tests
  share a cluster, and a key reused by another test can hand back that test's actor,
  closed);
* ``ProxyHost``: an actor holding an ``LLMProxy`` where an env manager would;
* ``bpe_tokenizer``, ``tiny_qwen2`` and ``save_folder``: a chat model folder not built by
  rollart (a byte-level BPE tokenizer with a real ChatML template, ``CHATML``, and a tiny
  Qwen2), for the conversation and engine tests;
* ``check_run_record``: a finished run's ledger checked against records it does not
  keep (the trainer's own report of each batch, the Parquet rows on disk);
* ``cluster_fixture``, ``trajectory``, ``tiny_graph``, ``BigGridEnv`` and
  ``big_grid_task``: the pytest client fixture, the record, the graph, and the tagged env
  and its task that test modules used to write out each for themselves;
* ``write_tiny_gguf`` (with ``tiny_llama`` and ``SMOLLM_TEMPLATE``): a tiny Llama chat
  model written as a GGUF file the way llama.cpp lays one out, with SmolLM2's template,
  for ``rollart.pretrained``'s conversion and the real-model graph's tests.

Called by the files under ``tests/`` (and a few benchmarks). In the import layers
(``setup.cfg``) it sits at the top: nothing in rollart imports it, and it may import
any package; ``tokenizers``, ``transformers`` and ``torch`` load when a chat builder
runs, ``pytest`` when a fixture is made.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from distributed import Client, Scheduler, SpecCluster, Worker

from rollart.env.builtin.gridnav import GridNavEnv
from rollart.policy.affinity import env_affinity

__all__ = ["ADD_TOOL", "BIG", "BigGridEnv", "CHATML", "CHATML_SPECIALS", "CHAT_CORPUS",
           "ProxyHost", "SMOLLM_TEMPLATE", "big_grid_task", "bpe_tokenizer",
           "check_run_record", "cluster_fixture", "json_model", "save_folder",
           "tagged_cluster", "tiny_graph", "tiny_llama", "tiny_qwen2", "trajectory",
           "unique_key", "write_tiny_gguf"]


# -- Dask --------------------------------------------------------------------------------
def unique_key(prefix: str) -> str:
    """A Dask key no other test uses: ``prefix`` (what it is, for the logs) and a uuid4.

    >>> unique_key("buf").startswith("buf-"), unique_key("buf") != unique_key("buf")
    (True, True)
    """
    return f"{prefix}-{uuid.uuid4().hex}"


@contextmanager
def tagged_cluster(*tags: str, threads: int = 1, protocol: str = "inproc://"
                   ) -> Iterator[Client]:
    """A client to a real Dask cluster in this process with one worker per tag in
    ``tags`` (worker resources ``{tag: 1}``, named by its tag), or one untagged worker
    when none is given; ``threads`` threads each. ``protocol``: ``"inproc://"`` (objects
    stay in memory), or ``"tcp"`` / ``"ucxx"`` on 127.0.0.1 where a test needs the bytes
    to travel (PD's KV transfer). Closed on exit.

    >>> from rollart.runtime.resources import workers_with
    >>> from rollart.types import CPU_ENV, H20
    >>> with tagged_cluster(H20, CPU_ENV) as client:
    ...     on_env = workers_with(client, CPU_ENV)
    ...     client.submit(sum, [1, 2], resources={CPU_ENV: 1}).result(), len(on_env)
    (3, 1)
    """
    where = {} if protocol.startswith("inproc") else {"host": "127.0.0.1"}
    worker = {"nthreads": threads, "protocol": protocol, "dashboard": False, **where}
    spec = {tag: {"cls": Worker, "options": {**worker, "resources": {tag: 1}}}
            for tag in tags} or {"untagged": {"cls": Worker, "options": worker}}
    scheduler = {"cls": Scheduler,
                 "options": {"protocol": protocol, "dashboard": False, **where}}
    with SpecCluster(workers=spec, scheduler=scheduler) as cluster, Client(cluster) as c:
        yield c


def cluster_fixture(*tags: str, scope: str = "module", threads: int = 1):
    """A pytest fixture ``client``: a client of ``tagged_cluster(*tags, threads=threads)``
    kept for ``scope``. In a test module: ``client = cluster_fixture(H800)``."""
    import pytest

    @pytest.fixture(scope=scope)
    def client():
        with tagged_cluster(*tags, threads=threads) as c:
            yield c

    return client


class ProxyHost:
    """Stands in for an env manager: holds an ``LLMProxy`` (unpickled on its worker, as
    a manager's is) and calls it. Submit it as an actor on the env pool's tag::

        host = client.submit(ProxyHost, LLMProxy(workers), actor=True,
                             resources={CPU_ENV: 1}).result()
        host.generate("traj-1", req, task="pd").result()
    """

    def __init__(self, proxy):
        self.proxy = proxy

    async def generate(self, traj_id, req, task=None, pools=None):
        """One turn of ``traj_id`` (routed by ``task``'s affinity, or to ``pools``)."""
        return await self.proxy.generate(traj_id, req, pools, task=task)

    async def concurrent(self, items):
        """``generate`` for each ``(traj_id, req)`` in ``items`` at once."""
        return await asyncio.gather(*[self.proxy.generate(t, r) for t, r in items])

    async def release(self, traj_id):
        self.proxy.release(traj_id)

    async def stats(self):
        return self.proxy.stats()


# -- a chat model folder not built by rollart -------------------------------------------
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: Qwen2.5-like ChatML: tools in the system turn, tool results wrapped in a user turn
CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

#: the text ``bpe_tokenizer`` learns its merges from: games, tags, tool calls, digits
CHAT_CORPUS = ["go left right up down <think> </think> <answer> </answer> <tool_call> "
               "</tool_call> {\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}} user "
               "assistant system tool tools Tools function the number is 0 1 2 3 4 5 6 7 8 9 "
               "guess higher lower pick act left . : ? you play a game"] * 20

#: an OpenAI-style tool: ``add(a, b)``
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def bpe_tokenizer(specials: Sequence[str] = tuple(CHATML_SPECIALS), template: str | None = None,
                  eos: str | None = None, pad: str | None = None,
                  corpus: Sequence[str] = tuple(CHAT_CORPUS)):
    """A byte-level BPE tokenizer (420 ids) trained here on ``corpus``, with ``specials``
    as special tokens, ``template`` as its chat template; ``<|begin_of_text|>`` among the
    specials becomes its bos token.

    >>> tok = bpe_tokenizer(template=CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    >>> tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    '<|im_start|>user\\nhi<|im_end|>\\n'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    kwargs = {"tokenizer_object": tok}
    if eos:
        kwargs["eos_token"] = eos
    if pad:
        kwargs["pad_token"] = pad
    if "<|begin_of_text|>" in specials:
        kwargs["bos_token"] = "<|begin_of_text|>"
    out = PreTrainedTokenizerFast(**kwargs)
    if template:
        out.chat_template = template
    return out


def tiny_qwen2(tokenizer, hidden_size: int = 64, eos_token_id: int | None = None):
    """A tiny Qwen2 causal LM over ``tokenizer``'s ids (2 layers, 2 heads, tied
    embeddings, MLP twice ``hidden_size``), initialised from seed 0; ``eos_token_id``
    defaults to the tokenizer's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def save_folder(path, model, tokenizer) -> str:
    """Write ``model`` and ``tokenizer`` as a Hugging Face model folder; returns its path."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(Path(path))


# -- a finished run ------------------------------------------------------------------------
def random_batch(vocab: int, groups: int = 2, size: int = 3, seed: int = 0,
                 shared_prompt: bool = False, lengths: tuple[int, int] | None = None,
                 prompt_lengths: tuple[int, int] = (2, 6)) -> list:
    """``groups`` GRPO groups of ``size`` random trajectories over token ids ``3..vocab``
    (trainer tests, ``benchmarks/trainer_gang.py``): uneven lengths (responses of
    ``lengths`` tokens, low and high included; short ones by default), an env token (loss
    mask 0) inside each response, behaviour log-probs and versions, rewards that differ
    within a group; with ``shared_prompt`` a group's members share one prompt (as a real
    group does); prompts of ``prompt_lengths`` tokens (low and high included)."""
    import random

    from rollart.types import Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lengths))]
        for i in range(size):
            if not shared_prompt:
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lengths))]
            r = rng.randint(*lengths) if lengths else rng.randint(3, 9 if shared_prompt else 8)
            mask = [1] * r
            mask[r // 2] = 0
            out.append(Trajectory(
                f"s{seed}g{g}-{i}", "gridnav", f"s{seed}g{g}", 0, list(prompt),
                [rng.randrange(3, vocab) for _ in range(r)], mask,
                [-rng.uniform(1.5, 4.0) * m for m in mask], [0 if m else -1 for m in mask],
                reward=float(rng.random() < 0.5) + 0.1 * i))
    return out


def check_run_record(result) -> None:
    """Check a finished run (a ``RunResult``) without trusting its ledger: each step's
    Parquet rows ``trained`` at that step (``rollart.buffer.read_samples``) are exactly
    the batch the trainer reported (``trainer/batch_size`` and ``trainer/batch_sha1``),
    no trajectory is trained twice, nothing is left in flight, and the ledger's terminal
    counts are the rows written with that state (``failed`` less the ``orphaned``, which
    failed with a lost worker or were never durable on a lost buffer, and leave no row).
    Raises ``AssertionError`` naming what differs."""
    import hashlib
    from collections import Counter

    import pyarrow.compute as pc

    from rollart.buffer import read_samples

    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    ids = trained["traj_id"].to_pylist()
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    by_step: dict[int, list[str]] = {}
    for t, s in zip(ids, trained["trained_step"].to_pylist()):
        by_step.setdefault(s, []).append(t)
    assert sorted(by_step) == [r["step"] for r in result.metrics], \
        (sorted(by_step), [r["step"] for r in result.metrics])
    for row in result.metrics:
        got = by_step[row["step"]]
        assert len(got) == row["trainer/batch_size"], (row["step"], len(got), row)
        digest = hashlib.sha1("\n".join(sorted(got)).encode()).hexdigest()[:16]
        assert digest == row["trainer/batch_sha1"], row["step"]
    final = result.final_counts
    assert final["in_flight"] == 0, final
    rows = Counter(samples["state"].to_pylist())
    assert {s: rows[s] for s in ("dropped", "lost_in_step")} == \
        {s: final[s] for s in ("dropped", "lost_in_step")}, (rows, final)
    assert rows["failed"] == final["failed"] - final["orphaned"], (rows, final)
    assert final["trained"] == len(ids) == sum(r["trainer/batch_size"] for r in result.metrics)


def play_episode(runner, task, seed: int = 0):
    """One episode of ``task`` through ``runner`` (a ``TrajectoryRunner`` over a test's
    proxy), as rollout plays it, the runner closed after; returns ``(episode, log)``: the
    ``Episode`` record and the ``TokenLog`` of the ids the policy saw."""
    import asyncio

    from rollart.chat.conversation import TokenLog
    from rollart.types import Episode, Trajectory

    ep = Episode(task.name, seed, [], [], [], {})
    traj = Trajectory("t0", task.name, "g0", seed, [], [], [], [], [])
    log = TokenLog()
    try:
        asyncio.run(runner._episode(task, seed, log, ep, traj, None, []))
    finally:
        runner.close()
    return ep, log


# -- small records, graphs and envs ------------------------------------------------------
def trajectory(traj_id: str = "t", group_id: str = "g", prompt: Sequence[int] = (1, 2),
               response: Sequence[int] = (3, 4), *, mask: Sequence[int] | None = None,
               logprobs: Sequence[float] | None = None, versions: Sequence[int] | None = None,
               version: int = 0, seed: int = 0, task: str = "gridnav", **fields):
    """A ``rollart.types.Trajectory`` of ``task``: the loss mask is all 1, the behaviour
    log-probs -0.5 and the versions ``version`` on every response token unless given;
    ``fields`` (``reward``, ``state``, ``outcome``, ...) as the record takes them.

    >>> t = trajectory("a", "g1", [5], [6, 7], version=2, reward=1.0)
    >>> t.loss_mask, t.versions, t.reward
    ([1, 1], [2, 2], 1.0)
    """
    from rollart.types import Trajectory

    n = len(response)
    return Trajectory(traj_id, task, group_id, seed, list(prompt), list(response),
                      list(mask) if mask is not None else [1] * n,
                      list(logprobs) if logprobs is not None else [-0.5] * n,
                      list(versions) if versions is not None else [version] * n, **fields)


def tiny_graph(name: str = "t", tasks: Sequence | None = None, *, mode: str = "async",
               steps: int = 3, groups: int = 2, size: int = 2, alpha: int | None = None,
               warmup_steps: int = 0, policy: Mapping | None = None, **rollout):
    """A ``Graph`` a test runs on 2 cores: ``tasks`` (default gridnav), ``groups`` GRPO
    groups of ``size`` a step, no format warm-up unless asked, ``alpha`` (else GRPO's
    default), ``policy`` (more ``Policy`` fields, e.g. ``trainer_backend``) and
    ``rollout`` as ``Rollout`` takes them.

    >>> g = tiny_graph("t", steps=4, env_step_timeout=5.0)
    >>> g.steps, g.algo.group_size, g.policy.warmup_steps, g.rollout.env_step_timeout
    (4, 2, 0, 5.0)
    """
    from rollart.config.graph import GRPO, Graph, Policy, Rollout

    bound = {} if alpha is None else {"alpha": alpha}
    return Graph(name=name, tasks=tuple(tasks or ("gridnav",)), mode=mode, steps=steps,
                 policy=Policy(warmup_steps=warmup_steps, **(policy or {})),
                 algo=GRPO(group_size=size, groups_per_step=groups, **bound),
                 rollout=Rollout(**rollout))


#: the tag of a pool of big CPU hosts (affinity tests)
BIG = "CPU_BIG"


@env_affinity(BIG)
class BigGridEnv(GridNavEnv):
    """Grid navigation whose envs need the big CPU hosts (the ``CPU_BIG`` pool)."""


def big_grid_task(**fields):
    """The built-in gridnav task named ``big_grid`` playing ``BigGridEnv`` (so its envs
    need the ``CPU_BIG`` pool); ``fields`` (``max_turns``, ``reward_fn``, ...) replace the
    task's own.

    >>> t = big_grid_task(max_turns=2)
    >>> t.name, t.env_factory is BigGridEnv, t.max_turns
    ('big_grid', True, 2)
    """
    from dataclasses import replace

    from rollart.env.tasks import get_task

    return replace(get_task("gridnav"), name="big_grid", env_factory=BigGridEnv, **fields)


# -- a GGUF chat model ---------------------------------------------------------------------
#: SmolLM2-Instruct's chat template as its GGUF file carries it (ChatML; a default system
#: line; no tools): the family ``rollart.pretrained``'s known model belongs to
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_llama(vocab: int, hidden_size: int = 32, eos_token_id: int = 2, seed: int = 0):
    """A tiny Llama causal LM (2 layers, 4 query heads over 2 key/value heads, tied
    embeddings), initialised from ``seed``: SmolLM2's architecture at toy size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_theta=10000.0, bos_token_id=1, eos_token_id=eos_token_id,
                         pad_token_id=eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def write_tiny_gguf(path, template: str | None = SMOLLM_TEMPLATE, seed: int = 0):
    """Write a tiny Llama chat model as a GGUF file the way llama.cpp's converter lays one
    out (a byte-level BPE vocabulary with ChatML specials, f32 tensors under GGUF names,
    the query and key rows permuted for its rope); returns ``(path, model, tokenizer)``,
    the model and tokenizer it was written from, to check a conversion against."""
    import gguf
    import numpy as np

    tok = bpe_tokenizer(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                        template=template, eos="<|im_end|>", pad="<|im_end|>")
    vocab = len(tok)
    model = tiny_llama(vocab, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), seed=seed)
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("rollart tiny llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(vocab)
    backend = json_model(tok)
    ids = sorted(backend["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in ids]
    for added in tok.backend_tokenizer.get_added_tokens_decoder().values():
        if added.content not in backend["vocab"]:
            tokens.append(added.content)
    specials = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    w.add_bos_token_id(tok.convert_tokens_to_ids("<|im_start|>"))
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_pad_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads

    def permute(x, n):  # llama.cpp's layout of q/k rows (transformers undoes it on load)
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for name, tensor in model.state_dict().items():
        if name not in names:
            continue  # lm_head: tied to the embeddings
        x = tensor.detach().float().numpy().astype(np.float32)
        if ".attn_q." in names[name]:
            x = permute(x, heads)
        elif ".attn_k." in names[name]:
            x = permute(x, kv_heads)
        w.add_tensor(names[name], np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path), model, tok


def json_model(tokenizer) -> dict:
    """The ``model`` section of a fast tokenizer's JSON (its vocabulary and merges)."""
    import json

    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]
