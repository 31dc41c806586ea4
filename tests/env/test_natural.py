"""rollart.env.natural and graphs/real.py: tasks in English for a real chat model, checked
on a tiny model of SmolLM2's template family (a tiny Llama written as GGUF with SmolLM2's
chat template, converted by rollart.pretrained) — the real model is CI's smoke step."""

from __future__ import annotations

import random

import pytest

from rollart.env.natural import (
    CalculatorEnv,
    GuessNumberEnv,
    calculator_warmup_action,
    first_int,
    last_int,
)


def _play(env, action):
    r = env.step(action)
    return r.observation, r.reward, r.done, r.info


def _bisect(env: GuessNumberEnv, seed: int) -> tuple[bool, int]:
    env.reset(seed)
    lo, hi = 1, env.high
    for turn in range(1, env.max_turns + 1):
        guess = (lo + hi) // 2
        obs, reward, done, info = _play(env, f"My guess is {guess}.")
        if info.get("success"):
            assert reward == 1.0 and done and obs.startswith("Correct")
            return True, turn
        assert obs.startswith(("Higher.", "Lower."))
        lo, hi = (guess + 1, hi) if obs.startswith("Higher.") else (lo, guess - 1)
    return False, env.max_turns


def test_guess_number_is_won_by_bisection_and_not_by_chance():
    env = GuessNumberEnv()
    assert all(_bisect(env, s)[0] for s in range(200))
    rng, wins = random.Random(0), 0
    for seed in range(400):  # a random guesser that ignores the hints
        env.reset(seed)
        for _ in range(env.max_turns):
            _, _, done, info = _play(env, str(rng.randint(1, 10)))
            if done:
                wins += bool(info.get("success"))
                break
    assert 0.2 < wins / 400 < 0.5  # room above chance for RL: bisection wins every time


def test_guess_number_says_what_was_wrong():
    env = GuessNumberEnv()
    first = env.reset(3)
    assert "1 to 10" in first and "4 guesses" in first
    obs, reward, done, info = _play(env, "hmm, let me think")
    assert info["invalid"] and reward == pytest.approx(-0.1) and not done
    assert "not a number" in obs and "3 guesses left" in obs


def test_calculator_judges_the_last_number_and_its_tool_computes():
    env = CalculatorEnv()
    question = env.reset(5)
    assert question.startswith("What is ") and question.endswith("?")
    call = calculator_warmup_action(random.Random(0), question)
    assert call.startswith("<tool_call>") and '"name": "python"' in call
    expr = question[len("What is "):-1]
    result = env.call_tool("python", {"code": expr})
    assert int(result) == eval(expr)  # noqa: S307 - the test's own expression
    obs, reward, done, info = _play(env, f"{expr} = {result}")
    assert info["success"] and reward == 1.0 and done
    env.reset(5)
    _, reward, done, info = _play(env, str(int(result) + 1))
    assert not info["success"] and reward == 0.0 and done
    env.reset(5)
    _, reward, done, info = _play(env, "I cannot say")
    assert info["invalid"] and not done


def test_numbers_in_replies():
    assert first_int("Is it 7? or 8") == 7 and last_int("7 + 8 = 15") == 15
    assert first_int("") is None and last_int("1,234") == 1234


@pytest.fixture(scope="module")
def smol_family(tmp_path_factory):
    """A tiny model folder with SmolLM2's chat template (from a GGUF file, as the real one)."""
    from rollart.pretrained import convert_gguf
    from rollart.testing import write_tiny_gguf

    where = tmp_path_factory.mktemp("smol")
    path, _, _ = write_tiny_gguf(where / "tiny-smol.gguf")
    return convert_gguf(path, where / "folder")


