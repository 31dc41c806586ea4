"""KV-transfer benchmark: PD disaggregation's KV moves vs a raw loopback copy, PD vs
colocated generation, and prefix reuse with and without stickiness — side by side.

1. **Transfer**: a prefill worker process holds a ``KVHandoff`` of a realistic size (a
   7B-class model's fp16 cache: 28 layers × 2 × 4 KV heads × 128 dims per token); the
   decode worker process fetches it exactly as ``InferenceWorker.decode`` does
   (``rollart.rollout.kv.fetch``, Dask's worker-to-worker comms), over ``tcp://`` and,
   when ``distributed-ucxx`` is installed (extra ``ucx``), over ``ucxx://``
   (``UCX_NET_DEVICES=lo``; ``nan`` otherwise). The baseline is the strongest plain
   copy: a TCP socket between two processes over loopback, received with ``recv_into``
   into one buffer allocated and touched before any timed window, acknowledged per copy.
   Several sizes; each figure is the median of ``--repeats`` copies.
2. **PD vs colocated**: bursts of concurrent requests of a prefill-heavy shape (384
   prompt tokens, 4 new) and a decode-heavy one (16 prompt tokens, 48 new; 96 without
   ``--quick``) through ``LLMProxy``, with prefill on the H800 worker and decode on the
   H20 worker, then colocated (whole requests, least-loaded over both), alternating
   ``--reps`` times; the median ratio.
3. **Prefix reuse**: multi-turn trajectories through the proxy with and without prefix
   stickiness; the fraction of prompt tokens the engines found cached.

RESULT keys (one line, ``RESULT k=v …``):

* ``raw_gibps_<MiB>``, ``tcp_gibps_<MiB>``: median GiB/s per size;
  ``pd_vs_raw_tcp_<MiB>`` / ``pd_vs_raw_ucx_<MiB>``: Dask fetch rate ÷ raw copy rate
  (< 1: PD's transfer is slower than a plain copy); ``pd_vs_raw_tcp``/``_ucx``: at the
  largest size ``kv_mib``; ``raw_bytes_ok`` / ``dask_bytes_ok``: 1 when every copy
  delivered all its bytes (raw: and the receiver's buffer equals what was sent);
  ``repeats``.
* ``pd_vs_colo_prefill`` / ``pd_vs_colo_decode``: colocated burst time ÷ PD burst time
  (> 1: PD faster); ``rps_pd_*``, ``rps_colo_*``: requests/s; ``kv_kib_per_req_*`` and
  ``kv_fetch_ms_*``: the tiny model's KV per PD request and its fetch time.
* ``prefix_reuse``, ``prefix_reuse_nosticky``: cached fraction of prompt tokens.

    python benchmarks/kv_transfer.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import socket
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments  # noqa: E402

BYTES_PER_TOKEN = 28 * 2 * 4 * 128 * 2  # layers × (k, v) × KV heads × head dim × fp16


# -- raw loopback ------------------------------------------------------------------------
def _receiver(port_q, n: int, repeats: int, report_q) -> None:
    """Receive ``repeats`` copies of ``n`` bytes into ONE buffer allocated (and touched)
    before the first copy; acknowledge each; report bytes and a checksum of the last."""
    import zlib

    buf = bytearray(n)  # allocated here, outside every timed window
    pages = range(0, n, 4096)
    buf[::4096] = b"\x01" * len(pages)  # touch every page (calloc'd pages are lazy)
    view = memoryview(buf)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    total = 0
    for _ in range(repeats):
        conn.sendall(b"r")  # ready: the sender starts its clock after this
        got = 0
        while got < n:
            k = conn.recv_into(view[got:], min(n - got, 1 << 22))
            if k == 0:
                raise ConnectionError("sender closed early")
            got += k
        total += got
        conn.sendall(b"k")
    report_q.put((total, zlib.crc32(view)))
    conn.close()
    srv.close()


def raw_copy(nbytes: int, repeats: int) -> dict:
    """A plain TCP copy of ``nbytes`` between two processes over 127.0.0.1, ``repeats``
    times on one connection into a preallocated buffer (``recv_into``): per-copy seconds
    (send start to the receiver's acknowledgement), bytes the receiver got in all, and
    whether its last buffer equals what was sent (crc32)."""
    import zlib

    payload = os.urandom(nbytes)
    ctx = mp.get_context("spawn")  # this process may run a cluster's threads
    port_q, report_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port_q, nbytes, repeats, report_q))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
    times = []
    for _ in range(repeats):
        if sock.recv(1) != b"r":
            raise ConnectionError("receiver not ready")
        t0 = time.perf_counter()
        sock.sendall(payload)
        if sock.recv(1) != b"k":
            raise ConnectionError("receiver did not acknowledge")
        times.append(time.perf_counter() - t0)
    received, crc = report_q.get(timeout=60)
    sock.close()
    proc.join()
    return {"seconds": times, "received": received, "sent": nbytes * repeats,
            "intact": crc == zlib.crc32(payload)}


def median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# -- Dask worker to worker ---------------------------------------------------------------
def make_handoff(nbytes: int):
    """A KVHandoff of about ``nbytes`` (runs on the prefill worker)."""
    import torch

    from rollart.rollout.pd import pack

    tokens = max(1, nbytes // BYTES_PER_TOKEN)
    kv = torch.randn(28, 2, 4, tokens, 128).to(torch.float16)
    return pack(kv, torch.zeros(32000), version=0, source="")


async def timed_fetch(key: str, source: str, dask_worker=None) -> tuple[float, int]:
    """Seconds ``rollart.rollout.kv.fetch`` takes to bring ``key`` here (decode worker),
    and the bytes of KV it brought."""
    from rollart.rollout.kv import fetch

    actor = types.SimpleNamespace(kv_stats={"received": 0, "bytes_received": 0,
                                            "fetch_seconds": 0.0})
    t0 = time.perf_counter()
    handoff = await fetch(actor, {"key": key, "source": source}, worker=dask_worker)
    return time.perf_counter() - t0, int(handoff.data.nbytes)


def preimport() -> list[str]:
    """Import what the prefill, decode and proxy workers run (torch, the model code), so
    each worker process pays its imports at once, side by side, before any timed part."""
    import importlib

    names = ["torch", "transformers", "rollart.rollout", "rollart.rollout.kv",
             "rollart.rollout.pd"]
    for name in names:
        importlib.import_module(name)
    return names


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


def fetch_times(c, prefill: str, decode: str, nbytes: int, repeats: int) -> dict:
    """Seconds of each fetch of a fresh KVHandoff of ``nbytes`` by the decode worker
    from the prefill worker, and the KV bytes that arrived in all."""
    from distributed import wait

    times, got = [], 0
    for _ in range(repeats):
        fut = c.submit(make_handoff, nbytes, workers=[prefill], pure=False)
        wait(fut)  # made and held on the prefill worker; the driver never sees it
        dt, n = c.run(timed_fetch, fut.key, prefill, workers=[decode])[decode]
        times.append(dt)
        got += n
        del fut
    return {"seconds": times, "received": got}


def dask_fetches(c, sizes: list[int], repeats: int, raw: dict | None = None) -> dict:
    """Per KV size, ``fetch_times`` on the client ``c``'s cluster (H800 → H20). With
    ``raw`` (a dict), each size's raw copies run just before its fetches, so both see
    the same load on the machine; they land in ``raw``."""
    from rollart.runtime.resources import workers_with
    from rollart.types import H20, H800

    out = {}
    prefill, decode = workers_with(c, H800)[0], workers_with(c, H20)[0]
    fetch_times(c, prefill, decode, sizes[0], 1)  # warm: imports, first connection
    for nbytes in sizes:
        if raw is not None:
            raw[nbytes] = raw_copy(nbytes, repeats)
        out[nbytes] = fetch_times(c, prefill, decode, nbytes, repeats)
    return out


def ucx_fetches(sizes: list[int], repeats: int) -> dict:
    """``dask_fetches`` on a cluster started with the ``ucxx`` protocol."""
    from distributed import Client

    from rollart.types import H20, H800

    with cluster("ucxx", (H800, H20)) as cl, Client(cl) as c:
        return dask_fetches(c, sizes, repeats)


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


def pd_vs_colocated(host, ws, n: int, reps: int, decode_new: int) -> dict:
    """Per shape: bursts of ``n`` concurrent requests, PD and colocated alternating
    ``reps`` times; the median of colocated time ÷ PD time (> 1: PD faster), requests/s,
    and the KV bytes and fetch seconds per PD request."""
    from rollart.types import H20, GenRequest

    shapes = {"prefill": (384, 4), "decode": (16, decode_new)}
    out = {}
    for kind, (plen, new) in shapes.items():
        reqs = [GenRequest([3 + (i + j) % 40 for j in range(plen)], new, temperature=0.0)
                for i in range(n)]
        host.burst(reqs[:2], None, f"warm-{kind}").result()
        host.burst(reqs[:2], "pd", f"warm-pd-{kind}").result()
        kv0 = ws[H20].stats().result()
        ratios, t_pd, t_colo = [], [], []
        for r in range(reps):
            t_pd.append(host.burst(reqs, "pd", f"pd-{kind}-{r}").result()[0])
            t_colo.append(host.burst(reqs, None, f"colo-{kind}-{r}").result()[0])
            ratios.append(t_colo[-1] / t_pd[-1])
        kv1 = ws[H20].stats().result()
        moved = max(kv1["kv_received"] - kv0["kv_received"], 1)
        out[f"pd_vs_colo_{kind}"] = median(ratios)
        out[f"rps_pd_{kind}"] = n / median(t_pd)
        out[f"rps_colo_{kind}"] = n / median(t_colo)
        out[f"kv_kib_per_req_{kind}"] = (kv1["kv_bytes_received"]
                                         - kv0["kv_bytes_received"]) / moved / 1024
        out[f"kv_fetch_ms_{kind}"] = 1000 * (kv1["kv_fetch_seconds"]
                                             - kv0["kv_fetch_seconds"]) / moved
    return out


def generation(c, quick: bool, reps: int, n: int) -> dict:
    """PD vs colocated and prefix reuse on the client ``c``'s cluster (H800, H20, CPU_ENV)."""
    from rollart.policy.affinity import Affinity
    from rollart.model import build_tiny_model
    from rollart.rollout import InferenceWorker, LLMProxy
    from rollart.types import CPU_ENV, H20, H800

    tmp = tempfile.mkdtemp(prefix="rollart-kv-")
    model = build_tiny_model(os.path.join(tmp, "m"), [f"w{i}" for i in range(200)])
    starting = {t: c.submit(InferenceWorker, model, os.path.join(tmp, "store"), pool=t,
                            threads=1, actor=True, resources={t: 1}) for t in (H800, H20)}
    ws = {t: f.result() for t, f in starting.items()}  # both engines load side by side
    routes = {"pd": Affinity(prefill=H800, decode=H20)}
    pairs = [(w, t) for t, w in ws.items()]
    host = c.submit(Host, LLMProxy(pairs, routes=routes), actor=True,
                    resources={CPU_ENV: 1}).result()
    loose = c.submit(Host, LLMProxy(pairs, sticky=False), actor=True,
                     resources={CPU_ENV: 1}).result()
    out = pd_vs_colocated(host, ws, n, reps, 48 if quick else 96)
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


def transfers(c, sizes_mib: list[int], repeats: int) -> dict:
    """Raw copy vs Dask tcp (on ``c``'s cluster) vs Dask ucxx per size; medians."""
    sizes = [actual_bytes(m << 20) for m in sizes_mib]
    raws: dict = {}
    tcp = dask_fetches(c, sizes, repeats, raws)
    ucx = ucx_fetches(sizes, repeats) if ucx_available() else {}
    out, ok_raw, ok_dask = {}, True, True
    for mib, n in zip(sizes_mib, sizes):
        raw = raws[n]
        r_raw = n / median(raw["seconds"])
        r_tcp = n / median(tcp[n]["seconds"])
        r_ucx = n / median(ucx[n]["seconds"]) if ucx else float("nan")
        print(f"KV {mib:4d} MiB ({n // BYTES_PER_TOKEN} tokens of a 7B fp16 cache), "
              f"median of {repeats}: raw recv_into {r_raw / 2**30:6.2f} GiB/s | dask tcp "
              f"{r_tcp / 2**30:6.2f} GiB/s ({r_tcp / r_raw:.2f}×) | dask ucxx "
              f"{r_ucx / 2**30:6.2f} GiB/s ({r_ucx / r_raw:.2f}×)", flush=True)
        out.update({f"raw_gibps_{mib}": r_raw / 2**30, f"tcp_gibps_{mib}": r_tcp / 2**30,
                    f"pd_vs_raw_tcp_{mib}": r_tcp / r_raw,
                    f"pd_vs_raw_ucx_{mib}": r_ucx / r_raw})
        ok_raw &= raw["received"] == raw["sent"] and raw["intact"]
        ok_dask &= tcp[n]["received"] == n * repeats
    big = sizes_mib[-1]  # the headline: the largest (most realistic) cache
    out.update(pd_vs_raw_tcp=out[f"pd_vs_raw_tcp_{big}"],
               pd_vs_raw_ucx=out[f"pd_vs_raw_ucx_{big}"], kv_mib=big,
               raw_bytes_ok=int(ok_raw), dask_bytes_ok=int(ok_dask), repeats=repeats)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    ap.add_argument("--mib", type=int, nargs="*", help="KV cache sizes to move (MiB)")
    ap.add_argument("--repeats", type=int, default=None, help="copies per size (median)")
    ap.add_argument("--reps", type=int, default=None,
                    help="PD/colocated burst pairs per shape (median)")
    ap.add_argument("--requests", type=int, default=None,
                    help="concurrent requests per PD/colocated burst")
    ap.add_argument("--transfer-only", action="store_true",
                    help="only the KV transfer part (e.g. in a venv with the ucx extra)")
    add_arguments(ap)
    args = ap.parse_args(argv)
    run = Run("kv_transfer", args, argv)
    sizes = args.mib or ([4, 16, 64] if args.quick else [4, 16, 64, 256])
    repeats = args.repeats or (5 if args.quick else 9)
    reps = args.reps or (3 if args.quick else 5)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    n = args.requests or (8 if args.quick else 24)
    from distributed import Client

    from rollart.types import CPU_ENV, H20, H800

    with cluster("tcp", (H800, H20, CPU_ENV)) as cl, Client(cl) as c:
        c.run(preimport)  # every worker at once: not one after another on first use
        result = transfers(c, sizes, repeats)
        gen = {} if args.transfer_only else generation(c, args.quick, reps, n)
    for k, v in gen.items():
        print(f"{k}: {v:.3f}", flush=True)
    result.update(gen)
    run.result(result, fmt=lambda v: f"{v:.3f}" if isinstance(v, float) else str(v))
    return result


if __name__ == "__main__":
    main()
