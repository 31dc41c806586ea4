"""The old ``rollart.env`` paths of the modules that moved out (one release): each
imports with a ``DeprecationWarning`` naming its new home and hands back the very same
objects, and what crosses a Dask boundary pickles by the new path."""

import importlib
import pickle
import sys

import pytest

MOVED = {
    "rollart.env.conversation": "rollart.chat.conversation",
    "rollart.env.template_support": "rollart.chat.template_support",
    "rollart.env.template_cache": "rollart.chat.template_cache",
    "rollart.env.tool_formats": "rollart.chat.tool_formats",
    "rollart.env.tools": "rollart.chat.tools",
    "rollart.env.agent": "rollart.agents.agent",
    "rollart.env.endpoint": "rollart.agents.endpoint",
    "rollart.env.sandbox": "rollart.env.adapters.sandbox",
    "rollart.env.faults": "rollart.chaos.faults",
    "rollart.env.workload": "rollart.chaos.workload",
    "rollart.env.corpus": "rollart.corpus",
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_warns_and_re_exports_the_new_one(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        shim = importlib.import_module(old)
    home = importlib.import_module(new)
    names = getattr(home, "__all__", None) or [n for n in vars(home) if not n.startswith("_")]
    assert names
    for name in names:
        assert getattr(shim, name) is getattr(home, name), name


def test_names_old_imports_used_are_still_there():
    for old, names in {"rollart.env.template_support": ("check_templates", "ChatTemplateError",
                                                        "_NOTED"),
                       "rollart.env.conversation": ("ConversationFormat", "TokenLog", "_WARNED",
                                                    "whole_text", "ParseChain"),
                       "rollart.env.agent": ("AgentTask", "Task", "agent_session"),
                       "rollart.env.sandbox": ("run_code", "_ZYGOTE_PROCESS")}.items():
        with pytest.warns(DeprecationWarning):
            sys.modules.pop(old, None)
            shim = importlib.import_module(old)
        assert all(hasattr(shim, n) for n in names), old


def test_objects_pickle_by_their_new_path():
    from rollart import AgentTask, Faults, with_faults

    faulty = pickle.dumps(with_faults("gridnav", Faults(step=0.01)))
    assert b"rollart.chaos.faults" in faulty and b"rollart.env.faults" not in faulty
    agent = pickle.dumps(AgentTask(name="a", agent=_agent, max_turns=1))
    assert b"rollart.agents.agent" in agent and b"rollart.env.agent" not in agent


def _agent(endpoint, seed):
    return 1.0
