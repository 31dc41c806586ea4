"""Each actor role declared once: its class, what it is built from, where it runs.

Consumes a ``Graph`` (plus the model folder, the run directory and the weight store's
URL); produces one ``RoleSpec`` per role (``role_specs``) and, on a Dask cluster, the
``Actors`` record a run drives (handles: ``rollart.runtime.handles.Handle``, whose calls fail
fast on a lost worker). ``Stages.start`` places every spec (called by
``rollart.control.loop.run_loop``); ``Stages.reconcile`` compares what should run with what
runs (the scheduler's live workers, the actors' futures) and re-creates what is missing
from the same spec (called by ``rollart.control.supervisor.Supervisor``), as Dask's
``SpecCluster._correct_state`` does for workers. A replacement is therefore always built
like the original: same class (a Megatron trainer stays Megatron), same arguments (an
env manager's proxy keeps the graph's task routes), same pool.

==============  ===========================  ===========================================
role            class                        placed
==============  ===========================  ===========================================
``trainer``     ``trainer_class(backend)``   one, on a ``TRAIN`` worker; a gang over
                                             every TRAIN worker alive at start (its
                                             size, kept by every replacement)
``buffer``      ``SampleBuffer``             one, on a ``BUFFER`` worker; without one
                                             on ``TRAIN``, then ``REWARD``, then an
                                             inference worker, an env worker only as a
                                             last resort (``buffer_worker``, warns)
``inference``   ``InferenceWorker``          one per worker carrying each inference tag
``env``         ``EnvManager``               one per worker carrying each env pool's tag
==============  ===========================  ===========================================

An env manager's proxy and buffer are live handles, not graph data: its spec names them
``LIVE_PROXY`` / ``LIVE_BUFFER`` and they are filled in from the current ``Actors`` when
it is built. After inference workers or the buffer change, ``reconcile`` hands the new
ones to every live manager (``set_inference_workers`` / ``set_buffer``).

No wait is silent: an actor's constructor and every call start-up, recovery and shutdown
make on one are bounded (``Waits``, Dask's config ``rollart.waits``), through a ``Door``
(``rollart.control.door``): ``StuckError``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollart.control.actors import Actors, Member  # noqa: F401 (re-exported)
from rollart.control.door import Door
from rollart.policy.affinity import env_pools, inference_tags, task_routes
from rollart.runtime.resources import cluster_tags
from rollart.types import BUFFER, REWARD, TRAIN
from rollart.runtime.lost import gone, is_lost
from rollart.runtime.waits import StuckError, Waits, stuck

logger = logging.getLogger(__name__)

__all__ = ["Actors", "LIVE_BUFFER", "LIVE_PROXY", "Member", "Reconciled", "RoleSpec", "Stages",
           "buffer_worker", "catch_up", "make_proxy", "role_specs"]

class _Live:
    """A constructor argument taken from the running ``Actors`` when the actor is built."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<live {self.name}>"


LIVE_PROXY = _Live("proxy")  #: an ``LLMProxy`` over the live inference workers
LIVE_BUFFER = _Live("buffer")  #: the live ``SampleBuffer``


@dataclass(frozen=True)
class RoleSpec:
    """How to build and place one role: ``cls(*args, **kwargs)`` on workers with ``tag``.

    ``each``: one actor per worker carrying ``tag`` (else one actor in all);
    ``fallback``, then ``last_resort``: tags to try in order when no worker carries
    ``tag`` (the buffer: non-env roles, then env pools with a warning)."""

    role: str
    cls: type
    args: tuple
    kwargs: dict
    tag: str
    each: bool = False
    fallback: tuple[str, ...] = ()
    last_resort: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.cls.__name__ if self.role in ("trainer", "buffer") else \
            f"{self.cls.__name__}-{self.tag}"


