"""A run's own request stream replayed into the bare engine (``benchmarks/limits.py``).

Consumes an ``InferenceWorker``'s request log (``rollart.rollout.request_log``: each
request's arrival, prompt ids, the part of them its prefix cache held, the tokens it
generated, its sampling settings) and produces the bare engine's figures on exactly
that work: ``replay(model, log, threads=..., ...)``.

*Bare* means rollart's own ``TorchEngine`` (``make_engine``, with the run's engine
options: ``max_batch``, ``admit_every``, the forward kind) driven by its own serve loop
(``BatchingEngine.serve``) in this process, on the given number of torch threads, with
nothing else: no Dask, no actor, no worker queue or engine thread, no event loop, no env
managers, rewards, trainer or weight updates. The engine, not a hand-written loop: the
replay must do the run's work (continuous batching as requests arrive, prefix reuse,
each request's own sampler and stop checks), and the distance between the engine and a
static bare batch is what ``rollout_vs_bare`` already shows.

The same work, request by request:

* each request arrives at its recorded time after the replay's start (the clock starts
  after the set-up below) and joins the batch in arrival order, as ``admit`` allows;
* its prompt is the recorded one; the ``cached`` tokens the run's prefix cache held are
  in the replay engine's prefix cache beforehand (primed before the clock, one entry per
  request under its own key), so it forwards the same tokens the run forwarded;
* it generates exactly the recorded number of tokens: ``max_new_tokens`` is that number,
  and its stop ids and stop strings are replaced by ones that cannot occur with the same
  count and lengths, so the engine checks them at the same cost and never stops early;
* temperature, top-p and seed are the recorded ones; the weights are the model folder's
  (the run's drifted as it trained: which tokens come out differs, their cost does not).

Not replayed: weight swaps and the re-prefills after them, aborted requests, requests
that arrived before the log started or finished after it was read (the log has none).
``replay_window`` runs ``replay`` twice on a window's log, paced by the recorded
arrivals and free of them (everything there from the start, in arrival order).
Memory: every primed prefix's KV is held from the start until its request finishes (a
window's worth of cached prefixes; small for the built-in model, gigabytes for a long
window on a real one).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from rollart.types import GenRequest

#: a stop string of this character cannot be met (no tokenizer decodes to U+FFFF runs)
NEVER = "\uffff"


def forced_requests(records: list[dict]) -> list[GenRequest]:
    """The log's requests (in the order given) as requests that generate exactly the
    recorded number of tokens (module doc); a request with a cached prefix or a
    ``cache_key`` in the run gets a key of its own (``replay-<i>``)."""
    out = []
    for i, r in enumerate(records):
        keyed = r["keyed"] or r["cached"] > 0
        out.append(GenRequest(
            list(r["prompt_ids"]), max_new_tokens=int(r["generated"]),
            temperature=r["temperature"], top_p=r["top_p"], seed=r["seed"],
            stop_ids=tuple(-1 - k for k in range(len(r["stop_ids"]))),
            stop_strings=tuple(NEVER * len(s) for s in r["stop_strings"]),
            cache_key=f"replay-{i}" if keyed else None))
    return out


def prime(engine, records: list[dict], reqs: list[GenRequest], chunk: int = 32) -> int:
    """Put each request's recorded cached prefix into ``engine``'s prefix cache under
    its key (``TorchEngine.prefill`` stores the prompt's KV); return the tokens primed."""
    todo = [GenRequest(q.prompt_ids[:r["cached"]], max_new_tokens=0, cache_key=q.cache_key)
            for r, q in zip(records, reqs) if r["cached"] > 0]
    for i in range(0, len(todo), chunk):
        engine.prefill(todo[i:i + chunk])
    return sum(len(q.prompt_ids) for q in todo)


def _engine(model_path: str, n: int, max_batch: int, kind: str, options: dict | None):
    from rollart.rollout.base import make_engine

    options = dict(options or {})
    if kind != "torch":
        raise ValueError(f"the replay drives the torch engine; the run's is {kind!r}")
    # room for every primed prefix, and the finished rows' KV (dropped on delivery)
    options["prefix_cache"] = 2 * n + 16
    return make_engine("torch", model_path, max_batch=max_batch, **options)


@torch.inference_mode()
def replay(model_path: str, log: dict, *, threads: int, max_batch: int = 64,
           engine: str = "torch", engine_options: dict | None = None,
           warmup: int = 8, paced: bool = True) -> dict:
    """Serve ``log["requests"]`` (a ``RequestLog.take()``) on a fresh engine as they
    arrived (module doc; ``paced=False``: all of them there from the start, still in
    arrival order, as fast as ``max_batch`` lets them in), on the engine ``engine``
    with ``max_batch`` and ``engine_options`` (the run's ``InferenceWorker`` keywords).
    Returns ``requests`` and ``tokens`` served, ``recorded_tokens``,
    ``mismatched`` (requests whose length differs from the record), the engine's
    ``busy_s`` (inside its serve loop), its thread's ``cpu_s``, ``wall_s``, ``tok_s``
    (tokens ÷ busy seconds), ``tok_s_cpu``, ``live_batch``, ``prefill_tokens`` (forwarded)
    and ``primed_tokens``; ``warmup`` requests are served once first, untimed."""
    records = sorted(log["requests"], key=lambda r: r["arrival"])
    torch.set_num_threads(int(threads))
    reqs = forced_requests(records)
    eng = _engine(model_path, len(reqs), max_batch, engine, engine_options)
    if reqs and warmup:  # allocations and first-call costs, off the clock
        eng.generate([GenRequest(q.prompt_ids, max_new_tokens=q.max_new_tokens,
                                 temperature=q.temperature, top_p=q.top_p)
                      for q in reqs[:warmup]])
    primed = prime(eng, records, reqs)
    before = (eng.busy_seconds, eng.tokens_generated, eng.decode_steps, eng.prefill_tokens)
    results = _serve_paced(eng, reqs, [r["arrival"] if paced else 0.0 for r in records])
    busy, tokens, steps, prefill = (now - then for now, then in zip(
        (eng.busy_seconds, eng.tokens_generated, eng.decode_steps, eng.prefill_tokens),
        before))
    out = results.pop("results")
    served = sum(len(r.token_ids) for r in out)
    if served != tokens:
        raise RuntimeError(f"the replay's results hold {served} tokens, its engine "
                           f"counted {tokens}")
    return {"requests": len(out), "tokens": served,
            "recorded_tokens": sum(r["generated"] for r in records),
            "mismatched": sum(len(o.token_ids) != r["generated"]
                              for o, r in zip(out, records)),
            "busy_s": busy, "tok_s": served / max(busy, 1e-9),
            "tok_s_cpu": served / max(results["cpu_s"], 1e-9),
            "live_batch": served / max(steps, 1), "prefill_tokens": prefill,
            "primed_tokens": primed, **results}


def replay_window(model: str, logs: list[dict], infer: dict) -> dict:
    """A window's request stream (``logs``: the one inference worker's log) replayed
    (``replay``) on the worker's threads and engine settings (``infer``: its keyword
    arguments), paced by the arrivals and then free of them (``free_tok_s``,
    ``free_live_batch``, ...); the paced replay's figures, and the log's
    ``logged_requests`` / ``logged_tokens``. Raises unless each replay served exactly
    the recorded requests and tokens."""
    if len(logs) != 1:
        raise RuntimeError(f"expected the request log of one inference worker, got "
                           f"{len(logs)}: the run has one inference pool")
    log = logs[0]
    if log["dropped"]:
        raise RuntimeError(f"the request log dropped {log['dropped']} requests: raise "
                           "its limit (InferenceWorker.start_request_log)")
    reps = [replay(model, log, threads=infer["threads"], max_batch=infer["max_batch"],
                   engine=infer.get("engine", "torch"),
                   engine_options=infer.get("engine_options"), paced=paced)
            for paced in (True, False)]
    logged = (len(log["requests"]), reps[0]["recorded_tokens"], 0)
    for rep in reps:
        if (rep["requests"], rep["tokens"], rep["mismatched"]) != logged:
            raise RuntimeError(f"a replay served {rep['requests']} requests and "
                               f"{rep['tokens']} tokens ({rep['mismatched']} of another "
                               f"length), the log {logged[0]} and {logged[1]}")
    rep, free = reps
    return {**rep, "logged_requests": logged[0], "logged_tokens": logged[1],
            "free_requests": free["requests"], "free_tokens": free["tokens"],
            "free_tok_s": free["tok_s"], "free_live_batch": free["live_batch"]}


def _serve_paced(eng, reqs: list[GenRequest], arrivals: list[float]) -> dict:
    """Serve ``reqs``, each admitted no earlier than ``arrivals[i]`` seconds after the
    start, in order; the results, the wall seconds, this thread's CPU seconds while
    serving (not while sleeping for the next arrival) and the mean admission lag."""
    queue = deque(range(len(reqs)))
    results: list = [None] * len(reqs)
    lag = [0.0]
    t0 = time.perf_counter()

    def admit(free: int) -> list[tuple]:
        now = time.perf_counter() - t0
        taken = []
        while queue and len(taken) < free and arrivals[queue[0]] <= now:
            i = queue.popleft()
            lag[0] += now - arrivals[i]
            taken.append((reqs[i], i))
        return taken

    def deliver(i: int, outcome) -> None:
        results[i] = outcome
        done[0] += 1
        if reqs[i].cache_key is not None:  # its KV is of no further use here
            eng.prefix_cache.drop(reqs[i].cache_key)

    done, cpu = [0], 0.0
    while done[0] < len(reqs):
        c0 = time.thread_time()
        eng.serve(admit, deliver)
        cpu += time.thread_time() - c0
        if queue:
            wait = arrivals[queue[0]] - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
        elif done[0] < len(reqs):
            raise RuntimeError("the engine stopped with replayed requests unanswered")
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} replayed requests failed, the first "
                           f"({failed[0][0]}): {failed[0][1]!r}") from failed[0][1]
    return {"results": results, "wall_s": time.perf_counter() - t0, "cpu_s": cpu,
            "lag_s": lag[0] / max(len(reqs), 1)}