def test_real_graph_tasks_render_with_the_model_family_template(smol_family):
    from rollart import load_graph
    from rollart.chat.conversation import ConversationFormat
    from rollart.chat.template_support import opening
    from rollart.chat.tools import python_tool
    from rollart.config.templates import check_templates
    from rollart.model import load_tokenizer

    graph, _ = load_graph("graphs/real.py")
    check_templates(graph, smol_family)  # SmolLM2's template ignores tools=: in the prompt
    calc = next(t for t in graph.tasks if t.name == "calculator")
    fmt = ConversationFormat(load_tokenizer(smol_family), "chat", max_context=1024,
                             model_path=smol_family, cache=False)
    system, tools = opening(fmt, calc, [python_tool()])
    assert tools is None and '"name": "python"' in system and "<tool_call>" in system


@pytest.mark.slow
def test_real_graph_trains_two_steps_on_a_tiny_model_of_its_family(smol_family, tmp_path):
    from tests.graph_runs import train_briefly

    graph, result, rows = train_briefly("graphs/real.py:smoke", tmp_path / "run",
                                        model=smol_family)
    assert graph.policy.lora is not None
    assert {r["task"] for r in rows} == {"guess_number", "calculator"}
    from rollart.model import load_tokenizer

    tok = load_tokenizer(smol_family)
    text = tok.decode(rows[0]["prompt_ids"] + rows[0]["response_ids"])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in text


def _demo_nll(model, batch) -> float:
    """Mean NLL of the model's own turns in a batch of demonstrations."""
    import torch

    from rollart.trainer.losses import target_logprobs

    ids, attn, mask = batch
    target = mask[:, 1:]
    with torch.no_grad():
        nll = -target_logprobs(model, ids, attn, target > 0)
    return float((nll * target).sum() / target.sum())


def test_calculator_demonstrations_teach_the_tool_call_on_the_model_turns_only(smol_family):
    """A pretrained model's warm-up (``Policy.warmup_pretrained``: obs_weight 0): the
    demonstrations' own turns get likelier on episodes it never saw, and the loss never
    touches the system prompt, question or tool results."""
    from rollart.chat.conversation import ConversationFormat
    from rollart.env.natural import calculator_task
    from rollart.model import load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup, warmup_batch

    tok, model = load_tokenizer(smol_family), load_model(smol_family)
    task = calculator_task()
    fmt = ConversationFormat(tok, "chat", max_context=1024, model_path=smol_family,
                             cache=False)
    held_out = warmup_batch([task], tok, 8, random.Random(99), fmt)
    ids, attn, mask = held_out
    text = tok.decode(ids[0][mask[0] > 0].tolist())
    assert "<tool_call>" in text and "What is" not in text  # the call is trained, the
    before = _demo_nll(model, held_out)  # question is not
    losses = run_warmup(model, tok, [task], steps=30, batch_size=4, lr=3e-3,
                        obs_weight=0.0, conversation="chat", max_context=1024)
    after = _demo_nll(model, held_out)
    assert len(losses) == 30 and after < 0.7 * before, (before, after, losses[::5])


@pytest.mark.slow
def test_warm_graph_fine_tunes_a_model_folder_on_its_demonstration_tasks_only(
        smol_family, tmp_path, capsys):
    """``graphs/real.py:warm_smoke``: the model folder is warmed up (a pretrained model is
    not, unless ``Policy.warmup_pretrained``), here on calculator only (``warmup_tasks``:
    the other task has no demonstrations in this test, so playing it would raise), saved
    and evaluated as its own row before RL."""
    from dataclasses import replace

    from rollart import load_graph
    from rollart.env.natural import guess_number_task
    from tests.graph_runs import train_briefly

    graph, _ = load_graph("graphs/real.py:warm_smoke")
    no_demos = replace(guess_number_task(), warmup_action=None)
    graph = replace(graph, tasks=(no_demos, *graph.tasks[1:]))
    _, result, rows = train_briefly(graph, tmp_path / "run", model=smol_family,
                                    warmup_steps=2, warmup_batch=4,
                                    warmup_tasks=("calculator",))
    assert "warm-up: 2 demonstration steps" in capsys.readouterr().out
    assert result.warmup_model_dir and (tmp_path / "run" / "warmup_model").is_dir()
    import json

    ev = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert set(ev["warmup"]) >= {"guess_number", "calculator"}
    assert {r["task"] for r in rows} == {"guess_number", "calculator"}
