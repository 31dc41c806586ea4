"""The torch engine on a real model (issue 50 item 4): rollart's ``TorchEngine`` against
bare ``transformers`` ``generate`` on SmolLM2-135M-Instruct, with the same prompts and
the same sampling, in one process, alternated round by round.

**The workload** is ``graphs/real.py``'s first turn: ``--groups`` groups of
``--group-size`` rows (4 of 8 by default, a trainer step's worth), the groups alternating
between its two tasks (``guess_number`` and ``calculator``, seeds 0, 1, …), each group's
rows the same prompt (system + user, rendered by the model's own ChatML template with
the generation prompt), sampled at temperature 1 (top-p 1, no top-k) for at most
``--new`` tokens, stopping at ``<|im_end|>``. Every row has its own seed.

**The sides.**

* ``engine``: ``TorchEngine.generate`` on all rows at ``max_batch`` = the row count:
  continuous batching (a finished row leaves at once), its prefix sharing (rows with an
  equal prompt share one prefill forward), its lean forward, behaviour log-probs kept
  (RL needs them).
* ``bare``: ``model.generate`` on the whole batch, left-padded, ``do_sample=True``,
  ``temperature=1.0``, ``top_k=0``, ``top_p=1.0``, the same stop token and
  ``max_new_tokens``, the KV cache on (transformers' default); no log-probs asked for
  (so the bare side does strictly less work than RL needs). A finished row is padded
  until the batch's last row ends: that is how ``generate`` batches.
* ``vllm`` (with ``--vllm-python``, e.g. ``~/.cache/rollart/vllm-venv/bin/python``, the
  venv ``.ci/run`` builds): rollart's vLLM engine (``rollart.rollout.vllm_engine``, vLLM's
  CPU build) on the same requests, in a child process of that venv after the rounds
  above (the same warm-up, the same number of rounds; not interleaved with them, so its
  ratio ``vllm_vs_engine`` is of medians, not per round).
* ``engine_nobatch`` (where the time goes: batching): the engine one row at a time
  (``max_batch`` 1), on the first group's rows only (a row's tokens/s alone does not
  depend on how many rows follow it, and the side costs the most);
* ``engine_noshare`` (where the time goes: prefix sharing): every row's prompt made
  distinct by a per-row first token of the user turn (the same length and shape), so no
  row shares another's prefill.

Tokens counted are generated tokens up to and including the stop token, per row, the
same rule on every side. ``*_tok_s`` = tokens ÷ wall seconds of the side's call;
``engine_vs_bare`` = the median over rounds of the per-round ratio ``engine_tok_s ÷
bare_tok_s`` (the goal: ≥ 1.0). Both run on ``--threads`` torch threads (the machine's
cores by default), one after the other, never beside each other, in an order rotated
each round; every side is warmed up once, untimed, before the rounds.

Run it alone on an idle machine::

    flock /tmp/rollart-bench.lock python benchmarks/engine_real.py
    python benchmarks/engine_real.py --quick     # one round, 2 groups of 4, 16 tokens

RESULT keys: ``engine_vs_bare``, ``engine_tok_s``, ``bare_tok_s``,
``engine_nobatch_tok_s``, ``engine_noshare_tok_s``, ``batching_gain`` (engine ÷
engine_nobatch), ``sharing_gain`` (engine ÷ engine_noshare), ``rows``, ``new``,
``prompt_tokens`` (mean), ``gen_tokens`` (mean per row, engine), ``rounds``,
``threads``, ``model``; with ``--vllm-python``: ``vllm_tok_s``, ``vllm_vs_engine``. Appends a record to ``benchmarks/results/engine_real.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py

from _results import Run, add_arguments  # noqa: E402

MODEL = "smollm2-135m-instruct"


def prompts(tokenizer, groups: int, group_size: int, distinct: bool) -> list[list[int]]:
    """Each group's first-turn prompt (the graph's two tasks, alternating), repeated
    ``group_size`` times; ``distinct``: each row's user turn opens with its own word."""
    from rollart.env.natural import CALC_SYSTEM, GUESS_SYSTEM, CalculatorEnv, GuessNumberEnv

    rows = []
    for g in range(groups):
        if g % 2 == 0:
            system, env = GUESS_SYSTEM, GuessNumberEnv()
        else:
            system, env = CALC_SYSTEM, CalculatorEnv()
        user = env._reset(g)
        for r in range(group_size):
            text = f"Round {g * group_size + r}. {user}" if distinct else f"Round 0. {user}"
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
            rows.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False))
    return [list(map(int, ids)) for ids in rows]


def counted(ids: list[int], stop: int) -> int:
    """Generated tokens up to and including the first stop token."""
    return ids.index(stop) + 1 if stop in ids else len(ids)


