"""KV-transfer benchmark: PD disaggregation's KV moves vs raw loopback, PD vs colocated
generation, and prefix reuse with and without stickiness — measured side by side.

1. **Transfer**: a prefill worker process holds a ``KVHandoff`` of a realistic size (a
   7B-class model's fp16 cache: 28 layers × 2 × 4 KV heads × 128 dims per token); the
   decode worker process fetches it exactly as ``InferenceWorker.decode`` does
   (``rollart.rollout.kv.fetch``, Dask's worker-to-worker comms). The rate is compared
   with a raw TCP socket copy of the same bytes between two processes over loopback.
   Once over ``tcp://`` and, when ``distributed-ucxx`` is installed (extra ``ucx``), over
   ``ucxx://`` (``UCX_NET_DEVICES=lo``); ``nan`` otherwise.
2. **PD vs colocated**: concurrent requests of a prefill-heavy task (long prompt, few new
   tokens) and a decode-heavy task (short prompt, many new tokens) through ``LLMProxy``,
   once with prefill on the H800 worker and decode on the H20 worker, once colocated
   (least-loaded over both); requests/s ratio.
3. **Prefix reuse**: multi-turn trajectories through the proxy with and without prefix
   stickiness; the fraction of prompt tokens the engines found cached.

Prints one line ``RESULT pd_vs_raw_tcp=… pd_vs_raw_ucx=… prefix_reuse=… …``.

    python benchmarks/kv_transfer.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import random
import socket
import tempfile
import time
import types

BYTES_PER_TOKEN = 28 * 2 * 4 * 128 * 2  # layers × (k, v) × KV heads × head dim × fp16


# -- raw loopback ------------------------------------------------------------------------
def _receiver(port_q, n: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(n))
    got = 0
    while got < n:
        got += conn.recv_into(buf[got:], min(n - got, 1 << 22))
    conn.sendall(b"k")
    conn.close()
    srv.close()


def raw_rate(nbytes: int, repeats: int) -> float:
    """Best bytes/s of a plain TCP socket copy between two processes over 127.0.0.1."""
    payload = os.urandom(nbytes)
    best = math.inf
    ctx = mp.get_context("fork")
    for _ in range(repeats):
        q = ctx.Queue()
        proc = ctx.Process(target=_receiver, args=(q, nbytes))
        proc.start()
        sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
        t0 = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        best = min(best, time.perf_counter() - t0)
        sock.close()
        proc.join()
    return nbytes / best


# -- Dask worker to worker ---------------------------------------------------------------
def make_handoff(nbytes: int):
    """A KVHandoff of about ``nbytes`` (runs on the prefill worker)."""
    import torch

    from rollart.rollout.pd import pack

    tokens = max(1, nbytes // BYTES_PER_TOKEN)
    kv = torch.randn(28, 2, 4, tokens, 128).to(torch.float16)
    return pack(kv, torch.zeros(32000), version=0, source="")


async def timed_fetch(key: str, source: str, dask_worker=None) -> float:
    """Seconds ``rollart.rollout.kv.fetch`` takes to bring ``key`` here (decode worker)."""
    from rollart.rollout.kv import fetch

    actor = types.SimpleNamespace(kv_stats={"received": 0, "bytes_received": 0,
                                            "fetch_seconds": 0.0})
    t0 = time.perf_counter()
    await fetch(actor, {"key": key, "source": source}, worker=dask_worker)
    return time.perf_counter() - t0


def cluster(protocol: str, tags, threads: int = 1):
    from distributed import Nanny, Scheduler, SpecCluster

    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "UCX_NET_DEVICES": "lo"}
    workers = {t: {"cls": Nanny, "options": {"nthreads": threads, "resources": {t: 1},
                                            "protocol": protocol, "host": "127.0.0.1",
                                            "env": env, "dashboard": False,
                                            "memory_limit": 0}} for t in tags}
    sched = {"cls": Scheduler, "options": {"protocol": protocol, "host": "127.0.0.1",
                                           "dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=sched, name=f"kv-{protocol}")


def dask_rate(protocol: str, nbytes: int, repeats: int) -> float:
    """Best bytes/s of a KVHandoff fetched by the H20 process from the H800 process."""
    from distributed import Client, wait

    from rollart.resources import workers_with
    from rollart.types import H20, H800

    with cluster(protocol, (H800, H20)) as cl, Client(cl) as c:
        prefill, decode = workers_with(c, H800)[0], workers_with(c, H20)[0]
        best = math.inf
        for _ in range(repeats):
            fut = c.submit(make_handoff, nbytes, workers=[prefill], pure=False)
            wait(fut)  # made and held on the prefill worker; the driver never sees it
            dt = c.run(timed_fetch, fut.key, prefill, workers=[decode])[decode]
            best = min(best, dt)
            del fut
        return actual_bytes(nbytes) / best


def actual_bytes(nbytes: int) -> int:
    return max(1, nbytes // BYTES_PER_TOKEN) * BYTES_PER_TOKEN


def ucx_available() -> bool:
    try:
        import distributed_ucxx  # noqa: F401
    except ImportError:
        return False
    return True


# -- generation through the proxy --------------------------------------------------------
class Host:
    """Runs the proxy on a worker's event loop, like an env manager does."""

    def __init__(self, proxy):
        self.proxy = proxy

    async def burst(self, reqs, task, tag):
        t0 = time.perf_counter()
        out = await asyncio.gather(*[self.proxy.generate(f"{tag}-{i}", r, task=task)
                                     for i, r in enumerate(reqs)])
        return time.perf_counter() - t0, sum(len(o.token_ids) for o in out)

    async def play(self, n_traj: int, n_turns: int, prompt: int, new: int, tag: str):
        from rollart.types import GenRequest

        rng = random.Random(len(tag))

        async def one(i):
            ids = [3 + (i * 7 + j) % 40 for j in range(prompt)]
            for turn in range(n_turns):
                await asyncio.sleep(rng.uniform(0, 0.05))  # env steps take varying time
                res = await self.proxy.generate(f"{tag}-{i}", GenRequest(list(ids), new,
                                                                         temperature=0.0))
                ids += res.token_ids + [5 + (i + turn + k) % 30 for k in range(6)]
            self.proxy.release(f"{tag}-{i}")

        await asyncio.gather(*[one(i) for i in range(n_traj)])


