"""Chat rendering benchmark: warm-up batches/s of the chat graph's tasks, with the
template cache (``rollart.chat.template_cache``) and with full renders.

Builds the chat toy's tokenizer from ``graphs/chat.py``'s tasks (``chat_corpus``), then
times ``rollart.trainer.warmup.warmup_batch`` (batch 32: random episodes rendered in chat
form, the CPU half of a warm-up step, no model) for the three games and for all four
tasks (``calc`` runs its sandboxed tool in a subprocess per call), with
``ConversationFormat(cache=True)`` and ``cache=False``. Both sides build the same
episodes (the same seed), and the ids are checked equal.

RESULT keys: ``games_cached``, ``games_full``, ``all_cached``, ``all_full`` (batches/s),
``games_speedup``, ``all_speedup`` (cached ÷ full), ``batches``.

    python benchmarks/chat_render.py --quick
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments  # noqa: E402


def batches_per_s(tasks, tok, cache: bool, batches: int):
    """Batches/s of ``warmup_batch`` on ``tasks`` and the ids it built."""
    from rollart.chat.conversation import ConversationFormat
    from rollart.trainer.warmup import warmup_batch

    fmt = ConversationFormat(tok, "chat", max_context=2048, cache=cache)
    rng = random.Random(0)
    out = []
    t = time.perf_counter()
    for _ in range(batches):
        out.append(warmup_batch(tasks, tok, 32, rng, fmt)[0])
    return batches / (time.perf_counter() - t), out


def main(argv=None) -> dict:
    import torch

    from graphs.chat import tasks as chat_tasks
    from rollart.corpus import chat_corpus
    from rollart.model import build_tiny_model, load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="3 batches per side")
    add_arguments(p)
    args = p.parse_args(argv)
    run = Run("chat_render", args, argv)
    n = 3 if args.quick else args.batches
    torch.set_num_threads(1)
    tasks = chat_tasks()
    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(build_tiny_model(d, chat_corpus(tasks), chat=True))
    result = {}
    for name, group in (("games", tasks[:3]), ("all", tasks)):
        full, ids_full = batches_per_s(group, tok, False, n)
        cached, ids_cached = batches_per_s(group, tok, True, n)
        if any(not torch.equal(a, b) for a, b in zip(ids_full, ids_cached)):
            raise AssertionError(f"{name}: the cached render built other ids than the full")
        result.update({f"{name}_cached": round(cached, 2), f"{name}_full": round(full, 2),
                       f"{name}_speedup": round(cached / full, 2)})
    result["batches"] = n
    run.result(result)
    return result


if __name__ == "__main__":
    main()