def make_proxy(workers: list, graph):
    """The ``LLMProxy`` every env manager starts with: ``workers`` and the graph's routes."""
    from rollart.rollout import LLMProxy

    return LLMProxy([(w, tag) for w, tag, *_ in workers], routes=task_routes(graph.tasks))


def role_specs(graph, model_path: str, run_dir, store_url: str | None = None
               ) -> list[RoleSpec]:
    """Every role a run of ``graph`` needs, in start order (trainer, buffer, inference
    workers per inference tag, env managers per env pool)."""
    from rollart.buffer import SampleBuffer
    from rollart.env.manager import EnvManager
    from rollart.rollout import InferenceWorker
    from rollart.trainer import trainer_class

    p, r = graph.policy, graph.rollout
    store_url = store_url or str(Path(run_dir) / "weights")
    specs = [
        RoleSpec("trainer", trainer_class(p.trainer_backend), (model_path, store_url,
                 graph.algo), dict(temperature=p.temperature, threads=1, seed=graph.seed,
                                   **({"lora": p.lora.peft_options()} if p.lora else {})),
                 TRAIN),
        RoleSpec("buffer", SampleBuffer, (str(run_dir),),
                 dict(min_group=graph.algo.min_group_size), BUFFER,
                 fallback=(TRAIN, REWARD, *inference_tags(graph)),
                 last_resort=env_pools(graph)),
    ]
    # version -1: the folder's weights are not a published version; the workers load
    # version 0 from the store once the trainer publishes it
    specs += [RoleSpec("inference", InferenceWorker, (model_path, store_url),
                       dict(pool=tag, version=-1, threads=1, **p.worker_options()), tag,
                       each=True) for tag in inference_tags(graph)]
    manager = dict(temperature=p.temperature, top_p=p.top_p,
                   env_step_timeout=r.env_step_timeout, reward_timeout=r.reward_timeout,
                   local_reward=r.local_reward, trajectory_timeout=r.trajectory_timeout,
                   max_concurrency=r.env_concurrency, inference_pools=r.inference_pools,
                   seed=graph.seed, stale_members=graph.stale_members,
                   **p.conversation_options())
    specs += [RoleSpec("env", EnvManager, (LIVE_PROXY, LIVE_BUFFER, model_path), manager,
                       tag, each=True) for tag in env_pools(graph)]
    return specs


def buffer_worker(live: dict[str, dict], spec: RoleSpec, avoid: str | None = None
                  ) -> tuple[str, str] | None:
    """``(address, tag)`` of the worker for the sample buffer, or None without workers.

    A worker carrying ``spec.tag`` (``BUFFER``) first, then ``spec.fallback`` in order
    (workers that also carry an env pool's tag left out: ``resources/laptop.py``'s
    rollout worker carries REWARD and the inference tags), then ``spec.last_resort``
    (the env pools) with a warning: envs are the most failure-prone workers, and the
    buffer holds the run's ledger and unflushed samples.
    Among workers carrying the same tag, ``avoid`` (a lost buffer's) comes last.

    >>> spec = RoleSpec("buffer", dict, (), {}, "BUFFER", fallback=("TRAIN",),
    ...                 last_resort=("CPU_ENV",))
    >>> buffer_worker({"a": {"CPU_ENV": 1}, "b": {"TRAIN": 1}}, spec)
    ('b', 'TRAIN')
    """
    env = set(_with_tag(live, *spec.last_resort))
    for tag in (spec.tag, *spec.fallback, *spec.last_resort):
        found = _with_tag(live, tag)
        if tag not in spec.last_resort:
            found = [a for a in found if a not in env or tag == spec.tag]
        found = [a for a in found if a != avoid] or found
        if not found:
            continue
        if tag in spec.last_resort:
            logger.warning(
                "no worker carries the %r tag or a non-env role (%s): the sample buffer, "
                "which holds the run's ledger and unflushed samples, goes on env worker %s, "
                "the most failure-prone kind; losing it ends the run unless the buffer can "
                "recover. Give a non-env worker the %r resource (e.g. extra_tags={%r: 1} on "
                "the trainer's Pool)", spec.tag, ", ".join(spec.fallback), found[0],
                spec.tag, spec.tag)
        return found[0], tag
    return None


