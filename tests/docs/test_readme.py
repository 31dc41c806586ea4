"""README.md stays a short front page (issue 41): at most 150 lines, no commit ids or
timestamps (those belong in docs/benchmarks/history.md and benchmarks/results/), and its
two set-up commands are the ones .ci/run runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# 7-40 hex digits with at least one digit and one letter a-f: a commit id, not a word
# ("defaced") or a number ("1234567")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
TIMESTAMP = re.compile(r"\d{1,2}:\d{2}(:\d{2})?\s*UTC|\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
TRAIN = "pip install torch==2.13.0 -e . && python -m rollart train"
TESTS = "pip install torch==2.13.0 -e '.[test]' && python -m pytest"


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_the_readme_is_at_most_150_lines():
    assert len(README.splitlines()) <= 150


def test_no_commit_ids_or_timestamps_in_the_readme():
    assert not COMMIT.findall(README), "commit ids go to docs/benchmarks/history.md"
    assert not TIMESTAMP.findall(README), "timestamps go to docs/benchmarks/history.md"


def test_the_patterns_catch_what_they_should():
    assert COMMIT.findall("commit a15a3ec, and 7d75461") == ["a15a3ec", "7d75461"]
    assert not COMMIT.findall("defaced 1234567 torch==2.13.0 0xff")
    assert TIMESTAMP.search("2026-12-02 05:45–05:54 UTC")
    assert TIMESTAMP.search("2026-12-04T17:46:40+00:00") and not TIMESTAMP.search("6 min 33 s")


def test_the_two_set_up_commands_are_the_readme_s_first_and_ci_runs_the_test_one():
    blocks = _bash_blocks(README)
    assert blocks[:2] == [TRAIN, TESTS]
    assert blocks[1] in (ROOT / "docs/quickstart.md").read_text()
    assert blocks[0] in (ROOT / "docs/quickstart.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    # .ci/run runs the same command, quietly: the same words with pip's -q
    run = [line.strip() for line in ci.splitlines() if "python -m pytest" in line
           and "pip install" in line]
    assert [r.replace("pip install -q ", "pip install ") for r in run] == [TESTS], run
