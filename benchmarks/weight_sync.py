"""Weight-sync benchmark: decode throughput lost to policy updates, Mooncake vs fsspec,
full weights vs LoRA adapters; bytes per version and the trainer's memory.

A trainer process runs rollart's ``Trainer`` (the same ``_update`` a ``train_step``
runs: GRPO loss with ``--kl`` (kl_coef, 0.05 as the chat graph), backward over
micro-batches, AdamW) on real batches of agent-length trajectories of the model
(multi-turn token sequences of ``--context`` tokens, their behaviour log-probs computed
by the model before the run), one thread. Each run starts from the same initial policy
(a fresh ``Trainer`` loaded from the model folder) and publishes version 0 with
``Trainer.publish``: a full fine-tune takes its frozen KL reference copy there, a LoRA
one wraps the model in its adapter. After each of its first ``N`` steps it publishes
the new version to the weight store (``_put_weights``, as ``train_step`` does: every
weight, or with LoRA the adapter only); a last step runs without publishing, so each
update has a trainer step to arrive in. Meanwhile an ``InferenceWorker`` in this
process (one thread) serves ``--load`` concurrent multi-turn conversations (each turn
sends the whole context: a ``--prompt``-token first message, then per turn
``--tokens`` generated and ``--obs`` observation tokens, up to ``--turns`` turns), and
pulls each version itself (its prefetch thread watches the store, stages the weights,
swaps at a decode-step boundary and re-prefills the in-flight rows' KV; with LoRA its
engine merges each adapter into the adapted layers at that boundary). The ``keep`` run
is the fsspec run again with ``Policy.weight_update="keep"``: the in-flight rows go on
over their KV after a swap, nothing is re-prefilled.

The same run is made without publishing (the trainer computes identically, the worker
never updates): the baseline. All runs are measured side by side in one invocation over
the same window (from the trainer's first step to the end of its last), in the order
baseline, fsspec, fsspec keep, Mooncake idle, Mooncake, LoRA per ``--lora`` rank
(fsspec, target "auto": every linear layer but the head), baseline; the baseline is the
mean of its two runs. Per store, mode or rank:

    stall_<run> = 1 − decode tokens/s with updates ÷ decode tokens/s without

The baselines' worker watches a folder (fsspec). "Mooncake idle" is a baseline on
Mooncake: the same run, publishing nothing, its worker watching a Mooncake store (that
store holds version 0, as every run's does). It splits Mooncake's stall in two: what
watching Mooncake costs (``stall_mooncake_idle``, against the baseline) and what its
updates cost (``stall_mooncake_updates``, against the idle run), the second comparable
with ``stall_fsspec``.

Mooncake is a local ``mooncake_master`` with trainer and reader in different processes
over its TCP transfer engine; fsspec a local folder.

Memory: the full-weight runs share one trainer process and each LoRA rank has one of
its own, so each config's peak resident memory (``ru_maxrss``, monotonic per process)
is its own: full is read after its first run (the first baseline: the same steps, the
reference copy and optimizer state included), a rank after its run. ``rss_train`` is
that peak minus the resident memory right after the model was loaded and the batch
built (peft imported in every process before that, so its code is not counted): the
frozen reference, gradients, optimizer state and activations.

Fan-out (``--fanout 1,2,4,8``): the version a trainer gang publishes (the model's
weights as ``--fanout-buckets`` HF-named buckets and a manifest, written by this
process, the publisher) pulled by K reader processes at once over a Mooncake master on
loopback started here, with the relay on (``relay_mb``: each reader serves the buckets
it has to the others, ``rollart.weights.relay``). Each reader streams the version
bucket by bucket (``iter_buckets``, held meanwhile) and reports the bytes it read from
the trainer's objects and from other readers' replicas; the K readers are the first K
of a pool started once. Per K: ``fanout_s_K`` (seconds from the go to the last reader
done, mean over ``--fanout-versions``) and ``origin_bytes_ratio_K`` = bytes the trainer's
objects served ÷ (version bytes × K) (the goal: ≤ 0.3 at K = 8; without the relay it is
1 by construction, so it measures the rule, not a speed); ``fanout_fallbacks`` (relay
reads that went to the origin, all K), ``fanout_mib``. The same pass then runs without the
relay (a new master and reader pool, every reader pulling every bucket from the
trainer's objects): ``fanout_s_K_norelay``, and ``fanout_speedup_K`` = without ÷ with
(issue 51's ``fanout_speedup_8``: > 1 means the relay delivers a version to K readers
sooner). On one machine both ways copy through the same memory, so the relay can only
win where the trainer's side is the narrow part.

RESULT keys: ``stall_fsspec``, ``stall_mooncake``, ``stall_lora<r>`` (fraction of
decode tokens/s lost; negative = within noise of none); ``stall_recompute`` (the fsspec
run's, the default mode) and ``stall_keep`` (the keep run's), side by side;
``tok_s_base`` (mean of ``tok_s_base_a``/``_b``, to judge the noise), ``tok_s_fsspec``,
``tok_s_keep``, ``tok_s_mooncake``, ``tok_s_lora<r>``; ``engine_stall_ms_<run>`` (per
update, swap + KV recompute as the engine counts it), ``recompute_tokens_<run>`` (per
update, context tokens re-prefilled: 0 for keep), ``fetch_s_<run>`` (per update, the
prefetch the worker hid), ``put_s_<run>``, ``swaps_<run>``; ``stall_mooncake_idle``,
``tok_s_mooncake_idle``, ``stall_mooncake_updates`` (above); ``watch_ms_<run>`` and
``watch_cpu_ms_<run>`` (per look at the store's newest version: wall time, and the
prefetch thread's CPU in it) and ``watches_s_<run>`` (looks per second) for ``base_a``,
``fsspec``, ``mooncake_idle`` and ``mooncake``; ``bytes_full``, ``bytes_lora<r>`` (bytes published
per version), ``bytes_ratio_lora<r>`` (adapter ÷ full; the goal is ≤ 0.05);
``update_s_<run>`` (per update, the seconds a version cost the worker: ``fetch_s`` +
the engine's stall), ``publish_s`` and ``update_s`` (the fsspec run's ``put_s`` and
``update_s``: full weights through the default store, the headline);
``trainer_step_s`` (full, median), ``trainer_step_s_lora<r>``;
``rss_peak_mib_<full|lora<r>>``, ``rss_train_mib_<full|lora<r>>``; ``model_mib``,
``params_m`` (model parameters, millions, tied embedding once), ``context`` (longest
context, tokens), ``updates``, ``model`` (``tiny`` or what ``--model`` named). A run
left out by ``--runs`` leaves its keys out.

The model is a tiny one built here (``--hidden``, ``--layers``, ``--heads``: the default
and CI's workload), or with ``--model`` a pretrained model folder or known name
(``rollart.pretrained``) for trainer and worker alike, with its own defaults (``REAL``,
fixed before any run: 3 updates, 4 conversations of up to 320 tokens, a trainer batch of
4, the runs baseline, fsspec and keep, no fan-out): SmolLM2-135M-Instruct (538 MB fp32)
takes about 12 minutes on 2 cores. ``--runs`` picks the runs (comma list of
``baseline,fsspec,keep,mooncake,lora``; the baseline always)::

    python benchmarks/weight_sync.py --quick                      # ranks 8 and 64
    python benchmarks/weight_sync.py --quick --lora '' --fanout 1,2,4,8
    python benchmarks/weight_sync.py --hidden 768 --layers 12 --heads 12  # 113 M params
    flock /tmp/rollart-bench.lock python benchmarks/weight_sync.py \\
        --model smollm2-135m-instruct                             # the real model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments, fill  # noqa: E402

TRAINER = """
import asyncio, gc, json, os, random, resource, sys, time
import peft, torch  # peft's code before the after-load figure, in every config
from rollart.config.graph import GRPO
from rollart.trainer.trainer import Trainer
from rollart.types import Trajectory
model_dir, n, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)
algo = GRPO(group_size=spec["group"], lr=1e-4, kl_coef=spec["kl"])
rng = random.Random(0)
def rss_kib():  # resident now (ru_maxrss is the process's peak)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
def trajectory(model, i):
    vocab = model.config.vocab_size
    ids = [rng.randrange(3, vocab) for _ in range(spec["prompt"])]
    mask = [0] * len(ids)
    for _ in range(spec["turns"]):
        ids += [rng.randrange(3, vocab) for _ in range(spec["tokens"] + spec["obs"])]
        mask += [1] * spec["tokens"] + [0] * spec["obs"]
    with torch.no_grad():  # the behaviour log-probs: the model's own
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    p = spec["prompt"]
    resp, m = ids[p:], mask[p:]
    return Trajectory(f"t{i}", "bench", f"g{i // spec['group']}", i, ids[:p], resp, m,
                      [x if k else 0.0 for x, k in zip(lp[p - 1:], m)],
                      [0 if k else -1 for k in m], reward=rng.random())
