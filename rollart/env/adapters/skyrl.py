"""skyrl-gym adapter: its multi-turn ``gsm8k_multi_turn`` and ``text2sql`` envs on local
data, behind rollart's ``Env`` contract.

``SkyRLEnv(env_id, data_file)`` reads a JSONL file of rows ``{"prompt": str, ...extras}``
(the extras skyrl-gym's env expects: ``reward_spec``, ``db_id``, ``data``, …); seed ``s``
plays row ``s % len(rows)``: ``skyrl_gym.make(env_id, env_config=..., extras=row)``, then
``env.init(prompt)``. skyrl-gym observations are chat messages; the adapter shows their
contents. The library's per-turn rewards and ``done`` are used as they are (gsm8k: 1 for
the right ``#### N``, a small format score otherwise; text2sql: the SQL tool result each
turn, the execution match of ``<solution>`` at the end, -1 for a badly formatted final
answer). A reply that does not match the env's move pattern (``#### N``; ``<sql>``/
``<solution>``) is still passed to the library, and also costs ``INVALID_PENALTY``.

``write_gsm8k_data`` and ``write_text2sql_data`` generate the local data (arithmetic word
problems; a small SQLite database with questions and gold SQL), since the public sets
need downloads. Needs ``skyrl-gym``.
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
from dataclasses import dataclass
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task, wrap_action


@dataclass
class SQLConfig:
    """skyrl-gym's text2sql env config: ``db_path`` holds ``spider/database/<db>/``."""

    db_path: str


class SkyRLEnv(AdapterEnv):
    """One skyrl-gym text env over the rows of a local JSONL data file."""

    def __init__(self, env_id: str, data_file: str, *, name: str = "skyrl",
                 max_turns: int = 3, db_root: str | None = None,
                 move_pattern: str | None = None, wrap: tuple[str, str] | None = None):
        super().__init__(max_turns)
        self.env_id, self.data_file, self.name, self.db_root = env_id, data_file, name, db_root
        self.move_pattern, self.wrap = move_pattern, wrap
        self._rows: list[dict] | None = None

    def _data(self) -> list[dict]:
        if self._rows is None:
            with open(self.data_file) as f:
                self._rows = [json.loads(line) for line in f if line.strip()]
            if not self._rows:
                raise ValueError(f"{self.data_file} has no rows")
        return self._rows

    @staticmethod
    def _text(messages) -> str:
        return "\n".join(str(m.get("content", "")).strip() for m in messages or [] if m)

    def _reset(self, seed: int) -> str:
        import skyrl_gym

        row = dict(self._data()[seed % len(self._data())])
        prompt = row.pop("prompt")
        extras = {**row, "max_turns": self.max_turns, "extra_info": row.get("extra_info", {})}
        config = SQLConfig(self.db_root) if self.db_root else None
        self._env = skyrl_gym.make(self.env_id, env_config=config, extras=extras)
        messages, _ = self._env.init([{"role": "user", "content": prompt}])
        return self._text(messages)

    def _step(self, action: str):
        move = wrap_action(action, self.wrap[0], self.wrap[1]) if self.wrap else action
        invalid = bool(self.move_pattern) and not re.search(self.move_pattern, move, re.S)
        out = self._env.step(move)
        reward, done = float(out["reward"]), bool(out["done"])
        text = self._text(out["observations"])
        success = done and reward >= 1.0
        if done:
            text = f"{text} {self.name} : {'success' if success else 'failure'} .".strip()
        reward -= INVALID_PENALTY if invalid else 0.0
        return text, reward, done, {"success": success, "invalid": invalid}


# -- local data ---------------------------------------------------------------------------
_ITEMS = ("apples", "books", "coins", "pens", "cards")
_NAMES = ("Tom", "Ana", "Lee", "Sam", "Kim")