@dataclass
class _Start:
    """An actor submitted by ``Stages.reconcile`` and not yet taken up."""

    fut: object
    t0: float


def _stuck_start(client, start: _Start, what: str, seconds: float) -> StuckError:
    """``StuckError`` for an actor start past its bound, with the scheduler's state of
    its task (``no-worker``: no live worker may run it; ``processing``: its constructor
    runs or hangs on that worker) so the message says where to look."""
    key = start.fut.key

    def state(dask_scheduler=None):
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            return "unknown to the scheduler"
        on = ts.processing_on
        return ts.state + (f" on {on.address}" if on is not None else "")

    try:
        known = client.run_on_scheduler(state)
    except Exception as e:  # noqa: BLE001 - the message is what matters here
        known = f"unknown ({e!r})"
    return stuck(f"{what} (its task {key!r} is {known})", seconds, "start")


@dataclass
class Reconciled:
    """What one ``reconcile`` did: ``removed`` lost actors and ``made`` new ones, each
    ``(role, tag, address)``; ``missing``: roles with no worker to go on yet."""

    removed: list = field(default_factory=list)
    made: list = field(default_factory=list)
    missing: list = field(default_factory=list)


class Stages:
    """The run's role specs on one cluster: ``start`` places them, ``reconcile`` keeps
    what runs equal to them.

    >>> # stages = Stages(client, graph, model_path, run_dir)
    >>> # actors = stages.start()           # every role placed
    >>> # stages.reconcile(actors)          # later: re-create whatever was lost
    """

    def __init__(self, client, graph, model_path: str, run_dir, store_url: str | None = None,
                 waits: Waits | None = None):
        self.client, self.graph = client, graph
        self.waits = waits or Waits.from_config()
        self.run_dir = Path(run_dir)
        self.store_url = store_url or str(self.run_dir / "weights")
        self.specs = role_specs(graph, model_path, self.run_dir, self.store_url)
        # actor keys are unique per start: a resumed run in the same cluster gets new ones
        self.run = f"{self.run_dir.name}-{time.time_ns() % 10**9:09d}"
        self.futures: list = []  # every actor's future: its key stays wanted by us
        self._starting: dict[tuple[str, str], _Start] = {}  # (role, addr) -> not taken up
        self._n, self.door = 0, Door()  # below the Fleet: no view, errors as raised
        self.trainer_ranks = 0  # the gang's size, from the TRAIN workers at start

    def spec(self, role: str, tag: str | None = None) -> RoleSpec:
        return next(s for s in self.specs if s.role == role and (tag is None or s.tag == tag))

    # -- building -------------------------------------------------------------------------
    def submit(self, spec: RoleSpec, addr: str, actors: Actors | None, *, tag: str | None = None,
               suffix: str = "", **extra):
        """Submit ``spec``'s actor on worker ``addr``; returns its future."""
        args = tuple(self._live(a, actors) for a in spec.args)
        tag = tag or spec.tag
        where = {"workers": [addr], "allow_other_workers": False}
        if spec.role != "buffer" or tag == BUFFER:
            where["resources"] = {tag: 1}
        key = f"{spec.name}{'' if spec.role in ('trainer', 'buffer') else '-' + addr}"
        fut = self.client.submit(spec.cls, *args, **spec.kwargs, **extra, actor=True,
                                 key=f"{key}-{self.run}{suffix}", **where)
        self.futures.append(fut)
        return fut

    def _trainer_spec(self) -> RoleSpec:
        """The trainer's spec: with more than one TRAIN worker at start
        (``trainer_ranks``), a gang over that many (rank 0 where it is placed; its ranks
        join within ``waits.start``), laid out by ``Policy.trainer_parallel``:
        ``rollart.trainer.gang.GangTrainer`` (FSDP2) on the torch backend,
        ``rollart.trainer.megatron_gang.MegatronGangTrainer`` (tensor x data parallel) on
        the Megatron one. A replacement has the same size whatever is alive as it is
        built: the gang fails as one and forms again whole, its rank 0 waiting for a lost
        rank's worker to come back (``GangTrainer._other_workers``); a gang built from
        the workers alive at that instant was a one-process trainer beside the dead
        gang's rank (issue 52)."""
        from dataclasses import replace

        spec = self.spec("trainer")
        ranks = self.trainer_ranks
        if ranks <= 1:
            return spec
        policy = self.graph.policy
        tp, _ = policy.trainer_parallel.layout(ranks, policy.trainer_backend)
        kwargs = {**spec.kwargs, "ranks": ranks, "join_timeout": self.waits.start}
        if policy.trainer_backend == "megatron":
            from rollart.trainer.megatron_gang import MegatronGangTrainer

            return replace(spec, cls=MegatronGangTrainer, kwargs={**kwargs, "tp": tp})
        from rollart.trainer.gang import GangTrainer

        return replace(spec, cls=GangTrainer, kwargs=kwargs)

    def _live(self, arg, actors: Actors | None):
        if arg is LIVE_BUFFER:
            return actors.buffer
        if arg is LIVE_PROXY:
            return make_proxy(actors.workers, self.graph)
        return arg

    def start(self) -> Actors:
        """Place every spec; returns the ``Actors`` record (with ``placement``)."""
        live = cluster_tags(self.client)
        trainer_addr = _with_tag(live, TRAIN)[0]
        self.trainer_ranks = len(_with_tag(live, TRAIN))
        trainer = self.submit(self._trainer_spec(), trainer_addr, None)
        buf_spec = self.spec("buffer")
        buffer_addr, buffer_tag = buffer_worker(live, buf_spec)
        buffer = self.submit(buf_spec, buffer_addr, None, tag=buffer_tag)
        workers = [(self.submit(s, addr, None), s.tag, addr)
                   for s in self.specs if s.role == "inference"
                   for addr in _with_tag(live, s.tag)]
        started = self._started(time.monotonic())
        actors = Actors(started(trainer, "trainer", TRAIN, trainer_addr),
                        started(buffer, "buffer", buffer_tag, buffer_addr),
                        [(started(f, "inference", tag, addr), tag, addr)
                         for f, tag, addr in workers])
        managers = [(self.submit(s, addr, actors), s.tag, addr)
                    for s in self.specs if s.role == "env" for addr in _with_tag(live, s.tag)]
        started = self._started(time.monotonic())
        for f, tag, addr in managers:
            actors.add("env", started(f, "env", tag, addr), tag, addr)
        for m, tag, addr in actors.of("env"):
            self._hand_buffer(m, actors, f"{addr} ({tag})")
        return actors

    def _hand_buffer(self, manager, actors: Actors, where: str) -> None:
        """Give a new env manager the buffer again, as a method argument: a handle passed
        to the constructor arrives as a plain Dask one, whose calls wait forever once the
        buffer's worker is lost (``rollart.runtime.handles``). A manager in this very
        process (an in-process cluster) keeps the driver's own handle, which works (a
        Handle bound to an in-process worker left calls that never ended)."""
        import os

        addr = manager._address
        if self.client.run(os.getpid, workers=[addr]).get(addr) == os.getpid():
            return
        buf, what = actors.buffer, f"the EnvManager on {where} did not take the sample buffer"
        self.door.call(manager, "set_buffer", (buf._cls, buf._address, buf.key),
                       timeout=self.waits.call, stuck=what)

    def _started(self, t0: float):
        """``started(future, role, tag, addr)``: the actor, once built, within
        ``waits.start`` of ``t0`` (they were submitted together)."""
        def started(fut, role: str, tag: str, addr: str):
            left = max(t0 + self.waits.start - time.monotonic(), 0.1)
            return self._built(fut, left, f"the {self._cls(role, tag)} on {addr} ({tag})")
        return started

    def _built(self, fut, seconds: float, what: str):
        """``fut``'s actor (a ``Handle``) within ``seconds``; else ``what`` did not start."""
        from rollart.runtime.handles import handle

        return handle(self.door.result(fut, None, seconds, stuck=f"{what} did not start",
                                       setting="start"))

    def _cls(self, role: str, tag: str | None = None) -> str:
        spec = next((s for s in self.specs if s.role == role and s.tag == tag), None)
        return (spec or self.spec(role)).cls.__name__

    # -- reconciling ----------------------------------------------------------------------
    def reconcile(self, actors: Actors, roles=("buffer", "inference", "env"), *,
                  lost=(), live: dict | None = None) -> Reconciled:
        """Make ``actors`` match the specs of ``roles``: drop actors whose worker is gone
        or whose future failed (and those in ``lost``), build the missing ones on live
        workers, and hand a new buffer or new inference workers to every live manager.

        A lost buffer comes back with ``recover=True``: its durable groups and ledger
        are reloaded from the run directory (``rollart.buffer.restore.recover``)."""
        live = cluster_tags(self.client) if live is None else live
        out = Reconciled()
        for role in roles:
            for actor, tag, addr in actors.of(role):
                if gone(actor, live) or any(actor is x for x in lost):
                    if role in ("inference", "env"):
                        actors.remove(role, actor)
                    out.removed.append((role, tag, addr))
        lost_one = {role: addr for role, _, addr in out.removed if role in ("trainer", "buffer")}
        if "trainer" in lost_one:
            self._replace_one(actors, "trainer", lost_one["trainer"], live, out)
        if "buffer" in lost_one:
            self._replace_one(actors, "buffer", lost_one["buffer"], live, out)
        if "inference" in roles:
            self._fill(actors, "inference", live, out)
        self._announce(actors, out)
        # a new manager's proxy routes to the inference workers of now: not while one
        # is still starting (a task's decode pool may be the one coming back)
        if "env" in roles and ("buffer", BUFFER) not in out.missing and \
                not any(role == "inference" for role, _ in self._starting):
            self._fill(actors, "env", live, out)
        return out

    def _replace_one(self, actors: Actors, role: str, old: str, live, out: Reconciled) -> None:
        spec = self.spec(role)
        if role == "buffer":
            where = buffer_worker(live, spec, avoid=old)
        else:
            found = _with_tag(live, spec.tag)
            found = [a for a in found if a != old] or found
            where = (found[0], spec.tag) if found else None
        if where is None:
            out.missing.append((role, spec.tag))
            return
        addr, tag = where
        extra = {"recover": True} if role == "buffer" else {}
        if role == "trainer":  # a gang is rebuilt whole, at its size, rank 0 on ``addr``
            spec = self._trainer_spec()
        self._n += 1
        fut = self.submit(spec, addr, actors, tag=tag, suffix=f"-r{self._n}", **extra)
        actor = self._built(fut, self.waits.start,
                            f"the replacement {spec.cls.__name__} on {addr} ({tag})")
        actors.add(role, actor, tag, addr)
        out.made.append((role, tag, addr))

    def _fill(self, actors: Actors, role: str, live, out: Reconciled) -> None:
        """One actor of ``role`` per live worker carrying each of its specs' tags.

        A new actor is submitted here and taken up by a later reconcile once built: the
        run goes on meanwhile, instead of stalling the step for a constructor that loads
        a model. A start whose worker leaves first is dropped; one that has not started
        within ``waits.start`` is a ``StuckError`` naming what the scheduler knows."""
        for key in self.drop_starts({a for r, a in self._starting if a not in live}, role):
            logger.info("dropped the start of %s: its worker left", key)
        for spec in (s for s in self.specs if s.role == role):
            have = {addr for _, _, addr in actors.of(role, spec.tag)}
            for addr in _with_tag(live, spec.tag):
                if addr in have or (role == "env" and not actors.workers):
                    continue
                where = f"{addr} ({spec.tag})"
                new = f"the new {spec.cls.__name__} on {where}"
                start = self._starting.get((role, addr))
                if start is None:
                    self._n += 1
                    fut = self.submit(spec, addr, actors, suffix=f"-r{self._n}")
                    self._starting[(role, addr)] = _Start(fut, time.monotonic())
                    continue
                if not start.fut.done():
                    if time.monotonic() - start.t0 > self.waits.start:
                        del self._starting[(role, addr)]
                        error = _stuck_start(self.client, start, f"{new} did not start",
                                             self.waits.start)
                        start.fut.cancel()
                        raise error
                    continue
                del self._starting[(role, addr)]
                try:
                    actor = self._built(start.fut, self.waits.start, new)
                except Exception as e:  # noqa: BLE001 - its worker was lost: next time
                    if not is_lost(e):
                        raise
                    logger.info("%s was lost as it started: %s", new, e)
                    continue
                if role == "inference":  # the newest published weights before it serves
                    from rollart.weights import WeightStore

                    catch_up([(actor, where)], WeightStore(self.store_url).latest(),
                             self.waits, "new ", self.door)
                if role == "env":
                    self._hand_buffer(actor, actors, where)
                actors.add(role, actor, spec.tag, addr)
                out.made.append((role, spec.tag, addr))

    def starting(self) -> list[tuple[str, str]]:
        """``[(role, address)]`` of the actors submitted and not yet taken up."""
        return sorted(self._starting)

    def drop_starts(self, gone, role: str | None = None) -> list[str]:
        """Cancel the actor starts (of ``role``, or all) on the workers ``gone``: keys."""
        futs = [self._starting.pop(k).fut for k in list(self._starting)
                if k[1] in gone and role in (None, k[0])]
        for fut in futs:
            fut.cancel()
        return [fut.key for fut in futs]

    def _announce(self, actors: Actors, out: Reconciled) -> None:
        """Hand new inference workers / a new buffer to the managers that survived."""
        new = {role for role, _, _ in out.made}
        calls = []
        if "inference" in new and actors.workers:
            calls.append(("set_inference_workers", [(w, t) for w, t, _ in actors.workers]))
        if "buffer" in new:
            calls.append(("set_buffer", actors.buffer))
        for m in list(actors.managers) if calls else []:
            for method, arg in calls:
                try:
                    self.door.call(m, method, arg, timeout=self.waits.call, stuck=f"the "
                                   f"EnvManager on {m._address} did not take the new "
                                   "inference workers / buffer")
                except StuckError:
                    raise
                except Exception as e:  # noqa: BLE001 - a manager lost meanwhile: next time
                    if not is_lost(e):
                        raise


def _with_tag(live: dict[str, dict], *tags: str) -> list[str]:
    """Addresses of the live workers carrying any of ``tags``, sorted."""
    return sorted(a for a, r in live.items() if any(r.get(t, 0) > 0 for t in tags))


def catch_up(workers: list[tuple], version: int, waits: Waits, what: str, door: Door) -> None:
    """Every inference worker of ``workers`` (``[(actor, where)]``) loads weights
    ``version`` from the store (a negative one: nothing published yet, nothing to load):
    all are asked at once, then each is waited for through ``door``, within ``waits.call``
    a call. The run's first weights (``Fleet.catch_up``) and a new worker's catch-up
    (``Stages.reconcile``) both come here."""
    if version < 0:
        return
    for call in ("update_weights", "wait_version"):
        futs = [(door.submit(w, call, version), w, where) for w, where in workers]
        for fut, w, where in futs:
            door.result(fut, w, waits.call, stuck=f"the {what}InferenceWorker on {where} did "
                        f"not load weights v{version} ({call})")
