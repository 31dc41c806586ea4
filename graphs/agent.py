"""The agent graph: one game played two ways, as an ``Env`` and by an ``openai``-client agent.

``guess`` is the built-in game (a number in 1..9, higher/lower feedback) as a chat task
whose env the runner steps. ``guess_agent`` is the same game played by ``play_guess``,
an agent written as anyone writes one against an OpenAI-compatible API: it owns the env,
sends the conversation with ``openai.OpenAI(...).chat.completions.create`` to the
endpoint rollart gives it (``rollart.AgentTask``; ``rollart.agents.agent``), steps the env
with each reply, and returns the episode, which the game's own reward scores. Both tasks
put the same turns in front of the model (each observation a ``user`` message, each reply
the ``assistant`` message), so their trajectories are alike token for token and their
figures compare the two ways of running a task (``benchmarks/agent_endpoint.py``).

The model is the chat toy built from ``guess``'s text and warmed up on it (the agent task
has no warm-up of its own: its text is the env task's); point ``Policy.model`` at a chat
model folder to train that instead. ``python -m rollart train graphs/agent.py``.
"""

from dataclasses import replace

from rollart import GRPO, AgentTask, Episode, Graph, Policy
from rollart.env.builtin import guess
from rollart.env.tasks import BUILTIN_TASKS

GAME_TOKENS = 4  # one action word and the end-of-turn token fit (as graphs/chat.py)


def play_guess(endpoint, seed: int) -> Episode:
    """Play one game of ``guess`` through the OpenAI-compatible ``endpoint``."""
    import openai

    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                           max_retries=0)
    env = guess.GuessEnv()
    observations, actions, rewards, info = [env.reset(seed)], [], [], {}
    messages = [{"role": "user", "content": observations[0]}]
    try:
        for _ in range(guess.MAX_TURNS):
            out = client.chat.completions.create(model=endpoint.model, messages=messages)
            reply = out.choices[0].message.content or ""
            step = env.step(reply.strip())
            actions.append(reply.strip())
            rewards.append(step.reward)
            info = step.info
            if step.done:
                break
            observations.append(step.observation)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": step.observation}]
    finally:
        env.close()
    return Episode("guess_agent", seed, observations, actions, rewards, info)


def tasks() -> tuple:
    env_task = replace(BUILTIN_TASKS["guess"], max_new_tokens=GAME_TOKENS)
    agent_task = AgentTask(name="guess_agent", agent=play_guess, reward_fn=guess.reward_fn,
                           max_turns=guess.MAX_TURNS, max_new_tokens=GAME_TOKENS)
    return env_task, agent_task


def graph() -> Graph:
    return Graph(
        name="agent",
        tasks=tasks(),
        policy=Policy(model=None, conversation="chat", warmup_steps=60, warmup_lr=1e-3),
        algo=GRPO(group_size=8, groups_per_step=8, lr=5e-4, kl_coef=0.05),
        steps=40,
    )
