"""Task records: what the rollout stage needs to run one kind of episode.

A ``Task`` bundles an env factory, a reward function, turn/token limits, the random
valid-action policy used for the supervised warm-up, how the assistant's text becomes the
env's action (``parse_action``, ``stop`` strings, the ``system_prompt`` of a chat model,
the ``invalid_penalty`` of a bad tool call, ``tools_in_prompt`` for a template that does
not render tools: ``rollart.chat.conversation``; ``tool_format``, the syntax of its tool
calls when not the template's own: ``rollart.chat.tool_formats``), and — only for
building the built-in word-level toy tokenizer — a vocabulary. ``BUILTIN_TASKS`` lists the built-in ones explicitly; ``get_task``
resolves a name; ``task_corpus`` gives the tokenizer its words. Consumed by the env
manager, the warm-up, and the CLI/config layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable

from rollart.env.builtin import boxpush, gridnav, guess
from rollart.chat.actions import whole_text
from rollart.env.protocol import Env
from rollart.chat.tool_formats import TOOL_FORMATS
from rollart.types import Episode


class UnknownTaskError(KeyError):
    """``get_task`` got a name that is not a built-in task."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Task:
    """One task. ``env_factory`` and ``reward_fn`` must pickle (use a class and a
    module-level function, not a lambda) since they travel to Dask workers."""

    name: str  # unique task name (metrics: reward/NAME, success/NAME)
    env_factory: Callable[[], Env]  # makes one env (picklable: a class or module-level function)
    reward_fn: Callable[[Episode], float]  # an episode -> its reward (module-level, picklable)
    max_turns: int  # turns before the episode is cut
    max_new_tokens: int = 4  # tokens generated per turn at most
    warmup_action: Callable[..., str] | None = None  # (rng, observation) -> action
    vocabulary: Callable[[], list[str]] | None = None  # the words the built-in tokenizer must know
    description: str = ""  # one line about the task
    affinity: Any = None  # rollart.policy.affinity.Affinity: where it generates (task_affinity)
    top_p: float | None = None  # per-task nucleus sampling (None = the policy's top_p)
    stop: tuple[str, ...] = ()  # stop strings: generation ends once one is produced
    system_prompt: str | None = None  # chat: the system message (overrides the policy's)
    parse_action: Callable[[str], Any] = whole_text  # assistant text -> env action
    invalid_penalty: float = 0.1  # subtracted (as an env reward) per invalid tool call
    # chat: the env's tool schemas written into the system prompt (one JSON schema per
    # line, rollart.chat.template_support.tools_prompt) instead of the template's tools=,
    # for a chat template that does not render tools
    tools_in_prompt: bool = False
    # chat: how the model writes tool calls (rollart.chat.tool_formats: "hermes", "llama3",
    # "mistral", "qwen3_coder"); None = the format detected from the chat template
    tool_format: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(
                f"Task.name must be a non-empty str without whitespace, got {self.name!r}; "
                "use e.g. 'my_task'"
            )
        for field_name in ("max_turns", "max_new_tokens"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Task {self.name!r}: {field_name} must be an int >= 1, got {value!r}"
                )
        if self.top_p is not None and not (isinstance(self.top_p, (int, float))
                                           and 0 < self.top_p <= 1):
            raise ValueError(f"Task {self.name!r}: top_p must be in (0, 1] or None, "
                             f"got {self.top_p!r}")
        self._check_text_fields()
        for field_name in ("env_factory", "reward_fn", "parse_action"):
            if not callable(getattr(self, field_name)):
                raise TypeError(_not_callable(self.name, field_name, getattr(self, field_name)))
        for field_name in ("warmup_action", "vocabulary"):
            value = getattr(self, field_name)
            if value is not None and not callable(value):
                raise TypeError(_not_callable(self.name, field_name, value) + " or None")


    def _check_text_fields(self) -> None:
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, tuple) or not all(
                isinstance(s, str) and s for s in stop):
            raise TypeError(f"Task {self.name!r}: stop must be a tuple of non-empty strings, "
                            f"got {stop!r}; e.g. stop=('</answer>',)")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError(f"Task {self.name!r}: system_prompt must be a str or None, got "
                            f"{type(self.system_prompt).__name__}")
        if not isinstance(self.tools_in_prompt, bool):
            raise TypeError(f"Task {self.name!r}: tools_in_prompt must be True or False, "
                            f"got {self.tools_in_prompt!r}")
        if self.tool_format is not None and self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"Task {self.name!r}: tool_format must be one of "
                             f"{', '.join(TOOL_FORMATS)} or None (detected from the chat "
                             f"template), got {self.tool_format!r}")
        pen = self.invalid_penalty
        if isinstance(pen, bool) or not isinstance(pen, (int, float)) or not pen >= 0:
            raise ValueError(f"Task {self.name!r}: invalid_penalty must be a number >= 0, "
                             f"got {pen!r}")