trainer, batch, loaded, kept = None, None, None, []
for line in sys.stdin:  # one run per command: {"url": ..., "publish": ..., "lora": ...}
    cmd = json.loads(line)
    if cmd.get("exit"):
        break
    if trainer is not None:  # a Mooncake client stays: see the end
        kept.append(trainer.store)
    trainer = None
    gc.collect()
    # every run starts from the same policy: a fresh trainer (LoRA wrapping is one-way)
    trainer = Trainer(model_dir, cmd["url"], algo, threads=1, lora=cmd.get("lora"))
    if batch is None:  # the process's first run: the same batch for all its runs
        batch = [trajectory(trainer.model, i) for i in range(spec["batch"])]
        loaded = rss_kib()
    # version 0, as a run starts: LoRA wraps the model in its adapter; a full fine-tune
    # with kl_coef > 0 takes its frozen KL reference copy
    asyncio.run(trainer.publish())
    print("ready", flush=True)
    sys.stdin.readline()  # go
    for step in range(1, n + 2):
        t0 = time.perf_counter()
        trainer._update(batch)
        t1 = time.perf_counter()
        published = cmd["publish"] and step <= n
        if published:
            trainer.version = step
            trainer._put_weights()
            trainer._gc()
        print(json.dumps({"step": step, "step_s": t1 - t0, "put_s": time.perf_counter() - t1,
                          "bytes": trainer.bytes_published if published else 0}), flush=True)
    sys.stdin.readline()  # done: Mooncake objects live here until the reader is through
    print(json.dumps({"rss_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "rss_loaded_kib": loaded}), flush=True)
# leave without tearing down the Mooncake client: its master is gone by now, and the
# teardown's calls to it time out (seconds, after every figure was taken)
sys.stdout.flush()
os._exit(0)
"""


PULLER = """
import json, os, sys, time
from rollart.weights import WeightStore
store, reader = WeightStore(sys.argv[1]), f"fanout-{sys.argv[2]}"
store.release(reader)  # claims this reader's slot now, not in the timed pull
print("ready", flush=True)
for line in sys.stdin:  # one pull per command; between them the relay keeps serving
    cmd = json.loads(line)
    if cmd.get("exit"):
        break
    before, t0 = dict(store.transfer), time.perf_counter()
    store.hold(reader, cmd["version"])
    n = 0
    with store.iter_buckets(cmd["version"], reader=reader) as stream:
        for _, part in stream:
            n += sum(t.numel() * t.element_size() for t in part.values())
    store.release(reader)
    got = {k: v - before.get(k, 0) for k, v in store.transfer.items()}
    print(json.dumps({"s": time.perf_counter() - t0, "tensor_bytes": n, **got}), flush=True)
sys.stdout.flush()
os._exit(0)  # the master may be gone by now: skip the client's teardown
"""


# read leases of the fan-out's master: short, so that each version can be removed (its
# replicas with it) soon after its readers are done; Mooncake's default is 10 s, in which
# a dozen versions of a fast loopback fan-out would fill the segments and be evicted
FANOUT_LEASE_MS = 500


def fanout(model_dir: str, ks: list[int], versions: int, buckets: int) -> dict:
    """The fan-out runs (see the module docstring), with the relay and without it, side
    by side: per K, seconds per version each way, the share of the K copies the
    trainer's objects served, and ``fanout_speedup_K`` = without ÷ with."""
    out = fanout_pass(model_dir, ks, versions, buckets, relay=True)
    plain = fanout_pass(model_dir, ks, versions, buckets, relay=False)
    for k in ks:
        out[f"fanout_s_{k}_norelay"] = plain[f"fanout_s_{k}"]
        out[f"fanout_speedup_{k}"] = plain[f"fanout_s_{k}"] / out[f"fanout_s_{k}"]
        print(f"fan-out   K={k}: without the relay ÷ with it = "
              f"{out[f'fanout_speedup_{k}']:.3f}", flush=True)
    return out


def fanout_pass(model_dir: str, ks: list[int], versions: int, buckets: int, *,
                relay: bool) -> dict:
    """One pass of the fan-out runs over ``ks``, every reader a process of its own, with
    the relay on (``relay_mb``) or without it (each reader pulls every bucket from the
    trainer's objects)."""
    import subprocess

    from safetensors.torch import load_file

    from rollart.runtime.waits import stop_processes
    from rollart.weights import MooncakeMaster, WeightStore

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    keys = list(state)
    per = -(-len(keys) // buckets)
    parts = [keys[i:i + per] for i in range(0, len(keys), per)]
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    big = max(sum(state[k].numel() * state[k].element_size() for k in p) for p in parts)
    buf = max(16, int(big / 2**20 * 2) + 8)
    out, version = {"fanout_mib": mib, "fanout_buckets": len(parts), "fanout_fallbacks": 0}, 0
    with MooncakeMaster(lease_ms=FANOUT_LEASE_MS) as master:
        url = master.url("fanout", segment_mb=int(mib * 3) + 64, buffer_mb=buf,
                         **({"relay_mb": int(mib * 2.5) + 32} if relay else {}))
        trainer = WeightStore(url)
        logs = [tempfile.NamedTemporaryFile("w+", prefix=f"rollart-fanout-{i}-",
                                            suffix=".log") for i in range(max(ks))]
        procs = [subprocess.Popen([sys.executable, "-c", PULLER, url, str(i)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True) for i, log in enumerate(logs)]

        def line(i: int) -> str:
            got = procs[i].stdout.readline()
            if not got:
                logs[i].seek(0)
                raise RuntimeError(f"fan-out reader {i} ended (exit status "
                                   f"{procs[i].poll()}): {logs[i].read()[-2000:]}")
            return got

        try:
            for i in range(len(procs)):
                if line(i).strip() != "ready":
                    raise RuntimeError(f"fan-out reader {i} did not start")
            for k in ks:
                seconds, origin, served = [], 0, 0
                for _ in range(versions):
                    version += 1
                    names, size = [], 0
                    for j, part in enumerate(parts):  # a trainer gang's version
                        name, n = trainer.put_bucket(version, j, {
                            x: state[x] + version * 1e-3 for x in part})
                        names.append(name)
                        size += n
                    trainer.put_manifest(version, names)
                    t0 = time.perf_counter()
                    for p in procs[:k]:
                        p.stdin.write(json.dumps({"version": version}) + "\n")
                        p.stdin.flush()
                    rows = [json.loads(line(i)) for i in range(k)]
                    seconds.append(time.perf_counter() - t0)
                    origin += sum(r["origin_bytes"] for r in rows)
                    served += size * k
                    out["fanout_fallbacks"] += sum(r.get("fallbacks", 0) for r in rows)
                    if any(r["tensor_bytes"] != rows[0]["tensor_bytes"] for r in rows):
                        raise RuntimeError(f"fan-out readers got different versions: {rows}")
                    # (untimed) the previous version leaves once its read leases end,
                    # as a trainer's gc does it: the segments hold about two versions
                    deadline = time.monotonic() + 10
                    trainer.gc(keep=1)
                    while len(trainer.versions()) > 1 and time.monotonic() < deadline:
                        time.sleep(0.05)
                        trainer.gc(keep=1)
                out[f"fanout_s_{k}"] = sum(seconds) / len(seconds)
                out[f"origin_bytes_ratio_{k}"] = origin / served
                print(f"fan-out   K={k} ({'relay' if relay else 'no relay'}): "
                      f"{out[f'fanout_s_{k}']:.3f} s/version of "
                      f"{mib:.1f} MiB in {len(parts)} buckets; the trainer's objects "
                      f"served {out[f'origin_bytes_ratio_{k}']:.3f} of K copies", flush=True)
        finally:
            stop_processes(procs, grace=60, ask=json.dumps({"exit": True}))
    return out


class TrainerProcess:
    """The trainer in a process of its own (one thread), driven line by line."""

    def __init__(self, model_dir: str, updates: int, spec: dict):
        self.args = (model_dir, str(updates), json.dumps(spec))
        self.proc = None

    async def start(self):
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TRAINER, *self.args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return self

    async def send(self, obj) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    async def line(self) -> bytes:
        line = await self.proc.stdout.readline()
        if not line:
            err = (await self.proc.stderr.read()).decode(errors="replace")[-2000:]
            raise RuntimeError(f"the trainer process ended: {err}")
        return line

    async def close(self) -> None:
        await self.send({"exit": True})
        await self.proc.wait()


async def conversation(w, i: int, spec: dict, vocab: int, stop: asyncio.Event) -> None:
    """One user: multi-turn conversations, each turn sending the whole context."""
    import random

    from rollart.types import GenRequest

    rng, k = random.Random(i), 0
    while not stop.is_set():
        ids = [rng.randrange(3, vocab) for _ in range(spec["prompt"])]
        for _ in range(spec["turns"]):
            if stop.is_set():
                return
            res = await w.generate(GenRequest(list(ids), max_new_tokens=spec["tokens"],
                                              temperature=1.0, seed=1000 * i + k))
            k += 1
            ids += res.token_ids + [rng.randrange(3, vocab) for _ in range(spec["obs"])]


async def measure(trainer: TrainerProcess, url: str, model_dir: str, updates: int,
                  publish: bool, spec: dict, load: int, settle: float,
                  lora: dict | None = None, weight_update: str = "recompute") -> dict:
    """One run: the trainer's ``updates + 1`` steps under ``load`` conversations; with
    ``lora`` (peft options) the trainer trains and publishes that adapter only and the
    worker's engine applies each one; ``weight_update``: ``Policy.weight_update``."""
    from rollart.rollout import InferenceWorker

    await trainer.send({"url": url, "publish": publish, "lora": lora})
    if (await trainer.line()).strip() != b"ready":
        raise RuntimeError("the trainer process did not get ready")
    options = {"weight_update": weight_update, **({"lora": lora} if lora else {})}
    w = InferenceWorker(model_dir, url, pool="H800", max_batch=64, version=0, threads=1,
                        engine_options=options)
    vocab = w.engine.model.config.vocab_size
    stop = asyncio.Event()
    users = [asyncio.ensure_future(conversation(w, i, spec, vocab, stop))
             for i in range(load)]
    await asyncio.sleep(settle)  # the load is running, contexts of many lengths in flight
    before = await w.stats()
    t0 = time.perf_counter()
    await trainer.send("go")
    rows = [json.loads(await trainer.line()) for _ in range(updates + 1)]
    wall = time.perf_counter() - t0
    after = await w.stats()
    if publish:
        await w.wait_version(updates, timeout=120)
    stop.set()
    await asyncio.gather(*users, return_exceptions=True)
    await w.close()
    await trainer.send("done")
    memory = json.loads(await trainer.line())  # the trainer process's, so far
    n = max(updates, 1)
    looks = after["watches"] - before["watches"]  # at the store, in the window
    return {"tok_s": (after["tokens_generated"] - before["tokens_generated"]) / wall,
            "engine_stall_ms": 1000 * (after["stall_seconds"] - before["stall_seconds"]) / n,
            "recompute_tokens": (after["recompute_tokens"] - before["recompute_tokens"]) / n,
            "fetch_s": (after["prefetch_seconds"] - before["prefetch_seconds"]) / n,
            "put_s": sum(r["put_s"] for r in rows) / n,
            "step_s": sorted(r["step_s"] for r in rows)[len(rows) // 2],
            "swaps_in_window": after["version"] - before["version"], "wall_s": wall,
            "watches_s": looks / wall,
            "watch_ms": 1000 * (after["watch_seconds"] - before["watch_seconds"])
            / max(looks, 1),
            "watch_cpu_ms": 1000 * (after["watch_cpu_seconds"] - before["watch_cpu_seconds"])
            / max(looks, 1),
            "bytes": sum(r["bytes"] for r in rows) / n,
            "rss_peak_mib": memory["rss_peak_kib"] / 1024,
            "rss_train_mib": (memory["rss_peak_kib"] - memory["rss_loaded_kib"]) / 1024}


#: the runs ``--runs`` picks from, in the order they are made (``baseline`` is two runs:
#: the first and the last; ``mooncake`` its idle run and its updates; ``lora`` one run per
#: ``--lora`` rank)
RUNS = ("baseline", "fsspec", "keep", "mooncake", "lora")


async def all_runs(model_dir: str, tmp: Path, updates: int, spec: dict, load: int,
                   settle: float, mb: float, ranks: list[int],
                   runs: tuple[str, ...] = RUNS) -> dict:
    """Baseline, fsspec, fsspec keep, Mooncake, LoRA per rank, baseline, as ``runs``
    picks them (the baseline always). The full-weight runs share one trainer process; each
    LoRA rank has one of its own (its peak memory is its own)."""
    from rollart import LoRA

    full = await TrainerProcess(model_dir, updates, spec).start()
    out = {}

    async def run(name, key, trainer, url, publish, lora=None, weight_update="recompute"):
        r = await measure(trainer, url, model_dir, updates, publish, spec, load, settle,
                          lora, weight_update)
        sent = f"; {r['bytes'] / 2**20:.3f} MiB/version" if publish else ""
        print(f"{name:9s} {r['tok_s']:.0f} decode tok/s; trainer step {r['step_s']:.2f} s;"
              f" engine stall {r['engine_stall_ms']:.1f} ms/update; fetch (hidden) "
              f"{r['fetch_s']:.3f} s; put {r['put_s']:.3f} s; {r['swaps_in_window']} swaps"
              f"{sent}", flush=True)
        out[key] = r

    try:
        await run("baseline", "base_a", full, str(tmp / "w-base-a"), False)
        if "fsspec" in runs:
            await run("fsspec", "fsspec", full, str(tmp / "w-fsspec"), True)
        if "keep" in runs:
            await run("keep", "keep", full, str(tmp / "w-keep"), True, weight_update="keep")
        if "mooncake" in runs:
            from rollart.weights import MooncakeMaster

            with MooncakeMaster() as master:
                buf = max(64, int(mb * 2) + 16)
                # watching a Mooncake store, publishing nothing: the baseline's run on
                # Mooncake (the baselines watch a folder), so that what updates cost on
                # Mooncake is told apart from what watching it costs
                await run("mc idle", "mooncake_idle", full, master.url(
                    "bench-idle", segment_mb=buf * 5, buffer_mb=buf), False)
                await run("mooncake", "mooncake", full, master.url(
                    "bench", segment_mb=buf * 5, buffer_mb=buf), True)
        for rank in ranks if "lora" in runs else ():
            proc = await TrainerProcess(model_dir, updates, spec).start()
            try:
                await run(f"lora r{rank}", f"lora{rank}", proc, str(tmp / f"w-lora{rank}"),
                          True, LoRA(rank=rank).peft_options())
            finally:
                await proc.close()
        await run("baseline", "base_b", full, str(tmp / "w-base-b"), False)
    finally:
        await full.close()
    for name, r in [("full", out["base_a"])] + [(k, r) for k, r in out.items()
                                                if k.startswith("lora")]:
        print(f"memory    {name}: trainer peak RSS {r['rss_peak_mib']:.0f} MiB, "
              f"{r['rss_train_mib']:.0f} MiB of it over the loaded model and batch",
              flush=True)
    return out


def parameters(model_dir: str) -> tuple[int, int]:
    """``(parameters, of which the embedding's)`` of the model folder (tied weights once),
    counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return (sum(p.numel() for p in model.parameters()),
            model.get_input_embeddings().weight.numel())


def results(out: dict, ranks: list[int]) -> dict:
    """The RESULT fields of ``all_runs``' figures (those of the runs it made)."""
    base = (out["base_a"]["tok_s"] + out["base_b"]["tok_s"]) / 2
    fields = {f"stall_{k}": 1 - out[s]["tok_s"] / base
              for k, s in (("fsspec", "fsspec"), ("mooncake", "mooncake"),
                           ("recompute", "fsspec"), ("keep", "keep")) if s in out}
    fields.update({"tok_s_base": base, "tok_s_base_a": out["base_a"]["tok_s"],
                   "tok_s_base_b": out["base_b"]["tok_s"]})
    if "mooncake_idle" in out:
        idle = out["mooncake_idle"]["tok_s"]
        fields.update({"stall_mooncake_idle": 1 - idle / base, "tok_s_mooncake_idle": idle,
                       "stall_mooncake_updates": 1 - out["mooncake"]["tok_s"] / idle})
    for s in ("base_a", "fsspec", "mooncake_idle", "mooncake"):
        if s in out:
            fields.update({f"watch_ms_{s}": out[s]["watch_ms"],
                           f"watch_cpu_ms_{s}": out[s]["watch_cpu_ms"],
                           f"watches_s_{s}": out[s]["watches_s"]})
    for s in ("fsspec", "keep", "mooncake"):
        if s in out:
            fields.update({f"tok_s_{s}": out[s]["tok_s"],
                           f"engine_stall_ms_{s}": out[s]["engine_stall_ms"],
                           f"recompute_tokens_{s}": out[s]["recompute_tokens"],
                           f"fetch_s_{s}": out[s]["fetch_s"], f"put_s_{s}": out[s]["put_s"],
                           f"update_s_{s}": update_s(out[s]),
                           f"swaps_{s}": out[s]["swaps_in_window"]})
    full = next((out[s]["bytes"] for s in ("fsspec", "keep", "mooncake") if s in out), None)
    if full is not None:
        fields["bytes_full"] = full
    if "fsspec" in out:  # the headline: full weights through the default store
        fields.update(publish_s=out["fsspec"]["put_s"], update_s=update_s(out["fsspec"]))
    for k in (f"lora{r}" for r in ranks):
        if k not in out:
            continue
        r = out[k]
        fields.update({f"bytes_{k}": r["bytes"],
                       **({f"bytes_ratio_{k}": r["bytes"] / full} if full else {}),
                       f"stall_{k}": 1 - r["tok_s"] / base, f"tok_s_{k}": r["tok_s"],
                       f"engine_stall_ms_{k}": r["engine_stall_ms"],
                       f"fetch_s_{k}": r["fetch_s"], f"put_s_{k}": r["put_s"],
                       f"update_s_{k}": update_s(r),
                       f"swaps_{k}": r["swaps_in_window"], f"trainer_step_s_{k}": r["step_s"]})
    for name, r in [("full", out["base_a"])] + [(k, r) for k, r in out.items()
                                                if k.startswith("lora")]:
        fields.update({f"rss_peak_mib_{name}": r["rss_peak_mib"],
                       f"rss_train_mib_{name}": r["rss_train_mib"]})
    fields["trainer_step_s"] = out["base_a"]["step_s"]
    return fields


def update_s(r: dict) -> float:
    """Seconds a version cost the worker: pulling and staging it (its prefetch thread,
    beside decoding) plus the engine's stall for it (swap and KV re-prefill)."""
    return r["fetch_s"] + r["engine_stall_ms"] / 1000


#: the tiny model's workload (the default, CI's) and a pretrained model's (``--model``:
#: SmolLM2-135M-Instruct's trainer step costs tens of seconds on one core, so fewer,
#: shorter runs; fixed before any run: about 12 minutes on 2 cores). ``updates`` None:
#: 4 with --quick, else 12
TOY = {"updates": None, "load": 8, "prompt": 192, "tokens": 32, "obs": 32, "turns": 6,
       "batch": 16, "runs": ",".join(RUNS), "fanout": "1,2,4,8"}
REAL = {"updates": 3, "load": 4, "prompt": 128, "tokens": 32, "obs": 32, "turns": 3,
        "batch": 4, "runs": "baseline,fsspec,keep", "fanout": ""}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    p.add_argument("--model", default=None,
                   help="a model folder or known name (smollm2-135m-instruct) instead of "
                        "the tiny model built here; its own defaults (REAL)")
    p.add_argument("--runs", default=None,
                   help=f"the runs to make (comma list of {', '.join(RUNS)}; the baseline "
                        f"always; default all, with --model {REAL['runs']})")
    p.add_argument("--updates", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="model hidden size")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lora", default="8,64",
                   help="LoRA ranks, one more run each (comma list; '' for none)")
    p.add_argument("--kl", type=float, default=0.05, help="the trainer's GRPO kl_coef")
    p.add_argument("--load", type=int, default=None, help="concurrent conversations (8)")
    p.add_argument("--prompt", type=int, default=None, help="first message, tokens (192)")
    p.add_argument("--tokens", type=int, default=None, help="generated tokens per turn (32)")
    p.add_argument("--obs", type=int, default=None, help="observation tokens per turn (32)")
    p.add_argument("--turns", type=int, default=None, help="turns (6)")
    p.add_argument("--batch", type=int, default=None, help="trajectories per trainer step "
                                                           "(16)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of load before each measured window")
    p.add_argument("--fanout", default=None,
                   help="reader processes per fan-out run (comma list; '' for none; "
                        "default 1,2,4,8, with --model none)")
    p.add_argument("--fanout-buckets", type=int, default=16,
                   help="buckets of the fan-out version")
    p.add_argument("--fanout-versions", type=int, default=None,
                   help="versions pulled per K (default 1 with --quick, else 3)")
    p.add_argument("--fanout-only", action="store_true",
                   help="only the fan-out (no stall, LoRA or memory runs)")
    add_arguments(p)
    a = p.parse_args(argv)
    run = Run("weight_sync", a, argv)
    if a.quick and a.model:
        p.error("--quick is the tiny model's smoke run: leave out --model (or --quick)")
    fill(a, REAL if a.model else TOY)
    runs = tuple(r.strip() for r in a.runs.split(",") if r.strip())
    if set(runs) - set(RUNS) or "baseline" not in runs:
        p.error(f"--runs takes a comma list of {', '.join(RUNS)} with baseline among them, "
                f"got {a.runs!r}")
    updates = a.updates or (4 if a.quick else 12)
    hidden, layers = a.hidden or (256 if a.quick else 512), a.layers or (4 if a.quick else 8)
    ranks = [int(r) for r in a.lora.split(",") if r.strip()] if "lora" in runs else []
    ks = [int(k) for k in a.fanout.split(",") if k.strip()]
    if any(k < 1 for k in ks) or a.fanout_buckets < 1:
        p.error("--fanout takes reader counts >= 1 and --fanout-buckets at least 1")
    fan_versions = a.fanout_versions or (1 if a.quick else 3)
    spec = {"prompt": a.prompt, "tokens": a.tokens, "obs": a.obs, "turns": a.turns,
            "batch": a.batch, "group": min(8, a.batch), "kl": a.kl}
    context = a.prompt + a.turns * (a.tokens + a.obs)

    from rollart.app.cli import quiet

    quiet()
    import torch

    from rollart import LoRA
    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model
    from rollart.pretrained import resolve_model

    for r in ranks:
        LoRA(rank=r)  # a bad rank fails here, with what to change
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="rollart-wsync-"))
    if a.model:
        model_dir = resolve_model(a.model)
        about = f"{a.model}"
    else:
        model_dir = build_tiny_model(tmp / "model", task_corpus(list(BUILTIN_TASKS)),
                                     hidden_size=hidden, num_layers=layers,
                                     num_heads=a.heads,
                                     max_positions=max(1024, context + a.tokens))
        about = f"hidden {hidden}, {layers} layers, {a.heads} heads"
    mb = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
    params, embedding = parameters(model_dir)
    print(f"model: {about}, {params / 1e6:.1f} M "
          f"parameters ({embedding / 1e6:.2f} M of them the embedding), {mb:.1f} MiB; "
          f"{updates} updates; {a.load} conversations of up to {context} tokens; trainer "
          f"batch {a.batch} × {context} tokens, kl_coef {a.kl}; runs {', '.join(runs)}; "
          f"LoRA ranks {ranks}", flush=True)

    fields = {}
    try:
        if not a.fanout_only:
            out = asyncio.run(all_runs(model_dir, tmp, updates, spec, a.load, a.settle,
                                       mb, ranks, runs))
            fields = results(out, ranks)
        if ks:
            fields.update(fanout(model_dir, ks, fan_versions, a.fanout_buckets))
    finally:  # the stores' versions: gigabytes for a pretrained model
        shutil.rmtree(tmp, ignore_errors=True)
    fields.update(model_mib=mb, params_m=params / 1e6, context=context, updates=updates,
                  model=a.model or "tiny")
    run.result(fields)
    return fields


if __name__ == "__main__":
    main()
