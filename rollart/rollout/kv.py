"""KV cache transfer between inference workers over Dask's comm layer (never the driver).

Consumes a ``KVHandoff`` made by ``TorchEngine.prefill`` on the prefill worker; produces
the same handoff on the decode worker. Called by ``InferenceWorker.prefill`` (``hold``)
and ``InferenceWorker.decode`` (``fetch``):

    prefill worker P                              decode worker D
    hold: scatter into P's Dask memory  ──key──►  (via the proxy: a dict of a few bytes)
                                        ◄─get_data─ fetch: P → D directly, the same
                                         ──KV────►  worker-to-worker path Dask uses for
                                                    task dependencies (tcp:// or ucxx://)

The handoff is one contiguous numpy buffer, so Dask ships it as one zero-copy frame.
The scheduler knows the key (``scatter``), so its size is accounted and the memory is
freed when the prefill worker drops its future (``InferenceWorker.drop_kv``).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from rollart.rollout.pd import KVHandoff


async def hold(actor, handoff: KVHandoff) -> dict:
    """Keep ``handoff`` in this worker's Dask memory; return ``{key, nbytes, source}``."""
    from distributed import get_client

    client = get_client()
    key = f"kv-{uuid.uuid4().hex}"
    futures = await client.scatter({key: handoff}, hash=False, asynchronous=True)
    actor._kv_held[key] = futures[key]
    actor.kv_stats["sent"] += 1
    return {"key": key, "nbytes": handoff.nbytes, "source": handoff.source}


async def fetch(actor, kv: dict, retries: int = 20, worker=None) -> KVHandoff:
    """Get the handoff ``kv`` names from the worker that holds it, straight from there.

    ``worker``: the Dask worker this runs on (default: the current one)."""
    from distributed import Future, get_client, get_worker
    from distributed.worker import get_data_from_worker

    worker = worker if worker is not None else get_worker()
    key, source = kv["key"], kv["source"]
    t0 = time.perf_counter()
    if key in worker.data:  # prefill and decode on the same worker
        handoff = worker.data[key]
    else:
        handoff = None
        for attempt in range(retries):
            resp = await get_data_from_worker(worker.rpc, [key], source, who=worker.address)
            if resp.get("status") == "OK" and key in resp.get("data", {}):
                handoff = resp["data"][key]
                break
            await asyncio.sleep(0.01 * (attempt + 1))  # "busy": too many transfers there
        if handoff is None:  # not where it was made (moved or busy): ask the scheduler
            handoff = await get_client().gather(Future(key), asynchronous=True)
    actor.kv_stats["received"] += 1
    actor.kv_stats["bytes_received"] += handoff.nbytes
    actor.kv_stats["fetch_seconds"] += time.perf_counter() - t0
    return handoff
