"""Held-out evaluation of a model folder on tasks, in one process, without Dask.

All episodes advance in lock step: each round batches every live episode's next turn
into one ``TorchEngine.generate`` call. Used at the end of ``rollart train`` (warm-up
policy vs trained policy on seeds training never saw) and by the learning test.
"""

from __future__ import annotations

from rollart.env.trajectory import TokenLog, action_text, request_seed
from rollart.env.faults import without_faults
from rollart.model import encode
from rollart.types import GenRequest


def evaluate(model_path: str, tasks, seeds, *, temperature: float = 1.0,
             max_batch: int = 256, sample_seed: int = 12345) -> dict[str, float]:
    """Success rate per task name over ``seeds`` (sampling at ``temperature``)."""
    from rollart.rollout.engine import TorchEngine

    engine = TorchEngine(model_path, max_batch=max_batch)
    tok = engine.tokenizer
    stop = (tok.eos_token_id,)
    out = {}
    for task in (without_faults(t) for t in tasks):
        episodes = []
        for seed in seeds:
            env = task.env_factory()
            log = TokenLog()
            log.add_observation(encode(tok, env.reset(seed)))
            episodes.append({"env": env, "log": log, "done": False, "success": False})
        for turn in range(task.max_turns):
            live = [e for e in episodes if not e["done"]]
            if not live:
                break
            reqs = [GenRequest(e["log"].ids, task.max_new_tokens, temperature, 1.0, stop,
                               request_seed(sample_seed, f"{task.name}-{i}", turn))
                    for i, e in enumerate(live)]
            for e, res in zip(live, engine.generate(reqs)):
                e["log"].add_generation(res.token_ids)
                step = e["env"].step(action_text(tok, res, stop))
                if step.done:
                    e["done"], e["success"] = True, bool(step.info.get("success"))
                else:
                    e["log"].add_observation(encode(tok, step.observation))
        for e in episodes:
            e["env"].close()
        out[task.name] = sum(e["success"] for e in episodes) / max(len(episodes), 1)
    return out
