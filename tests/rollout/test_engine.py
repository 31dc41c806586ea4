"""TorchEngine: batching with left padding, behaviour log-probs, sampling, weights."""

import pytest
import torch

from rollart.rollout.engine import TorchEngine
from rollart.types import GenRequest

PROMPTS = [[3, 4, 5], [5, 6, 7, 8, 9, 10, 11], [7], [12, 13, 14, 15, 16]]


def scrambled(engine: TorchEngine, seed: int) -> dict:
    """Large random weights: outputs then depend strongly on the whole context."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in engine.state_dict().items():
        noise = torch.randn(v.shape, generator=g)
        out[k] = 1.0 + 0.1 * noise if "norm" in k else noise * (0.3 if v.dim() > 1 else 0.1)
    return out


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = TorchEngine(model_dir, max_batch=3)  # 4 prompts -> two chunks
    eng.load_state_dict(scrambled(eng, 1), version=0)
    return eng


def test_batched_greedy_equals_one_at_a_time(engine):
    reqs = [GenRequest(p, max_new_tokens=10, temperature=0.0) for p in PROMPTS]
    batches = engine.batches
    together = engine.generate(reqs)
    assert engine.batches == batches + 2
    alone = [engine.generate([r])[0] for r in reqs]
    assert len({tuple(r.token_ids) for r in together}) > 1
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.finish_reason == "length" and len(a.token_ids) == 10
        assert a.versions == [0] * 10


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_teacher_forcing(engine, temperature):
    reqs = [GenRequest(p, max_new_tokens=6, temperature=temperature, seed=i)
            for i, p in enumerate(PROMPTS)]
    scale = temperature if temperature > 0 else 1.0
    for req, res in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float()
        n = len(req.prompt_ids)
        logp = torch.log_softmax(logits[n - 1 : -1] / scale, dim=-1)
        expected = logp[torch.arange(len(res.token_ids)), torch.tensor(res.token_ids)]
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)


def test_seeded_sampling_is_reproducible_and_independent_of_companions(engine):
    req = GenRequest(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=42)
    alone = engine.generate([req])[0]
    others = [GenRequest(p, max_new_tokens=12, temperature=1.0) for p in PROMPTS]
    mixed = engine.generate([others[0], req, others[2]])[1]
    assert alone.token_ids == mixed.token_ids
    assert alone.logprobs == pytest.approx(mixed.logprobs, abs=1e-4)
    other_seed = engine.generate([GenRequest(PROMPTS[1], 12, 1.0, seed=43)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_ids(engine):
    free = engine.generate([GenRequest(PROMPTS[0], max_new_tokens=10, temperature=0.0)])[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    req = GenRequest(PROMPTS[0], max_new_tokens=10, temperature=0.0, stop_ids=(stop, 999))
    res = engine.generate([req, GenRequest(PROMPTS[1], 10, 0.0)])
    assert res[0].token_ids == free.token_ids[: first + 1]
    assert res[0].finish_reason == "stop"
    assert res[1].finish_reason == "length" and len(res[1].token_ids) == 10
    assert engine.generate([GenRequest(PROMPTS[0], max_new_tokens=0)])[0].token_ids == []


def test_tiny_top_p_equals_greedy(engine):
    greedy = engine.generate([GenRequest(p, 8, temperature=0.0) for p in PROMPTS])
    nucleus = engine.generate([GenRequest(p, 8, temperature=0.8, top_p=1e-6, seed=i)
                               for i, p in enumerate(PROMPTS)])
    for g, n in zip(greedy, nucleus):
        assert g.token_ids == n.token_ids


def test_invalid_requests(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([GenRequest([], 4)])
    with pytest.raises(ValueError, match="positions"):
        engine.generate([GenRequest([3] * 510, 4)])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([GenRequest([10_000], 4)])


def test_load_state_dict_changes_outputs_and_version(model_dir):
    eng = TorchEngine(model_dir)
    req = GenRequest(PROMPTS[1], max_new_tokens=8, temperature=0.0)
    before = eng.generate([req])[0]
    new = scrambled(eng, 7)
    new.pop("lm_head.weight", None)  # tied embeddings: the head may be absent
    eng.load_state_dict(new, version=3)
    after = eng.generate([req])[0]
    assert eng.version == 3 and after.versions == [3] * len(after.token_ids)
    assert after.token_ids != before.token_ids
    assert torch.equal(eng.model.lm_head.weight, new["model.embed_tokens.weight"])
    with pytest.raises(KeyError, match="missing"):
        eng.load_state_dict({"model.norm.weight": new["model.norm.weight"]}, version=4)
    assert eng.version == 3
    assert eng.tokens_generated == 16 and eng.batches == 2 and eng.busy_seconds > 0


# -- weight swaps mid-generation: suspend -> update -> resume -> recompute KV ----------
def test_swap_mid_generation_recomputes_kv(model_dir):
    k = 4  # the update lands after every live row has chosen k tokens under weights A
    calls = []

    def at_boundary(n):
        calls.append(n)
        if n == k and eng.pending_version is None and eng.version == 0:
            eng.request_update(weights_b, 1)

    eng = TorchEngine(model_dir, step_callback=at_boundary)
    eng.load_state_dict(scrambled(eng, 1), version=0)
    weights_b = scrambled(eng, 2)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]  # 3, 7 and 1 tokens
    eng.step_callback = None
    ref = eng.generate([GenRequest(p, max_new_tokens=8, temperature=0.0) for p in prompts])
    stop = ref[2].token_ids[1]  # row 2 stops at its first `stop`, i.e. within 2 tokens
    stop_at = ref[2].token_ids.index(stop) + 1
    assert stop_at <= k
    reqs = [GenRequest(prompts[0], 8, 0.0), GenRequest(prompts[1], 8, 0.0),
            GenRequest(prompts[2], 8, 0.0, stop_ids=(stop,))]
    eng.step_callback = at_boundary
    res = eng.generate(reqs)
    assert calls == list(range(1, 8))  # boundaries after tokens 1..7 (none after the 8th)
    assert eng.version == 1 and eng.pending_version is None

    # the row that stopped before the swap is untouched
    assert res[2].token_ids == ref[2].token_ids[:stop_at] and res[2].finish_reason == "stop"
    assert res[2].versions == [0] * stop_at and res[2].logprobs == ref[2].logprobs[:stop_at]
    # live rows: k tokens from A (as in `ref`; the finished row left the batch, so
    # log-probs agree to float rounding, not bit for bit) ...
    live = [0, 1]
    for i in live:
        assert res[i].token_ids[:k] == ref[i].token_ids[:k]
        assert res[i].logprobs[:k] == pytest.approx(ref[i].logprobs[:k], abs=1e-5)
        assert res[i].versions == [0] * k + [1] * (8 - k)
        assert res[i].finish_reason == "length" and len(res[i].token_ids) == 8
    # ... then exactly what a fresh engine holding B continues from prompt + those tokens
    fresh = TorchEngine(model_dir, version=1)
    fresh.load_state_dict(weights_b, version=1)
    cont = fresh.generate([GenRequest(prompts[i] + res[i].token_ids[:k], 8 - k, 0.0)
                           for i in live])
    for i, c in zip(live, cont):
        assert res[i].token_ids[k:] == c.token_ids
        assert res[i].logprobs[k:] == pytest.approx(c.logprobs, abs=1e-5)
        alone = fresh.generate([GenRequest(prompts[i] + res[i].token_ids[:k], 8 - k, 0.0)])[0]
        assert alone.token_ids == c.token_ids
        assert alone.logprobs == pytest.approx(c.logprobs, abs=1e-4)
    assert any(res[i].token_ids[k:] != ref[i].token_ids[k:] for i in live)  # B matters
    # teacher forcing under B reproduces the new tokens' behaviour log-probs
    for i in live:
        ids = torch.tensor([prompts[i] + res[i].token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(eng.model(ids).logits[0].float(), dim=-1)
        n = len(prompts[i])
        expected = logp[n - 1 + k : -1].gather(1, torch.tensor(res[i].token_ids[k:])[:, None])
        assert torch.allclose(torch.tensor(res[i].logprobs[k:]), expected[:, 0], atol=1e-4)
    assert eng.suspends == 1
    assert eng.recompute_tokens == sum(len(prompts[i]) + k for i in live)
    assert eng.stall_seconds > 0


def _swap_at(eng, k: int, weights: dict, version: int, reqs):
    """``eng.generate(reqs)`` with ``weights`` staged as ``version`` at boundary ``k``."""
    def at_boundary(n):
        if n == k:
            eng.request_update(weights, version)

    eng.step_callback = at_boundary
    try:
        return eng.generate(reqs)
    finally:
        eng.step_callback = None


def test_keep_mode_goes_on_over_the_old_kv_without_recomputing(model_dir):
    """weight_update="keep": an update at boundary k re-prefills nothing; the live rows'
    first k tokens are the old weights', the rest exactly what the new weights give over
    the KV the old ones computed (teacher-forced below: A's cache of prompt + k - 1
    tokens, then B's forward of the rest); the recompute mode gives other tokens there."""
    k = 4
    eng = TorchEngine(model_dir, weight_update="keep")
    eng.load_state_dict(scrambled(eng, 1), version=0)
    weights_a, weights_b = eng.state_dict(), scrambled(eng, 2)
    reqs = [GenRequest(p, 8, 0.0) for p in PROMPTS[:3]]
    ref = eng.generate(reqs)
    res = _swap_at(eng, k, weights_b, 1, reqs)
    assert eng.version == 1 and eng.suspends == 1 and eng.recompute_tokens == 0
    assert eng.stall_seconds > 0  # the swap alone
    teacher = TorchEngine(model_dir, lean=False)
    for r, a in zip(res, ref):
        assert r.versions == [0] * k + [1] * (8 - k) and r.finish_reason == "length"
        assert r.token_ids[:k] == a.token_ids[:k]
        assert r.logprobs[:k] == pytest.approx(a.logprobs[:k], abs=1e-5)
    for req, r in zip(reqs, res):
        teacher.load_state_dict(weights_a, version=0)
        cache = teacher._new_cache()
        with torch.no_grad():
            teacher.model(input_ids=torch.tensor([req.prompt_ids + r.token_ids[:k - 1]]),
                          use_cache=True, **{teacher._cache_kwarg: cache})
            teacher.load_state_dict(weights_b, version=1)  # in place: the cache stays
            logits = teacher.model(input_ids=torch.tensor([r.token_ids[k - 1:-1]]),
                                   use_cache=True, **{teacher._cache_kwarg: cache}).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        assert r.token_ids[k:] == logp.argmax(-1).tolist()
        expected = logp.gather(1, torch.tensor(r.token_ids[k:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs[k:]), expected, atol=1e-4)
    # the recompute mode, same update: its tokens after the swap see B's KV instead
    eng.weight_update = "recompute"
    eng.load_state_dict(weights_a, version=0)
    rec = _swap_at(eng, k, weights_b, 1, reqs)
    assert eng.recompute_tokens > 0
    assert any(abs(x - y) > 1e-3 for r, c in zip(res, rec)
               for x, y in zip(r.logprobs[k:], c.logprobs[k:]))


def test_keep_mode_with_the_same_weights_equals_no_update(model_dir):
    """A 'new' version holding the old weights: keep mode's output is the output without
    any update (only the versions say a swap happened)."""
    eng = TorchEngine(model_dir, weight_update="keep")
    eng.load_state_dict(scrambled(eng, 1), version=0)
    reqs = [GenRequest(p, 8, 0.7, seed=i) for i, p in enumerate(PROMPTS)]
    ref = eng.generate(reqs)
    res = _swap_at(eng, 3, eng.state_dict(), 1, reqs)
    assert eng.suspends == 1 and eng.recompute_tokens == 0
    for r, a in zip(res, ref):
        assert r.token_ids == a.token_ids
        assert r.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert r.versions == [0] * 3 + [1] * (len(r.token_ids) - 3)


def test_keep_mode_leaves_no_prefix_entry_made_under_two_versions(model_dir):
    """A row that went on over old KV through a swap does not leave its KV for the
    trajectory's next turn (that turn prefills under the new weights); without a swap,
    or with the recompute mode (its KV all rebuilt), it does."""
    eng = TorchEngine(model_dir, weight_update="keep")
    req = GenRequest(PROMPTS[1], 6, 0.0, cache_key="traj-1")
    eng.generate([req])
    assert len(eng.prefix_cache) == 1
    _swap_at(eng, 2, eng.state_dict(), 1, [req])
    assert len(eng.prefix_cache) == 0 and eng.suspends == 1
    eng.weight_update = "recompute"
    _swap_at(eng, 2, eng.state_dict(), 2, [req])
    assert len(eng.prefix_cache) == 1 and eng.suspends == 2
    with pytest.raises(ValueError, match="Policy.weight_update must be one of"):
        TorchEngine(model_dir, weight_update="fast")


def test_swap_requested_while_idle_applies_before_next_batch(model_dir):
    seen = []
    eng = TorchEngine(model_dir, on_update=lambda v, err: seen.append((v, err)))
    eng.load_state_dict(scrambled(eng, 1), version=0)
    weights_b, weights_c = scrambled(eng, 2), scrambled(eng, 3)
    req = GenRequest(PROMPTS[1], max_new_tokens=6, temperature=0.0)
    eng.request_update(weights_b, 4)
    eng.request_update(weights_c, 5)  # newer replaces the staged one
    eng.request_update(weights_b, 3)  # older than the staged one: ignored
    assert eng.version == 0 and eng.pending_version == 5
    with pytest.raises(KeyError, match="missing"):  # checked when requested
        eng.request_update({"model.norm.weight": weights_b["model.norm.weight"]}, 6)
    assert eng.pending_version == 5
    res = eng.generate([req])[0]
    assert res.versions == [5] * 6 and eng.version == 5 and eng.pending_version is None
    assert eng.suspends == 0 and eng.recompute_tokens == 0 and seen == [(5, None)]
    fresh = TorchEngine(model_dir)
    fresh.load_state_dict(weights_c, version=5)
    ref = fresh.generate([req])[0]
    assert res.token_ids == ref.token_ids
    assert res.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    eng.request_update(weights_b, 6)
    assert eng.apply_pending_update() == 6 and eng.version == 6
    assert eng.apply_pending_update() is None
    eng.request_update(weights_c, 7)
    eng.load_state_dict(weights_c, version=7)  # a direct load drops the staged copy
    assert eng.pending_version is None


# -- continuous batching ------------------------------------------------------------------
def test_continuous_batching_rows_join_and_leave_mid_batch(engine):
    """Rows join at step boundaries and finish the moment they are done; every row equals
    its generation alone (greedy), whatever joined or left around it."""
    lengths = [2, 12, 5, 9, 1, 7]
    reqs = [GenRequest(PROMPTS[i % 4], max_new_tokens=n, temperature=0.0)
            for i, n in enumerate(lengths)]
    alone = [engine.generate([r])[0] for r in reqs]
    queue = list(enumerate(reqs))
    order, joined = [], []

    def admit(free):
        take = queue[: min(free, 1)]  # one request per boundary: staggered arrivals
        del queue[: len(take)]
        joined.extend(i for i, _ in take)
        return [(r, i) for i, r in take]

    got = {}

    def deliver(i, res):
        order.append(i)
        got[i] = res

    batches = engine.batches
    engine.admit_every = 1  # poll at every boundary
    try:
        engine.serve(admit, deliver)
    finally:
        engine.admit_every = 4
    assert sorted(got) == list(range(6)) and joined == list(range(6))
    assert engine.batches - batches == 6  # each arrival had its own prefill, no restarts
    assert order.index(0) < order.index(1) and order.index(4) < order.index(1)
    for i, ref in enumerate(alone):
        assert got[i].token_ids == ref.token_ids
        assert got[i].logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert len(got[i].token_ids) == lengths[i]


def test_arrivals_are_collected_for_admit_every_steps(engine):
    """Once rows are live, ``admit`` is polled every ``admit_every`` decode steps, so the
    requests that arrived meanwhile share one prefill; results equal each row alone."""
    eng = TorchEngine(engine.model_path, max_batch=8, admit_every=3)
    eng.load_state_dict(engine.model.state_dict(), version=0)
    reqs = [GenRequest(PROMPTS[i % 4], max_new_tokens=10, temperature=0.0) for i in range(7)]
    alone = [eng.generate([r])[0] for r in reqs]
    queue = list(enumerate(reqs))
    polls = []

    def admit(free):
        polls.append(eng.decode_steps)
        take, arrived = [], 1 + eng.decode_steps - start  # one arrival per step
        while queue and queue[0][0] < arrived and len(take) < free:
            take.append(queue.pop(0))
        return [(r, i) for i, r in take]

    got = {}
    batches, start = eng.batches, eng.decode_steps
    eng.serve(admit, lambda i, res: got.__setitem__(i, res))
    steps = [p - start for p in polls]
    assert steps[:3] == [0, 3, 6]  # rows live from the first poll on: every 3 steps
    assert eng.batches - batches == 3  # 7 arrivals, 3 prefills: [0], [1-3], [4-6]
    for i, ref in enumerate(alone):
        assert got[i].token_ids == ref.token_ids
        assert got[i].logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_serve_drops_abandoned_rows_and_reports_bad_requests(engine):
    reqs = [GenRequest(PROMPTS[0], 30, 0.0), GenRequest([], 4), GenRequest(PROMPTS[1], 6, 0.0)]
    queue = list(enumerate(reqs))
    gone, got = set(), {}

    def admit(free):
        take, queue[:] = queue[:free], queue[free:]
        return [(r, i) for i, r in take]

    def deliver(i, res):
        got[i] = res
        if i == 2:
            gone.add(0)  # its caller went away while row 0 was still generating

    engine.serve(admit, deliver, abandoned=lambda i: i in gone)
    assert isinstance(got[1], ValueError) and "empty" in str(got[1])
    assert len(got[2].token_ids) == 6 and 0 not in got  # dropped without a result


# -- stop rules: several stop ids, stop strings, finish reasons ----------------------------
def _free_run(engine, n=12):
    """What the engine generates greedily without any stop (the reference run)."""
    return engine.generate([GenRequest(PROMPTS[1], max_new_tokens=n, temperature=0.0)])[0]


def test_any_of_several_stop_ids_ends_the_row(engine):
    ref = _free_run(engine).token_ids
    assert len(set(ref)) > 2
    first = 3  # stop at the 4th token: a stop id that only occurs from there on
    later = next(t for t in ref[first:] if t not in ref[:first])
    at = ref.index(later)
    res = engine.generate([GenRequest(PROMPTS[1], max_new_tokens=12, temperature=0.0,
                                      stop_ids=(10_000, later))])[0]
    assert res.token_ids == ref[:at + 1]  # the stop token is included
    assert res.finish_reason == "stop"
    assert len(res.logprobs) == len(res.versions) == at + 1


def test_stop_string_ends_the_row_where_the_text_first_contains_it(engine):
    tok = engine.tokenizer
    ref = _free_run(engine).token_ids
    text = tok.decode(ref, skip_special_tokens=False)
    # a stop string made of the 5th and 6th tokens' text (word-level: "a b")
    stop = tok.decode(ref[4:6], skip_special_tokens=False)
    expected = next(n for n in range(1, len(ref) + 1)
                    if stop in tok.decode(ref[:n], skip_special_tokens=False))
    assert stop in text and expected <= 6
    res = engine.generate([GenRequest(PROMPTS[1], max_new_tokens=12, temperature=0.0,
                                      stop_strings=("never produced", stop))])[0]
    assert res.token_ids == ref[:expected]
    assert res.finish_reason == "stop"
    # other rows of the same batch are not affected by it
    both = engine.generate([
        GenRequest(PROMPTS[1], max_new_tokens=12, temperature=0.0, stop_strings=(stop,)),
        GenRequest(PROMPTS[1], max_new_tokens=12, temperature=0.0)])
    assert both[0].token_ids == ref[:expected] and both[1].token_ids == ref


def test_a_row_cut_by_max_new_tokens_finishes_with_length(engine):
    ref = _free_run(engine, 5)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 5
    res = engine.generate([GenRequest(PROMPTS[1], max_new_tokens=5, temperature=0.0,
                                      stop_strings=("never produced",),
                                      stop_ids=(10_000,))])[0]
    assert res.token_ids == ref.token_ids and res.finish_reason == "length"


def test_hits_stop_string_checks_only_a_bounded_tail(engine):
    from rollart.rollout.batch import hits_stop_string

    tok = engine.tokenizer
    ids = tok.encode("left up down right", add_special_tokens=False)
    assert hits_stop_string(tok, ids, ("down right",))
    assert not hits_stop_string(tok, ids, ("right left",))
    long = tok.encode(" ".join(["left"] * 5000) + " up", add_special_tokens=False)
    assert hits_stop_string(tok, long, ("left up",))
    # a stop string far back in the text was met earlier (the row stopped then)
    assert not hits_stop_string(tok, tok.encode("up " + "left " * 200, add_special_tokens=False),
                                ("up left left",))