def run_engine(engine, rows: list[list[int]], new: int, stop: int, seed: int) -> tuple[int, float]:
    from rollart.types import GenRequest

    reqs = [GenRequest(p, new, 1.0, 1.0, (stop,), seed * 100_003 + i, request_id=f"r{i}")
            for i, p in enumerate(rows)]
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    wall = time.perf_counter() - t0
    return sum(counted(r.token_ids, stop) for r in out), wall


@torch.inference_mode()
def run_bare(model, tokenizer, rows: list[list[int]], new: int, stop: int,
             seed: int) -> tuple[int, float]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                         temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                         eos_token_id=stop, pad_token_id=pad)
    wall = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    return sum(counted(g, stop) for g in gen), wall


def vllm_side(args) -> None:
    """The child process's part (``--side vllm``): the vLLM engine on ``--rows``' requests;
    prints one JSON line of tokens/s per round."""
    import json

    from rollart.rollout.vllm_engine import VLLMEngine

    spec = json.loads(Path(args.rows).read_text())
    engine = VLLMEngine(spec["path"], max_batch=len(spec["rows"]))
    run_engine(engine, spec["rows"], spec["new"], spec["stop"], 10_000)  # warm-up
    rates = []
    for r in range(spec["rounds"]):
        tokens, wall = run_engine(engine, spec["rows"], spec["new"], spec["stop"], r)
        rates.append(tokens / wall)
    print("VLLM " + json.dumps(rates), flush=True)


def run_vllm(python: str, path: str, rows, new: int, stop: int, rounds: int,
             threads: int) -> list[float]:
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"path": path, "rows": rows, "new": new, "stop": stop,
                   "rounds": rounds}, f)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([python, __file__, "--side", "vllm", "--rows", f.name],
                          env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the vLLM side failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[5:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new", type=int, default=48, help="max new tokens per row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--vllm-python", default=None,
                   help="a python with vllm (the vLLM venv): add the vLLM engine's side")
    p.add_argument("--side", choices=("vllm",), help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="one round of 2 groups of 4, 16 new tokens (a smoke run)")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.side == "vllm":
        return vllm_side(args)
    if args.quick:
        args.groups, args.group_size, args.new, args.rounds = 2, 4, 16, 1
    run = Run("engine_real", args, argv)
    torch.set_num_threads(args.threads)

    from rollart.model import load_model, load_tokenizer
    from rollart.pretrained import resolve_model
    from rollart.rollout.engine import TorchEngine

    path = resolve_model(MODEL)
    tok = load_tokenizer(path)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    shared = prompts(tok, args.groups, args.group_size, distinct=False)
    distinct = prompts(tok, args.groups, args.group_size, distinct=True)
    n = len(shared)
    model = load_model(path)
    engines = {"engine": TorchEngine(path, max_batch=n, prefix_cache=0),
               "engine_nobatch": TorchEngine(path, max_batch=1, prefix_cache=0)}
    sides = {
        "bare": lambda s: run_bare(model, tok, shared, args.new, stop, s),
        "engine": lambda s: run_engine(engines["engine"], shared, args.new, stop, s),
        "engine_noshare": lambda s: run_engine(engines["engine"], distinct, args.new, stop, s),
        "engine_nobatch": lambda s: run_engine(engines["engine_nobatch"],
                                               shared[:args.group_size], args.new, stop, s),
    }
    for name, fn in sides.items():  # warm-up, untimed
        fn(10_000)
        print(f"warmed {name}", flush=True)
    rates: dict[str, list[float]] = {k: [] for k in sides}
    gen: list[float] = []
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # order rotated
            tokens, wall = sides[name](r)
            rates[name].append(tokens / wall)
            if name == "engine":
                gen.append(tokens / n)
        print(f"round {r}: " + " ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()),
              flush=True)
    del engines, model  # the vLLM side gets the memory and the cores
    if args.vllm_python:
        rates["vllm"] = run_vllm(args.vllm_python, path, shared, args.new, stop,
                                 args.rounds, args.threads)
        print("vllm " + " ".join(f"{x:.1f}" for x in rates["vllm"]) + " tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    figures = {
        "engine_vs_bare": statistics.median(e / b for e, b in zip(rates["engine"],
                                                                  rates["bare"])),
        **{f"{k}_tok_s": v for k, v in med.items()},
        "batching_gain": statistics.median(
            e / b for e, b in zip(rates["engine"], rates["engine_nobatch"])),
        "sharing_gain": statistics.median(
            e / b for e, b in zip(rates["engine"], rates["engine_noshare"])),
        **({"vllm_vs_engine": med["vllm"] / med["engine"]} if "vllm" in med else {}),
        "rows": n, "new": args.new,
        "prompt_tokens": statistics.mean(map(len, shared)),
        "gen_tokens": statistics.median(gen), "rounds": args.rounds,
        "threads": args.threads, "model": MODEL,
    }
    run.result(figures, {"per_round": rates})


if __name__ == "__main__":
    main()