def _not_callable(task: str, field_name: str, value: Any) -> str:
    hint = {
        "parse_action": "pass a module-level function text -> action (see "
                        "rollart.chat.actions: whole_text, last_line, answer_tag)",
        "env_factory": "pass the env class (e.g. GridNavEnv), not an instance",
        "reward_fn": "pass a module-level function Episode -> float",
        "warmup_action": "pass a function (rng, observation) -> action",
        "vocabulary": "pass a function () -> list[str]",
    }[field_name]
    return f"Task {task!r}: {field_name} must be callable, got {type(value).__name__}; {hint}"


def _builtin(module: ModuleType, env_cls: type) -> Task:
    return Task(
        name=module.NAME,
        env_factory=env_cls,
        reward_fn=module.reward_fn,
        max_turns=module.MAX_TURNS,
        warmup_action=module.warmup_action,
        vocabulary=module.vocabulary,
        description=module.DESCRIPTION,
    )


BUILTIN_TASKS: dict[str, Task] = {
    "gridnav": _builtin(gridnav, gridnav.GridNavEnv),
    "guess": _builtin(guess, guess.GuessEnv),
    "boxpush": _builtin(boxpush, boxpush.BoxPushEnv),
}


def get_task(name_or_task: str | Task) -> Task:
    """Return ``name_or_task`` if it is a ``Task``, else the built-in task of that name,
    else the library-adapter task of that name (``rollart.env.adapters.ADAPTER_TASKS``)."""
    if isinstance(name_or_task, Task):
        return name_or_task
    if not isinstance(name_or_task, str):
        raise TypeError(
            f"get_task expects a task name (str) or a Task, got {type(name_or_task).__name__}"
        )
    if name_or_task in BUILTIN_TASKS:
        return BUILTIN_TASKS[name_or_task]
    # import cycle, kept in here: the adapters build Tasks; and rollart[envs] loads on use
    from rollart.env.adapters import ADAPTER_TASKS

    factory = ADAPTER_TASKS.get(name_or_task)
    if factory is None:
        known = ", ".join(sorted(BUILTIN_TASKS) + sorted(ADAPTER_TASKS))
        raise UnknownTaskError(
            f"unknown task {name_or_task!r}; known tasks: {known} "
            "(or pass a rollart.env.Task object)"
        )
    return factory()


def is_agent_task(task) -> bool:
    """Whether ``task`` is played by an agent through rollart's chat endpoint
    (``rollart.agents.agent.AgentTask``) rather than by an env."""
    return getattr(task, "agent", None) is not None


def warmup_tasks(tasks: Iterable[Task]) -> tuple[Task, ...]:
    """The tasks an env plays, which the built-in model's corpus and format warm-up are
    made from (an ``AgentTask``'s text is its agent's; ``rollart.agents.agent``). None left
    is a ``ValueError`` naming the fix."""
    tasks = tuple(tasks)
    out = tuple(t for t in tasks if not is_agent_task(t))
    if tasks and not out:
        raise ValueError("every task is an AgentTask, so the built-in model has no text to "
                         "be built and warmed up from: give the graph a chat model folder "
                         "(Policy.model or --model) or add a task its env plays")
    return out


def task_corpus(tasks: Iterable[str | Task]) -> list[str]:
    """Sorted union of the tasks' vocabularies: the words the tokenizer must know."""
    words: set[str] = set()
    for item in tasks:
        task = get_task(item)
        if task.vocabulary is None:
            raise ValueError(
                f"task {task.name!r} has no vocabulary; give Task(vocabulary=...) a function "
                "returning every observation word and action word"
            )
        words.update(task.vocabulary())
    return sorted(words)
