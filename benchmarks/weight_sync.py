"""Weight-sync benchmark: the rollout stall each policy update causes, Mooncake vs fsspec.

A trainer process publishes versions 1..N to the weight store, one per trainer step (the
step time is measured: a real forward/backward/AdamW step of the same model), without
waiting for readers. An ``InferenceWorker`` in this process keeps generating under load
(``--load`` concurrent requests); each announced version is prefetched in the background
and swapped in at the next decode-step boundary. The stall is what generation loses per
update (the swap plus re-prefilling the in-flight rows' KV), as counted by the engine;

    stall_fraction = total stall / (N × trainer step time)

Both backends run side by side on the same model and load: Mooncake (a local
``mooncake_master``, trainer and reader in different processes over the TCP transfer
engine) and fsspec (a local folder). ``fetch_s_*`` is the time the prefetch hid per
update (a worker without prefetch would stall that much longer). Prints

    RESULT stall_fraction_mooncake=… stall_fraction_fsspec=… trainer_step_s=… …

    python benchmarks/weight_sync.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

PUBLISHER = """
import sys, time
from rollart.model import load_model
from rollart.weights import WeightStore
url, model_dir, n, period = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
store = WeightStore(url)
sd = load_model(model_dir).state_dict()
store.put(0, sd)
print("ready", flush=True)
sys.stdin.readline()
for v in range(1, n + 1):
    time.sleep(period)  # the trainer computing step v
    t = time.perf_counter()
    store.put(v, {k: x + 1e-3 * v for k, x in sd.items()})
    store.gc(3)
    print(v, time.perf_counter() - t, flush=True)
sys.stdin.readline()  # Mooncake objects live in this process: stay until the reader is done
"""


def trainer_step_seconds(model_dir: str, batch: int = 16, length: int = 128) -> float:
    """Median wall time of one forward/backward/AdamW step of the model."""
    import torch

    from rollart.model import load_model

    model = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


async def measure(url: str, model_dir: str, updates: int, period: float, load: int,
                  tokens: int) -> dict:
    from rollart.rollout import InferenceWorker
    from rollart.types import GenRequest

    pub = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PUBLISHER, url, model_dir, str(updates), str(period),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    line = await pub.stdout.readline()
    if line.strip() != b"ready":
        raise RuntimeError(f"publisher did not start ({line!r}); run it by hand to see why")
    w = InferenceWorker(model_dir, url, pool="H800", max_batch=64, version=0)
    stop = asyncio.Event()

    async def user(i: int):
        k = 0
        while not stop.is_set():
            await w.generate(GenRequest([3 + i % 7, 4, 5 + k % 11], max_new_tokens=tokens,
                                        temperature=1.0, seed=1000 * i + k))
            k += 1

    users = [asyncio.ensure_future(user(i)) for i in range(load)]
    await asyncio.sleep(1.0)  # the load is running
    before = await w.stats()
    t0 = time.perf_counter()
    pub.stdin.write(b"go\n")
    await pub.stdin.drain()
    put_s = []
    for _ in range(updates):
        v, dt = (await pub.stdout.readline()).split()
        put_s.append(float(dt))
        await w.update_weights(int(v))  # returns at once: the prefetch thread fetches it
    await w.wait_version(updates, timeout=120)
    wall = time.perf_counter() - t0
    after = await w.stats()
    stop.set()
    await asyncio.gather(*users, return_exceptions=True)
    await w.close()
    pub.stdin.write(b"done\n")
    await pub.stdin.drain()
    await pub.wait()
    stall = after["stall_seconds"] - before["stall_seconds"]
    return {"stall_fraction": stall / (updates * period),
            "stall_ms": 1000 * stall / updates,
            "fetch_s": (after["prefetch_seconds"] - before["prefetch_seconds"]) / updates,
            "put_s": sum(put_s) / len(put_s),
            "tokens_per_s": (after["tokens_generated"] - before["tokens_generated"]) / wall,
            "prefetches": after["prefetches"] - before["prefetches"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a minute or two on 2 cores")
    p.add_argument("--updates", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="model hidden size")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--load", type=int, default=8, help="concurrent generation requests")
    p.add_argument("--tokens", type=int, default=48, help="max new tokens per request")
    a = p.parse_args(argv)
    updates = a.updates or (5 if a.quick else 20)
    hidden, layers = a.hidden or (256 if a.quick else 512), a.layers or (4 if a.quick else 8)

    from rollart.cli import quiet

    quiet()
    import torch

    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model
    from rollart.weights import MooncakeMaster

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="rollart-wsync-"))
    model_dir = build_tiny_model(tmp / "model", task_corpus(list(BUILTIN_TASKS)),
                                 hidden_size=hidden, num_layers=layers, num_heads=4)
    mb = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
    step_s = trainer_step_seconds(model_dir)
    print(f"model: hidden {hidden}, {layers} layers, {mb:.1f} MiB; trainer step "
          f"{step_s:.2f} s; {updates} updates under {a.load} concurrent requests")
    out = {}
    with MooncakeMaster() as master:
        buf = max(64, int(mb * 2) + 16)
        url = master.url("bench", segment_mb=buf * 5, buffer_mb=buf)
        out["mooncake"] = asyncio.run(measure(url, model_dir, updates, step_s, a.load,
                                              a.tokens))
    out["fsspec"] = asyncio.run(measure(str(tmp / "weights"), model_dir, updates, step_s,
                                        a.load, a.tokens))
    for name, r in out.items():
        print(f"{name:9s} stall {r['stall_ms']:.1f} ms/update = {r['stall_fraction']:.3f} "
              f"of a step; fetch (hidden) {r['fetch_s']:.3f} s; put {r['put_s']:.3f} s; "
              f"{r['tokens_per_s']:.0f} tok/s; {r['prefetches']} prefetches")
    fields = {"stall_fraction_mooncake": out["mooncake"]["stall_fraction"],
              "stall_fraction_fsspec": out["fsspec"]["stall_fraction"],
              "trainer_step_s": step_s, "model_mib": mb,
              "fetch_s_mooncake": out["mooncake"]["fetch_s"],
              "fetch_s_fsspec": out["fsspec"]["fetch_s"],
              "stall_ms_mooncake": out["mooncake"]["stall_ms"],
              "stall_ms_fsspec": out["fsspec"]["stall_ms"]}
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in fields.items()))
    return fields


if __name__ == "__main__":
    main()