def write_gsm8k_data(path: str, n: int = 64, seed: int = 0) -> str:
    """Write ``n`` gsm8k-style word problems (``#### N`` answers) as skyrl-gym rows."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            if rng.random() < 0.5:
                q, ans = f"{who} has {a} {item} and gets {b} more . How many {item} now ?", a + b
            else:
                a = a + b
                q, ans = f"{who} has {a} {item} and gives away {b} . How many {item} now ?", a - b
            row = {"prompt": f"{q} Answer with #### N .", "reward_spec": {
                "method": "rule", "ground_truth": str(ans)}, "extra_info": {}}
            f.write(json.dumps(row) + "\n")
    return path


_PETS = [("rex", "dog", 3), ("tom", "cat", 5), ("bo", "dog", 1), ("kit", "cat", 2),
         ("polly", "bird", 4), ("nemo", "fish", 1)]
SQL_QUESTIONS = [
    ("How many pets are there ?", "SELECT count(*) FROM pets"),
    ("List the names of all dogs .", "SELECT name FROM pets WHERE kind = 'dog'"),
    ("What is the age of the oldest pet ?", "SELECT max(age) FROM pets"),
    ("How many cats are there ?", "SELECT count(*) FROM pets WHERE kind = 'cat'"),
    ("List the names of pets older than 2 .", "SELECT name FROM pets WHERE age > 2"),
]


def write_text2sql_data(root: str, db_id: str = "pets") -> tuple[str, str]:
    """Create ``root/spider/database/<db_id>/<db_id>.sqlite`` and a JSONL of questions
    with gold SQL; return ``(db_root, data_file)`` for ``text2sql_task``."""
    db_dir = os.path.join(root, "spider", "database", db_id)
    os.makedirs(db_dir, exist_ok=True)
    db_file = os.path.join(db_dir, f"{db_id}.sqlite")
    if os.path.exists(db_file):
        os.remove(db_file)
    with sqlite3.connect(db_file) as conn:
        conn.execute("CREATE TABLE pets (name TEXT, kind TEXT, age INTEGER)")
        conn.executemany("INSERT INTO pets VALUES (?, ?, ?)", _PETS)
    schema = "table pets ( name TEXT , kind TEXT , age INTEGER )"
    data_file = os.path.join(root, f"{db_id}.jsonl")
    with open(data_file, "w") as f:
        for question, sql in SQL_QUESTIONS:
            prompt = (f"Database schema : {schema} . Question : {question} Think in <think> "
                      "</think> , run SQL in <sql> </sql> , answer in <solution> </solution> .")
            f.write(json.dumps({"prompt": prompt, "db_id": db_id, "data": "spider",
                                "reward_spec": {"method": "rule", "ground_truth": sql}}) + "\n")
    return os.path.join(root), data_file


# -- tasks ----------------------------------------------------------------------------------
def gsm8k_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed random answer ``#### N``."""
    return f"#### {rng.randint(0, 18)}"


def gsm8k_task(data_file: str, name: str = "skyrl_gsm8k", max_turns: int = 3,
               top_p: float | None = None):
    """skyrl-gym ``gsm8k_multi_turn`` over a local data file (see ``write_gsm8k_data``)."""
    factory = partial(SkyRLEnv, "gsm8k_multi_turn", data_file, name=name, max_turns=max_turns,
                      move_pattern=r"#### -?[0-9]", wrap=("####", "#### {}"))
    return make_task(name, factory, max_turns=max_turns, warmup_action=gsm8k_warmup_action,
                     max_new_tokens=4, extra_words=["####", *map(str, range(19))],
                     description="skyrl-gym gsm8k multi-turn on local word problems",
                     top_p=top_p)


SQL_WARMUP = (
    "<sql> SELECT count(*) FROM pets </sql>",
    "<sql> SELECT name FROM pets </sql>",
    "<think> done </think> <solution> SELECT count(*) FROM pets </solution>",
    "<think> done </think> <solution> SELECT name FROM pets </solution>",
)


def sql_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed random tool call or final answer."""
    return rng.choice(SQL_WARMUP)


def text2sql_task(db_root: str, data_file: str, name: str = "skyrl_sql", max_turns: int = 3,
                  top_p: float | None = None):
    """skyrl-gym ``text2sql`` on a local SQLite database (see ``write_text2sql_data``)."""
    factory = partial(SkyRLEnv, "text2sql", data_file, name=name, max_turns=max_turns,
                      db_root=db_root, move_pattern=r"<sql>.*?</sql>|<solution>.*?</solution>")
    return make_task(name, factory, max_turns=max_turns, warmup_action=sql_warmup_action,
                     max_new_tokens=16, vocab_seeds=range(len(SQL_QUESTIONS)),
                     description="skyrl-gym text2sql on a local SQLite database", top_p=top_p)
