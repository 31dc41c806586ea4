"""Versioned weight store: the trainer publishes, inference workers pull.

Consumes state dicts from ``Trainer``; produces them for ``InferenceWorker``.
``WeightStore(url)`` picks the backend (fsspec, or Mooncake for ``mooncake://`` URLs);
``store_url(spec, run_dir)`` turns a run's ``weights`` setting into such a URL.
"""

from contextlib import contextmanager
from pathlib import Path

from rollart.weights.mooncake import MooncakeError, MooncakeMaster, MooncakeWeightStore
from rollart.weights.store import FsspecWeightStore, WeightStore

BACKENDS = ("fsspec", "mooncake")


@contextmanager
def store_url(spec: str | None, run_dir: str | Path):
    """Yield the weight-store URL of a run, starting what it needs for its duration.

    ``None`` / ``"fsspec"``: ``{run_dir}/weights``; ``"mooncake"``: a local
    ``mooncake_master`` on loopback (stopped on exit), objects under the run's name;
    a ``mooncake://`` URL: that master (a cluster's); any other string: an fsspec URL.
    """
    if spec in (None, "fsspec"):
        yield str(Path(run_dir) / "weights")
    elif spec == "mooncake":
        with MooncakeMaster() as master:
            yield master.url(Path(run_dir).name)
    else:
        yield str(spec)


__all__ = ["BACKENDS", "FsspecWeightStore", "MooncakeError", "MooncakeMaster",
           "MooncakeWeightStore", "WeightStore", "store_url"]
