# %% [markdown]
# # rollart multi-task: several games, one policy, stop when you like
#
# Trains the default graph (`gridnav`, `guess`, `boxpush` together) from a Dask client,
# compares per-task rewards, stops the run gracefully, and renders the run's report
# (reward per task, throughput per inference pool, staleness). `multitask.py` holds the
# same cells as a plain script. Tiny settings for tests come from the environment:
# `ROLLART_NB_STEPS`, `ROLLART_NB_STOP_AT`, `ROLLART_NB_WARMUP`, `ROLLART_NB_GROUPS`,
# `ROLLART_NB_THREADS=1`.

# %%
import os
from dataclasses import replace

from distributed import Client

import rollart

rollart.quiet()  # Dask's INFO logs off (rollart.quiet(verbose=True): on)
from rollart.app.api import wait_for_step
from rollart.observe.plots import render_report

STEPS = int(os.environ.get("ROLLART_NB_STEPS", 60))
STOP_AT = int(os.environ.get("ROLLART_NB_STOP_AT", 40))  # stop early, gracefully
WARMUP = os.environ.get("ROLLART_NB_WARMUP")
GROUPS = os.environ.get("ROLLART_NB_GROUPS")  # groups per trainer step
RUN_DIR = os.environ.get("ROLLART_NB_RUN_DIR")

resources = rollart.load_resources()
if os.environ.get("ROLLART_NB_THREADS") == "1":
    resources = replace(resources, processes=False, dashboard_address=":0")
cluster = resources.make_cluster()
client = Client(cluster)

# %%
graph, _ = rollart.load_graph()  # graphs/multitask.py
graph = replace(graph, steps=STEPS)
if WARMUP is not None:
    graph = replace(graph, policy=replace(graph.policy, warmup_steps=int(WARMUP)))
if GROUPS is not None:
    graph = replace(graph, algo=replace(graph.algo, groups_per_step=int(GROUPS),
                                        group_size=4))
print(graph.tasks, graph.mode, "alpha", graph.algo.alpha)
run = rollart.start_run(client, graph, run_dir=RUN_DIR)
print("live page:", run.dashboard_link)
run.progress()

# %% [markdown]
# Let it train to `STOP_AT` steps, then stop: the current step finishes, the model is
# saved and the samples are flushed to Parquet.

# %%
wait_for_step(run, STOP_AT, timeout=3600)
run.stop()
result = run.wait()
print(run, "model:", result.model_dir)

# %%
df = run.metrics()
rewards = df[[c for c in df.columns if c.startswith("reward/") and c != "reward/mean"]]
rewards.rolling(5, min_periods=1).mean().tail()

# %% [markdown]
# Per-task outcome of every trajectory the trainer used (Arrow → pandas).

# %%
trained = run.samples(columns=["task", "reward", "outcome", "state"]).to_pandas()
trained[trained.state == "trained"].groupby("task").reward.agg(["count", "mean"])

# %%
files = render_report(run.run_dir)  # reward.png, throughput.png, staleness.png, report.html
print(files)
try:
    from IPython.display import Image, display

    display(Image(filename=files["throughput"]))
except ImportError:
    pass

# %%
client.close()
cluster.close()
