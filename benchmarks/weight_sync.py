"""Weight-sync benchmark: decode throughput lost to policy updates, Mooncake vs fsspec.

A trainer process runs rollart's ``Trainer`` (the same ``_update`` a ``train_step``
runs: GRPO loss, backward over micro-batches, AdamW) on real batches of agent-length
trajectories of the model (multi-turn token sequences of ``--context`` tokens, their
behaviour log-probs computed by the model before the run), one thread. After each of
its first ``N`` steps it publishes the new version to the weight store (``WeightStore``
``put``, the same as ``Trainer.publish``); a last step runs without publishing, so
each update has a trainer step to arrive in. Meanwhile an ``InferenceWorker`` in this
process (one thread) serves ``--load`` concurrent multi-turn conversations (each turn
sends the whole context: a ``--prompt``-token first message, then per turn
``--tokens`` generated and ``--obs`` observation tokens, up to ``--turns`` turns), and
pulls each version itself (its prefetch thread watches the store, stages the weights,
swaps at a decode-step boundary and re-prefills the in-flight rows' KV).

The same run is made without publishing (the trainer computes identically, the worker
never updates): the baseline. Both are measured side by side in one invocation over
the same window (from the trainer's first step to the end of its last), in the order
baseline, fsspec, Mooncake, baseline; the baseline is the mean of its two runs. Per
store:

    stall_<store> = 1 − decode tokens/s with updates ÷ decode tokens/s without

Mooncake is a local ``mooncake_master`` with trainer and reader in different processes
over its TCP transfer engine; fsspec a local folder.

RESULT keys: ``stall_fsspec``, ``stall_mooncake`` (fraction of decode tokens/s lost;
negative = within noise of none); ``tok_s_base`` (mean of ``tok_s_base_a``/``_b``, to
judge the noise), ``tok_s_fsspec``, ``tok_s_mooncake``; ``engine_stall_ms_<store>``
(per update, swap + KV recompute as the engine counts it) and
``fetch_s_<store>`` (per update, the prefetch the worker hid) and ``put_s_<store>``;
``trainer_step_s``, ``model_mib``, ``context`` (longest context, tokens), ``updates``.

    python benchmarks/weight_sync.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

TRAINER = """
import copy, json, os, random, sys, time
import torch
from rollart.config.graph import GRPO
from rollart.trainer.trainer import Trainer
from rollart.types import Trajectory
from rollart.weights import WeightStore
model_dir, n, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)
trainer = Trainer(model_dir, sys.argv[4], GRPO(group_size=spec["group"], lr=1e-4), threads=1)
initial = copy.deepcopy(trainer.model.state_dict())
rng = random.Random(0)
vocab = trainer.model.config.vocab_size
def trajectory(i):
    ids = [rng.randrange(3, vocab) for _ in range(spec["prompt"])]
    mask = [0] * len(ids)
    for _ in range(spec["turns"]):
        ids += [rng.randrange(3, vocab) for _ in range(spec["tokens"] + spec["obs"])]
        mask += [1] * spec["tokens"] + [0] * spec["obs"]
    with torch.no_grad():  # the behaviour log-probs: the model's own
        logits = trainer.model(input_ids=torch.tensor([ids])).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    p = spec["prompt"]
    resp, m = ids[p:], mask[p:]
    return Trajectory(f"t{i}", "bench", f"g{i // spec['group']}", i, ids[:p], resp, m,
                      [x if k else 0.0 for x, k in zip(lp[p - 1:], m)],
                      [0 if k else -1 for k in m], reward=rng.random())
batch = [trajectory(i) for i in range(spec["batch"])]
for line in sys.stdin:  # one run per command: {"url": ..., "publish": ...}
    cmd = json.loads(line)
    if cmd.get("exit"):
        break
    trainer.model.load_state_dict(initial)  # every run starts from the same policy
    trainer.optimizer = trainer._make_optimizer()
    trainer.store, trainer.version = WeightStore(cmd["url"]), 0
    trainer._put_weights()  # version 0, as Trainer.publish does
    print("ready", flush=True)
    sys.stdin.readline()  # go
    for step in range(1, n + 2):
        t0 = time.perf_counter()
        trainer._update(batch)
        t1 = time.perf_counter()
        if cmd["publish"] and step <= n:
            trainer.version = step
            trainer._put_weights()
            trainer.store.gc(3)
        print(json.dumps({"step": step, "step_s": t1 - t0,
                          "put_s": time.perf_counter() - t1}), flush=True)
    sys.stdin.readline()  # done: Mooncake objects live here until the reader is through
    print("finished", flush=True)
