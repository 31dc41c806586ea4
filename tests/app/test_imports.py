"""Light modules stay light: a process that imports rollart's types, graph, buffer or
plain rewards (a reward worker, the CLI's argument checks) does not import torch or
transformers (~5 s of CPU a process); the package's names still resolve."""

import subprocess
import sys

import pytest

LIGHT = "rollart.types, rollart.config.graph, rollart.buffer, rollart.reward.functions"


def test_light_modules_do_not_import_torch():
    code = (f"import sys, {LIGHT}\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_package_names_resolve_on_first_use():
    import rollart
    import rollart.rollout

    assert rollart.train.__module__ == "rollart.control.loop"
    assert rollart.H800 == "H800" and "Policy" in dir(rollart)
    assert rollart.rollout.TorchEngine.__module__ == "rollart.rollout.engine"
    for name in rollart.__all__:
        assert getattr(rollart, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rollart.nope  # noqa: B018