def generation(quick: bool) -> dict:
    from distributed import Client

    from rollart.affinity import Affinity
    from rollart.model import build_tiny_model
    from rollart.rollout import InferenceWorker, LLMProxy
    from rollart.types import CPU_ENV, H20, H800, GenRequest

    tmp = tempfile.mkdtemp(prefix="rollart-kv-")
    model = build_tiny_model(os.path.join(tmp, "m"), [f"w{i}" for i in range(200)])
    n = 8 if quick else 24
    out = {}
    with cluster("tcp", (H800, H20, CPU_ENV)) as cl, Client(cl) as c:
        ws = {t: c.submit(InferenceWorker, model, os.path.join(tmp, "store"), pool=t,
                          threads=1, actor=True, resources={t: 1}).result()
              for t in (H800, H20)}
        routes = {"pd": Affinity(prefill=H800, decode=H20)}
        pairs = [(w, t) for t, w in ws.items()]
        host = c.submit(Host, LLMProxy(pairs, routes=routes), actor=True,
                        resources={CPU_ENV: 1}).result()
        loose = c.submit(Host, LLMProxy(pairs, sticky=False), actor=True,
                         resources={CPU_ENV: 1}).result()
        shapes = {"prefill": (384, 4), "decode": (16, 96 if not quick else 48)}
        for kind, (plen, new) in shapes.items():
            reqs = [GenRequest([3 + (i + j) % 40 for j in range(plen)], new, temperature=0.0)
                    for i in range(n)]
            host.burst(reqs[:2], None, f"warm-{kind}").result()
            t_pd, _ = host.burst(reqs, "pd", f"pd-{kind}").result()
            t_colo, _ = host.burst(reqs, None, f"colo-{kind}").result()
            out[f"pd_vs_colo_{kind}"] = t_colo / t_pd
        trajs, turns = (8, 4) if quick else (24, 6)
        for name, h in (("prefix_reuse", host), ("prefix_reuse_nosticky", loose)):
            before = [w.stats().result() for w in ws.values()]
            h.play(trajs, turns, 24, 6, name).result()
            after = [w.stats().result() for w in ws.values()]
            hit = sum(a["prefix_hit_tokens"] - b["prefix_hit_tokens"]
                      for a, b in zip(after, before))
            tot = sum(a["prefix_prompt_tokens"] - b["prefix_prompt_tokens"]
                      for a, b in zip(after, before))
            out[name] = hit / max(tot, 1)
        for w in ws.values():
            w.close().result()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller caches, fewer repeats")
    ap.add_argument("--mib", type=int, nargs="*", help="KV cache sizes to move (MiB)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--transfer-only", action="store_true",
                    help="only the KV transfer part (e.g. in a venv with the ucx extra)")
    args = ap.parse_args()
    sizes = args.mib or ([16, 64] if args.quick else [16, 64, 256])
    repeats = args.repeats or (3 if args.quick else 5)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    rows, result = [], {}
    for mib in sizes:
        n = actual_bytes(mib << 20)
        raw = raw_rate(n, repeats)
        tcp = dask_rate("tcp", n, repeats)
        ucx = dask_rate("ucxx", n, repeats) if ucx_available() else float("nan")
        rows.append((mib, raw, tcp, ucx))
        print(f"KV {mib:4d} MiB ({n // BYTES_PER_TOKEN} tokens of a 7B fp16 cache): "
              f"raw loopback {raw / 2**30:6.2f} GiB/s | dask tcp {tcp / 2**30:6.2f} GiB/s "
              f"({tcp / raw:.2f}) | dask ucxx {ucx / 2**30:6.2f} GiB/s ({ucx / raw:.2f})",
              flush=True)
    mib, raw, tcp, ucx = rows[-1]  # the headline: the largest (most realistic) cache
    result.update(pd_vs_raw_tcp=tcp / raw, pd_vs_raw_ucx=ucx / raw,
                  raw_gibps=raw / 2**30, tcp_gibps=tcp / 2**30, ucx_gibps=ucx / 2**30,
                  kv_mib=mib)
    gen = {} if args.transfer_only else generation(args.quick)
    for k, v in gen.items():
        print(f"{k}: {v:.3f}", flush=True)
    result.update(gen)
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in result.items()))


if __name__ == "__main__":
    main()
