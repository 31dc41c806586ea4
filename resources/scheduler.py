"""Run on a cluster that is already up: point rollart at its scheduler.

Start workers with the tags the graph needs, for example::

    dask scheduler
    dask worker tcp://HOST:8786 --resources "H800=1"       # on compute-GPU hosts
    dask worker tcp://HOST:8786 --resources "H20=1"        # on bandwidth-GPU hosts
    dask worker tcp://HOST:8786 --resources "CPU_ENV=1"    # env hosts
    dask worker tcp://HOST:8786 --resources "REWARD=1"     # reward hosts
    dask worker tcp://HOST:8786 --resources "TRAIN=1"      # the trainer host
    dask worker tcp://HOST:8786 --resources "BUFFER=1"     # the sample buffer (optional)

then ``ROLLART_SCHEDULER=tcp://HOST:8786 rollart train --resources resources/scheduler.py``
(or simply ``--resources tcp://HOST:8786``). Without a ``BUFFER`` worker the sample
buffer goes on the TRAIN worker (then REWARD, then an inference worker; an env worker
only as a last resort, with a warning): keep it off the env hosts.
"""

import os

from rollart.runtime.resources import Resources


def resources() -> Resources:
    return Resources(address=os.environ.get("ROLLART_SCHEDULER", "tcp://127.0.0.1:8786"))
