"""The verifiers graph: a prime-intellect ``verifiers`` taskset trains in rollart.

``sums_verifiers`` is a verifiers (v1) environment — ``SumsTaskset``, one-digit sums
whose reward is verifiers' ``@vf.reward`` (``rollart.env.adapters.verifiers_example``),
written with verifiers' own classes — turned into a rollart task by
``verifiers_task(make_sums, name=...)`` (``rollart.env.adapters.verifiers``): each
trajectory is one verifiers rollout (``vf.Agent.run``) against the OpenAI-compatible
endpoint rollart serves for it, and its reward is the one verifiers computed.

``sums`` is the same taskset as a plain env task: the chat toy is built from env tasks'
text and warmed up on them (an agent task has no warm-up of its own), and the two tasks
put the same turn in front of the model. Point ``Policy.model`` at a chat model folder
to train that instead (then ``sums`` is only a comparison). Needs ``verifiers``
(``pip install 'rollart[agents]'``). ``python -m rollart train graphs/verifiers.py``.
"""

from rollart import GRPO, Graph, Policy
from rollart.env.adapters.verifiers import verifiers_task
from rollart.env.adapters.verifiers_example import make_sums, sums_env_task

ANSWER_TOKENS = 4  # a one-digit answer and the end-of-turn token fit


def tasks() -> tuple:
    env_task = sums_env_task("sums", max_new_tokens=ANSWER_TOKENS)
    agent_task = verifiers_task(make_sums, name="sums_verifiers", max_turns=1,
                                max_new_tokens=ANSWER_TOKENS)
    return env_task, agent_task


def graph() -> Graph:
    return Graph(
        name="verifiers",
        tasks=tasks(),
        policy=Policy(model=None, conversation="chat", warmup_steps=60, warmup_lr=1e-3),
        algo=GRPO(group_size=8, groups_per_step=8, lr=5e-4, kl_coef=0.05),
        steps=40,
    )
