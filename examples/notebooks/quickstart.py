# %% [markdown]
# # rollart quickstart: train from a Dask client, watch it, read the results
#
# This notebook (and `quickstart.py`, the same cells as a plain script) starts tagged
# workers on this machine, trains the single-task `gridnav` graph, and reads the run
# back as pandas / Arrow. Watch it live on the Dask dashboard's **Rollart** page.
#
# Settings for a quick try come from the environment (the tests use tiny ones):
# `ROLLART_NB_STEPS`, `ROLLART_NB_WARMUP`, and `ROLLART_NB_THREADS=1` for an in-process
# cluster. With a cluster already running, use `Client("tcp://scheduler:8786")` instead.

# %%
import os
from dataclasses import replace

from distributed import Client

import rollart

rollart.quiet()  # Dask's INFO logs off (rollart.quiet(verbose=True): on)

STEPS = int(os.environ.get("ROLLART_NB_STEPS", 30))
WARMUP = os.environ.get("ROLLART_NB_WARMUP")  # None: the graph's own warm-up
RUN_DIR = os.environ.get("ROLLART_NB_RUN_DIR")  # None: runs/NAME-TIME

resources = rollart.load_resources()  # resources/local.py: tagged workers on this machine
if os.environ.get("ROLLART_NB_THREADS") == "1":
    resources = replace(resources, processes=False, dashboard_address=":0")
cluster = resources.make_cluster()
client = Client(cluster)
print("dashboard:", client.dashboard_link)

# %% [markdown]
# Start a run from a graph. `start_run` returns at once; the run goes on in the
# background, so the client and this notebook stay free.

# %%
graph, _ = rollart.load_graph("gridnav")
graph = replace(graph, steps=STEPS)
if WARMUP is not None:
    graph = replace(graph, policy=replace(graph.policy, warmup_steps=int(WARMUP)))
run = rollart.start_run(client, graph, run_dir=RUN_DIR)
print("live page:", run.dashboard_link)
run.progress()

# %%
result = run.wait()
print(run)

# %% [markdown]
# One row per trainer step, as a DataFrame: reward, trajectory counts, staleness, ...

# %%
df = run.metrics()
df[["reward/gridnav", "success/gridnav", "traj/trained", "trainer/staleness_mean"]].tail()

# %% [markdown]
# Every trajectory that left the buffer, with its final state, as an Arrow table.

# %%
samples = run.samples()
print(samples.num_rows, "trajectories;", samples.schema.names[:8], "...")
samples.to_pandas().groupby("state").size()

# %%
client.close()
cluster.close()