# leave without tearing down the Mooncake client: its master is gone by now, and the
# teardown's calls to it time out (seconds, after every figure was taken)
sys.stdout.flush()
os._exit(0)
"""


class TrainerProcess:
    """The trainer in a process of its own (one thread), driven line by line."""

    def __init__(self, model_dir: str, updates: int, spec: dict, url: str):
        self.args = (model_dir, str(updates), json.dumps(spec), url)
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
                  publish: bool, spec: dict, load: int, settle: float) -> dict:
    """One run: the trainer's ``updates + 1`` steps under ``load`` conversations."""
    from rollart.rollout import InferenceWorker

    await trainer.send({"url": url, "publish": publish})
    if (await trainer.line()).strip() != b"ready":
        raise RuntimeError("the trainer process did not get ready")
    w = InferenceWorker(model_dir, url, pool="H800", max_batch=64, version=0, threads=1)
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
    await trainer.line()
    n = max(updates, 1)
    return {"tok_s": (after["tokens_generated"] - before["tokens_generated"]) / wall,
            "engine_stall_ms": 1000 * (after["stall_seconds"] - before["stall_seconds"]) / n,
            "fetch_s": (after["prefetch_seconds"] - before["prefetch_seconds"]) / n,
            "put_s": sum(r["put_s"] for r in rows) / n,
            "step_s": sorted(r["step_s"] for r in rows)[len(rows) // 2],
            "swaps_in_window": after["version"] - before["version"], "wall_s": wall}


async def all_runs(model_dir: str, tmp: Path, updates: int, spec: dict, load: int,
                   settle: float, mb: float) -> dict:
    """Baseline, fsspec, Mooncake, baseline: one trainer process for all four."""
    from rollart.weights import MooncakeMaster

    trainer = await TrainerProcess(model_dir, updates, spec, str(tmp / "w-init")).start()
    out = {}

    async def run(name, key, url, publish):
        r = await measure(trainer, url, model_dir, updates, publish, spec, load, settle)
        print(f"{name:9s} {r['tok_s']:.0f} decode tok/s; trainer step {r['step_s']:.2f} s;"
              f" engine stall {r['engine_stall_ms']:.1f} ms/update; fetch (hidden) "
              f"{r['fetch_s']:.3f} s; put {r['put_s']:.3f} s; {r['swaps_in_window']} swaps",
              flush=True)
        out[key] = r

    try:
        await run("baseline", "base_a", str(tmp / "w-base-a"), False)
        await run("fsspec", "fsspec", str(tmp / "w-fsspec"), True)
        with MooncakeMaster() as master:
            buf = max(64, int(mb * 2) + 16)
            await run("mooncake", "mooncake", master.url("bench", segment_mb=buf * 5,
                                                         buffer_mb=buf), True)
        await run("baseline", "base_b", str(tmp / "w-base-b"), False)
    finally:
        await trainer.close()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    p.add_argument("--updates", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="model hidden size")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--load", type=int, default=8, help="concurrent conversations")
    p.add_argument("--prompt", type=int, default=192, help="first message, tokens")
    p.add_argument("--tokens", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--obs", type=int, default=32, help="observation tokens per turn")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--batch", type=int, default=16, help="trajectories per trainer step")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of load before each measured window")
    a = p.parse_args(argv)
    updates = a.updates or (4 if a.quick else 12)
    hidden, layers = a.hidden or (256 if a.quick else 512), a.layers or (4 if a.quick else 8)
    spec = {"prompt": a.prompt, "tokens": a.tokens, "obs": a.obs, "turns": a.turns,
            "batch": a.batch, "group": min(8, a.batch)}
    context = a.prompt + a.turns * (a.tokens + a.obs)

    from rollart.app.cli import quiet

    quiet()
    import torch

    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="rollart-wsync-"))
    model_dir = build_tiny_model(tmp / "model", task_corpus(list(BUILTIN_TASKS)),
                                 hidden_size=hidden, num_layers=layers, num_heads=4,
                                 max_positions=max(1024, context + a.tokens))
    mb = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
    print(f"model: hidden {hidden}, {layers} layers, {mb:.1f} MiB; {updates} updates; "
          f"{a.load} conversations of up to {context} tokens; trainer batch "
          f"{a.batch} × {context} tokens", flush=True)

    out = asyncio.run(all_runs(model_dir, tmp, updates, spec, a.load, a.settle, mb))
    base = (out["base_a"]["tok_s"] + out["base_b"]["tok_s"]) / 2
    fields = {"stall_fsspec": 1 - out["fsspec"]["tok_s"] / base,
              "stall_mooncake": 1 - out["mooncake"]["tok_s"] / base,
              "tok_s_base": base, "tok_s_base_a": out["base_a"]["tok_s"],
              "tok_s_base_b": out["base_b"]["tok_s"]}
    for s in ("fsspec", "mooncake"):
        fields.update({f"tok_s_{s}": out[s]["tok_s"],
                       f"engine_stall_ms_{s}": out[s]["engine_stall_ms"],
                       f"fetch_s_{s}": out[s]["fetch_s"], f"put_s_{s}": out[s]["put_s"],
                       f"swaps_{s}": out[s]["swaps_in_window"]})
    fields.update(trainer_step_s=out["base_a"]["step_s"], model_mib=mb, context=context,
                  updates=updates)
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in fields.items()))
    return fields


if __name__ == "__main__":
    main()
