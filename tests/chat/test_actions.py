"""Reading the action out of the assistant's text (``rollart.chat.actions``): each helper,
a chain of them, and a ``Task`` holding a chain pickles."""

import doctest
import pickle

import pytest

from rollart.chat import actions
from rollart.chat.actions import ParseChain, answer_tag, last_line, strip_think, whole_text
from rollart.env.builtin.guess import GuessEnv
from rollart.env.tasks import Task
from rollart.reward import success_reward


def test_doctests():
    assert doctest.testmod(actions).failed == 0


def test_parse_action_helpers():
    text = "<think>the wall is left\nso up</think>\nI go\n<answer> up </answer>\n"
    assert whole_text("  up \n") == "up"
    assert last_line(text) == "<answer> up </answer>"
    assert answer_tag(text) == "up"
    assert answer_tag("<answer>1</answer> then <answer>2</answer>") == "2"
    assert answer_tag("up") == ""
    assert strip_think(text) == "I go\n<answer> up </answer>"
    assert strip_think("<think>unfinished thought up") == ""
    chain = ParseChain(strip_think, answer_tag)
    assert chain("<think><answer>no</answer></think><answer>yes</answer>") == "yes"
    assert pickle.loads(pickle.dumps(chain))("<answer>x</answer>") == "x"
    with pytest.raises(TypeError):
        ParseChain("not callable")
    t = Task(name="t", env_factory=GuessEnv, reward_fn=success_reward, max_turns=3,
             parse_action=chain, stop=("</answer>",))
    assert pickle.loads(pickle.dumps(t)).parse_action("<answer>up</answer>") == "up"
