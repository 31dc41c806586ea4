"""Quickstart: train from Python with your own Dask client, then read the results.

    python examples/quickstart.py            # a short run of the single-task gridnav graph
    python examples/quickstart.py --steps 60

The same lines work in a notebook. Open the Dask dashboard link printed below to watch
the actors and reward tasks run on their tagged workers.
"""

import argparse
from dataclasses import replace

from distributed import Client

import rollart


def main(steps: int = 30, warmup_steps: int | None = None, run_dir: str | None = None,
         processes: bool = True, eval_seeds: int = 32):
    graph, _ = rollart.load_graph("gridnav")
    graph = replace(graph, steps=steps)
    if warmup_steps is not None:
        graph = replace(graph, policy=replace(graph.policy, warmup_steps=warmup_steps))
    resources = rollart.load_resources()  # resources/local.py: tagged workers on this machine
    if not processes:  # threads in this process (what the smoke test uses)
        resources = replace(resources, processes=False, dashboard_address=":0")
    with resources.make_cluster() as cluster, Client(cluster) as client:
        print("dashboard:", client.dashboard_link)
        result = rollart.train(graph, client=client, run_dir=run_dir, eval_seeds=eval_seeds)
    print("run directory:", result.run_dir)
    print("last step reward:", {k: round(v, 2) for k, v in result.metrics[-1].items()
                                if k.startswith("reward/") and v is not None})
    print("held-out success:", result.evaluation)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--run-dir", default=None)
    a = p.parse_args()
    main(a.steps, a.warmup_steps, a.run_dir)
