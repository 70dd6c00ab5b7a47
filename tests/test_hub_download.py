"""A Hugging Face id that is not in the cache is downloaded with huggingface_hub (its real
client, over real HTTP) from a local server that answers the Hub's API for a few repos;
then it is decoded exactly as the same checkpoint given as a directory. ``ORG/NAME@REVISION``
downloads that branch or commit."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlparse

import pytest
import torch

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.errors import OptionError

COMMIT = "c0ffee" + "0" * 34
V2_COMMIT = "5ca1ab1e" + "0" * 32  # (acme/target's branch v2)
PR_COMMIT = "9e" + "0" * 38  # (acme/draft's refs/pr/3: its main's files)


class _Hub(BaseHTTPRequestHandler):
    """The Hub's API for the repos in ``self.server.repos`` (id -> directory of its main branch,
    commit :data:`COMMIT`) at a revision (main, a branch or commit in ``self.server.revisions``:
    id -> {revision: (commit, directory)}): repo info, the recursive file tree, and each file at
    ``/{id}/resolve/{revision}/{path}`` (HEAD and GET). Any other repo answers 404 with the
    Hub's ``RepoNotFound`` error code, any other revision with ``RevisionNotFound``."""

    def log_message(self, *args):  # (quiet)
        pass

    def _files(self, root: Path) -> list[str]:
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _revision(self, repo: str, revision: str) -> tuple[str, Path] | None:
        if revision in ("main", COMMIT):
            return COMMIT, self.server.repos[repo]
        return self.server.revisions.get(repo, {}).get(revision)

    def _answer(self, head: bool):
        path = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]  # (refs/pr/3: one quoted part)
        self.server.requests.append("/".join(path))
        repos = self.server.repos
        if "/".join(path[2:4]) in self.server.failing or "/".join(path[:2]) in self.server.failing:
            return self._send(418, b'{"error": "I am a teapot"}', {}, head)
        api = path[:2] == ["api", "models"] and "/".join(path[2:4]) in repos
        if api or (len(path) >= 5 and "/".join(path[:2]) in repos and path[2] == "resolve"):
            found = self._revision("/".join(path[2:4]), path[5] if len(path) > 5 else "main") if api else \
                self._revision("/".join(path[:2]), path[3])
            if found is None:
                return self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, head)
            commit, root = found
        if api:
            if len(path) == 4 or path[4] == "revision":  # (/api/models/ORG/NAME: main's)
                info = {"id": "/".join(path[2:4]), "sha": commit,
                        "siblings": [{"rfilename": f} for f in self._files(root)]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            if path[4] == "tree":
                tree = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                         "oid": hashlib.sha1((root / f).read_bytes()).hexdigest()} for f in self._files(root)]
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
        if len(path) >= 5 and "/".join(path[:2]) in repos and path[2] == "resolve":
            file = root / "/".join(path[4:])
            if file.is_file():
                self.server.fetched.append("/".join(path[4:]))
                if not head and file.suffix == ".safetensors" and "/".join(path[:2]) in self.server.held:
                    self.server.hold.wait()  # (a download that does not end while the test holds it)
                data = file.read_bytes()
                return self._send(200, data, {"X-Repo-Commit": commit,
                                              "ETag": '"' + hashlib.sha1(data).hexdigest() + '"'}, head)
        self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)

    def do_GET(self):
        self._answer(head=False)

    def do_HEAD(self):
        self._answer(head=True)


@pytest.fixture(scope="module")
def hub(tiny_pair, tmp_path_factory):
    """(endpoint URL, server): repos ``acme/target`` (the tiny target, plus files loading does not
    read: PyTorch weights and an ``original/`` subfolder; its branch ``v2``, commit
    :data:`V2_COMMIT`, is ``server.v2``: the tiny target with another final norm), ``acme/draft``
    and ``acme/gguf`` (no config.json)."""
    from safetensors.torch import load_file, save_file

    target, drafter = tiny_pair
    root = tmp_path_factory.mktemp("hubrepos")
    shutil.copytree(target, root / "target")
    shutil.copytree(target, root / "target-v2")
    weights = load_file(root / "target-v2" / "model.safetensors")
    weights["model.norm.weight"] = torch.linspace(0.1, 3.0, weights["model.norm.weight"].numel())
    save_file(weights, root / "target-v2" / "model.safetensors", metadata={"format": "pt"})
    (root / "target" / "pytorch_model.bin").write_bytes(b"not read")
    (root / "target" / "original").mkdir()
    (root / "target" / "original" / "model.safetensors").write_bytes(b"not read")
    (root / "gguf").mkdir()
    (root / "gguf" / "model.gguf").write_bytes(b"GGUF")
    (root / "bin").mkdir()
    shutil.copy(target / "config.json", root / "bin" / "config.json")
    (root / "bin" / "pytorch_model.bin").write_bytes(b"pickle")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    server.repos = {"acme/target": root / "target", "acme/draft": Path(drafter), "acme/gguf": root / "gguf",
                    "acme/bin": root / "bin", "acme/slow": Path(drafter)}
    server.revisions = {"acme/target": {"v2": (V2_COMMIT, root / "target-v2"), V2_COMMIT: (V2_COMMIT, root / "target-v2")},
                        "acme/draft": {"refs/pr/3": (PR_COMMIT, Path(drafter)), PR_COMMIT: (PR_COMMIT, Path(drafter))}}
    server.v2 = root / "target-v2"
    server.failing, server.held, server.hold = {"acme/teapot"}, {"acme/slow"}, threading.Event()
    server.fetched, server.requests = [], []  # (the files fetched; every path asked for)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.hold.set()
    server.shutdown()


def _local(cli, *args: str) -> list[int]:
    """The token ids ``_generate`` gives for checkpoints given as directories (no Hub: in this process)."""
    got = cli("generate", "def f(x):", "--max-new-tokens", "12", "--json", *args)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)["token_ids"]


def _cached_from_hub(cli, monkeypatch, hub, tiny_pair, tmp_path, name: str,
                     files: dict[str, str]) -> tuple[dict, Path, Path]:
    """The tiny target with ``files`` (name -> text) added, served as ``acme/NAME`` and fetched
    once into a new cache, in this process (:func:`_run`; a test skips where huggingface_hub
    keeps no file list of a repo): ``(env, repo directory, snapshot directory)``."""
    endpoint, server = hub
    repo = shutil.copytree(tiny_pair[0], tmp_path / name)
    for file, text in files.items():
        (repo / file).write_text(text)
    server.repos[f"acme/{name}"] = repo
    cache = tmp_path / "hub-cache"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    got = _run(cli, monkeypatch, "--target", f"acme/{name}", "--no-draft", env=env)
    assert got.returncode == 0, got.stderr
    if not (cache / f"models--acme--{name}" / "trees").is_dir():
        pytest.skip("this huggingface_hub keeps no file list of a repo")
    return env, repo, cache / f"models--acme--{name}" / "snapshots" / COMMIT


class _Logged(logging.Handler):
    """The messages of the log records it is given, in order (``lines``)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _hub_env(monkeypatch, env: dict, cwd: Path | None = None) -> None:
    """Set ``env`` (``HF_ENDPOINT``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``: those three, no other)
    for huggingface_hub in this process, where it reads them (see :func:`_run`), with progress
    bars off; then go to ``cwd`` (if given). Undone at the test's end."""
    import importlib

    from huggingface_hub import constants

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # (the module: its package names the class so)
    assert set(env) == {"HF_ENDPOINT", "HF_HUB_CACHE", "HF_HUB_OFFLINE"}, env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    endpoint = env["HF_ENDPOINT"].rstrip("/")
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", env["HF_HUB_OFFLINE"] == "1")
    monkeypatch.setattr(hub_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", True)  # (HF_HUB_DISABLE_PROGRESS_BARS=1)
    if cwd is not None:
        monkeypatch.chdir(cwd)


def _run(cli, monkeypatch, *args: str, env: dict, cwd: Path | None = None) -> SimpleNamespace:
    """:func:`_generate` in this process (the ``cli`` fixture: a process costs ~4 s CPU to start).
    huggingface_hub reads ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` (``env``: those
    three, no other) into ``huggingface_hub.constants`` when it is imported, and it and
    dflash_torch read them there at each call: :func:`_hub_env` sets them there (the resolve URL
    template too, which it builds from the endpoint), and in ``os.environ``, where dflash_torch
    names the offline variable. Its ``stderr``: the WARNING lines logged (dflash_torch's "downloading ...",
    huggingface_hub's retries, transformers': a process prints them on its stderr), then what the
    command printed.
    The tests that are about the process (its stderr whole, variables read at import, Ctrl-C)
    run :func:`_generate`."""
    _hub_env(monkeypatch, env, cwd)
    logged = _Logged()
    transformers = logging.getLogger("transformers")  # (its own lines do not reach the root logger, unless on CI)
    loggers = [logging.getLogger()] + [transformers] * (not transformers.propagate)
    for logger in loggers:
        logger.addHandler(logged)
    try:
        got = cli("generate", "def f(x):", "--max-new-tokens", "12", "--json", *args)
    finally:
        for logger in loggers:
            logger.removeHandler(logged)
    return SimpleNamespace(returncode=got.returncode, stdout=got.stdout,
                           stderr="".join(line + "\n" for line in logged.lines) + got.stderr)


def _generate(*args: str, env: dict, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_torch.cli", "generate", "def f(x):", "--max-new-tokens", "12",
                           "--json", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                                   HF_HUB_DISABLE_PROGRESS_BARS="1", **env))


def test_a_hub_id_not_cached_is_downloaded_then_read_from_the_cache(cli, monkeypatch, hub, tiny_pair, tmp_path):
    endpoint, server = hub
    target, drafter = tiny_pair
    cache = tmp_path / "hub-cache"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    local = cli("generate", "def f(x):", "--max-new-tokens", "12", "--json", "--target", str(target), "--draft",
                str(drafter))
    assert local.returncode == 0, local.stderr
    server.fetched.clear()
    # (a process: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported; the tests below set
    # them where it keeps them, in this process: _run)
    got = _generate("--target", "acme/target", "--draft", "acme/draft", env=env)
    assert got.returncode == 0, got.stderr
    assert "downloading acme/target from the Hugging Face Hub" in got.stderr
    assert json.loads(got.stdout)["text"] == json.loads(local.stdout)["text"]
    assert json.loads(got.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert "model.safetensors" in server.fetched and "tokenizer.json" in server.fetched
    assert "pytorch_model.bin" not in server.fetched and "original/model.safetensors" not in server.fetched
    # cached now: used as it is, without the network (HF_HUB_OFFLINE, and a dead endpoint)
    server.fetched.clear()
    again = _run(cli, monkeypatch, "--target", "acme/target", "--draft", "acme/draft",
                      env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
    assert again.returncode == 0, again.stderr
    assert "downloading" not in again.stderr and server.fetched == []
    assert json.loads(again.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]


def test_a_revision_of_a_hub_id_is_downloaded_then_read_from_the_cache(cli, monkeypatch, hub, tiny_pair, tmp_path):
    """``acme/target@v2`` (a branch) is the v2 checkpoint, not main's: it decodes what v2 given as a
    directory decodes (with ``acme/draft@refs/pr/3``, a revision with slashes); then both are read
    from the cache without the network; ``@COMMIT`` is downloaded too."""
    endpoint, server = hub
    target, drafter = tiny_pair
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_OFFLINE": "0"}
    want = _local(cli, "--target", str(server.v2), "--draft", str(drafter))
    assert want != _local(cli, "--target", str(target), "--draft", str(drafter))
    got = _run(cli, monkeypatch, "--target", "acme/target@v2", "--draft", "acme/draft@refs/pr/3", env=env)
    assert got.returncode == 0, got.stderr
    assert "downloading acme/target@v2 from the Hugging Face Hub" in got.stderr
    assert json.loads(got.stdout)["token_ids"] == want
    again = _run(cli, monkeypatch, "--target", "acme/target@v2", "--draft", "acme/draft@refs/pr/3",
                      env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
    assert again.returncode == 0, again.stderr
    assert "downloading" not in again.stderr and json.loads(again.stdout)["token_ids"] == want
    # (a commit hash: downloaded into a cache of its own, as the Hub answers it)
    server.fetched.clear()
    commit = _run(cli, monkeypatch, "--target", f"acme/target@{V2_COMMIT}", "--draft", str(drafter),
                       env=dict(env, HF_HUB_CACHE=str(tmp_path / "other-cache")))
    assert commit.returncode == 0, commit.stderr
    assert f"downloading acme/target@{V2_COMMIT}" in commit.stderr and "model.safetensors" in server.fetched
    assert json.loads(commit.stdout)["token_ids"] == want


@pytest.mark.parametrize("model, env, message", [
    ("acme/missing", {}, "cannot download model 'acme/missing' from the Hugging Face Hub: the Hub has no such "
                         "model, or it is private"),
    ("acme/gguf", {}, "model 'acme/gguf' on the Hugging Face Hub has no config.json"),
    ("acme/target", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot download model 'acme/target' from the Hugging "
                                                           "Face Hub: the Hub cannot be reached (ConnectError"),
    ("acme/target", {"HF_HUB_OFFLINE": "1"}, "is not in the Hugging Face cache; HF_HUB_OFFLINE is set"),
    # (a commit hash with the Hub out of reach: said at once, its file list was retried for 25 s)
    (f"acme/target@{'ab' * 20}", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub cannot be reached (ConnectError"),
    # (an HTTP error is not "cannot be reached", in one line)
    ("acme/teapot", {}, "cannot download model 'acme/teapot' from the Hugging Face Hub: http://127.0.0.1:"),
    # (.bin weights are not downloaded: named, with how to convert them)
    ("acme/bin", {}, "model 'acme/bin' on the Hugging Face Hub has no safetensors weights; it holds pytorch_model.bin "
                     "(PyTorch pickle weights), which dflash-torch does not read"),
    # (a revision: one the Hub lacks, none after '@', one not cached offline; an id that is not one)
    ("acme/target@nope", {}, "cannot download model 'acme/target@nope' from the Hugging Face Hub: it has no revision "
                             "'nope'"),
    ("acme/target@", {}, "model 'acme/target@' names no revision after '@'"),
    ("acme/target@v2", {"HF_HUB_OFFLINE": "1"}, "model 'acme/target@v2' is not a local directory and its revision 'v2' "
                                                "is not in the Hugging Face cache; HF_HUB_OFFLINE is set"),
    ("acme/a..b@v2", {}, "model 'acme/a..b@v2' is not a local directory, nor a Hugging Face id (ORG/NAME[@REVISION]: "),
    # (a revision that is a path: '..' was main's snapshot online, '../refs/v1' the v1 ref in the cache offline)
    ("acme/target@..", {}, "model 'acme/target@..': '..' is not a branch, tag or commit name"),
    ("acme/target@./v2", {"HF_HUB_OFFLINE": "1"}, "model 'acme/target@./v2': './v2' is not a branch, tag or commit name"),
    ("acme/target@@", {}, "model 'acme/target@@': '@' is not a branch, tag or commit name"),
    ("solo", {}, "model directory 'solo' does not exist (a Hugging Face id is ORG/NAME)"),
])
def test_a_hub_id_that_cannot_be_downloaded_is_one_line(cli, monkeypatch, hub, tmp_path, model, env, message):
    endpoint, _ = hub
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_OFFLINE": "0", **env}
    got = _run(cli, monkeypatch, "--target", model, "--no-draft", env=env)
    assert got.returncode == 2, got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert message in last, got.stderr
    assert "Traceback" not in got.stderr
    if "cannot be reached" in message:  # (not "set HF_HUB_OFFLINE=1 to use only the cache", which holds nothing of it)
        assert last.endswith(f", and it is not a local directory ({Path(model).absolute()}) and is not in the Hugging "
                             "Face cache" if "@" not in model else
                             f", and its revision '{'ab' * 20}' is not in the Hugging Face cache"), last
    assert "Retrying" not in got.stderr, got.stderr
    if model == "acme/teapot":
        assert "answered" in last and "418" in last and "cannot be reached" not in last, last
    if model in ("acme/target@", "acme/a..b@v2", "solo"):  # (not a download that failed)
        assert "downloading" not in got.stderr, got.stderr


def test_train_tries_a_hub_id_that_cannot_be_fetched_once(hub, tiny_pair, tmp_path):
    """train's --target or --init-from of a Hub id that could not be fetched said "downloading ..."
    twice and asked the Hub twice (two timeouts against a slow Hub): the directory check resolved
    it, let its error be said where it loads, and the load tried again (trial-293). Once now,
    its error in one line naming the flag."""
    endpoint, server = hub
    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_OFFLINE": "0"}
    common = ["--data", str(text), "--steps", "1", "--batch", "2", "--seq-len", "64", "--no-progress"]
    script = ("import sys; from dflash_torch.cli import main; "
              "print('CODE', main(['train', '--target', 'acme/teapot', '--out', sys.argv[1], *sys.argv[3:]]), "
              "file=sys.stderr, flush=True); "
              "print('CODE', main(['train', '--target', sys.argv[2], '--init-from', 'acme/teapot', '--out', sys.argv[1], "
              "*sys.argv[3:]]), file=sys.stderr, flush=True)")
    server.requests.clear()
    got = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out"), str(target), *common],
                         capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_DISABLE_PROGRESS_BARS="1", **env))
    runs = got.stderr.split("CODE")
    assert len(runs) == 3 and runs[1].split()[0] == runs[2].split()[0] == "2", got.stderr
    for said, flag in ((runs[0], "--target"), (runs[1].split("\n", 1)[1], "--init-from")):
        lines = said.strip().splitlines()
        assert lines == ["dflash-torch: downloading acme/teapot from the Hugging Face Hub into " + str(tmp_path / "hub-cache"),
                         lines[1]], said
        assert lines[1].startswith(f"dflash-torch: error: {flag}: cannot download model 'acme/teapot' from the Hugging "
                                   "Face Hub: "), said
    asked = [r for r in server.requests if "acme/teapot" in r]
    assert asked == ["api/models/acme/teapot"] * 2, asked  # (once a run: the repo's info, which the Hub refuses)
    assert not (tmp_path / "out").exists()


def test_a_hub_that_never_answers_is_out_of_reach_in_seconds(tmp_path):
    """A Hub endpoint that takes the connection and never answers (a proxy or firewall that holds
    it): generate waited forever for the repo's file list. It gives up after HF_HUB_ETAG_TIMEOUT
    seconds, "cannot be reached", in one line."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))  # (the kernel accepts its connections; nothing reads or answers)
    try:
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}", "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
               "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "2"}
        got = _generate("--target", "acme/target", "--no-draft", env=env, timeout=90)
    finally:
        silent.close()
    assert got.returncode == 2, got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert "cannot download model 'acme/target' from the Hugging Face Hub: the Hub cannot be reached (ReadTimeout: " \
        in last and last.endswith(" and is not in the Hugging Face cache"), got.stderr
    assert "Traceback" not in got.stderr and "Retrying" not in got.stderr, got.stderr


@pytest.mark.parametrize("variable, value, local", [("HF_HUB_ETAG_TIMEOUT", "abc", False),
                                                    ("HF_HUB_ETAG_TIMEOUT", "2.5", False),
                                                    ("HF_HUB_DOWNLOAD_TIMEOUT", "ten", True)])
def test_a_hub_timeout_that_is_not_an_integer_is_one_line(tiny_pair, tmp_path, variable, value, local):
    """``HF_HUB_ETAG_TIMEOUT=abc`` (or 2.5) was a ValueError traceback from huggingface_hub's
    import, which reads it with int(): for a Hub id, and for a local directory too (transformers
    imports it). It is one line naming the variable and what it must be, status 2."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_ENDPOINT": "http://127.0.0.1:9", variable: value}
    got = _generate("--target", str(tiny_pair[0]) if local else "acme/zz", "--no-draft", env=env)
    assert got.returncode == 2, got.stderr
    assert got.stderr == (f"dflash-torch: error: {variable}={value!r}: it must be an integer number of seconds "
                          f"(huggingface_hub reads it), e.g. {variable}=10, or unset\n"), got.stderr


def test_a_hub_timeout_that_is_not_an_integer_is_a_dflash_error_in_python(tiny_pair, monkeypatch):
    """from_pretrained says it as the command line does (it was huggingface_hub's bare ValueError
    where the import came first)."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2.5")
    with pytest.raises(DFlashError, match=r"^HF_HUB_ETAG_TIMEOUT='2\.5': it must be an integer number of seconds"):
        DFlashEngine.from_pretrained(*tiny_pair)


def test_a_mistyped_local_path_is_said_not_to_be_a_directory(cli, monkeypatch, hub, tiny_pair, tmp_path):
    """``--target models/my-targt`` (a typo of a directory in the working directory) is an id
    to the Hub: where the Hub has no such model or cannot be reached, the message said only
    that, not that no such directory was found, as it does offline."""
    endpoint, _ = hub
    shutil.copytree(tiny_pair[0], tmp_path / "models" / "my-target")
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_OFFLINE": "0"}
    looked = f"it is not a local directory ({tmp_path / 'models' / 'my-targt'})"
    for changed, said in (({}, "the Hub has no such model, or it is private"),
                          ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub cannot be reached (ConnectError"),
                          ({"HF_HUB_OFFLINE": "1"}, "model 'models/my-targt' is not a local directory")):
        got = _run(cli, monkeypatch, "--target", "models/my-targt", "--no-draft", env=dict(env, **changed), cwd=tmp_path)
        assert got.returncode == 2, got.stderr
        last = got.stderr.strip().splitlines()[-1]
        assert said in last and looked.removeprefix("it ") in last and "Traceback" not in got.stderr, got.stderr
        if changed != {"HF_HUB_OFFLINE": "1"}:
            assert f", and {looked}" in last, last
    assert _run(cli, monkeypatch, "--target", "models/my-target", "--no-draft", env=env, cwd=tmp_path).returncode == 0


def test_a_cache_entry_without_the_weights_is_completed_by_a_download(cli, monkeypatch, hub, tiny_pair, tmp_path):
    """A snapshot in the cache that holds only files other tools fetched (the config and the
    tokenizer, not the weights) was taken as the checkpoint ("has no safetensors weights");
    it is downloaded whole now (offline, it is named as incomplete; with the Hub out of reach,
    said at once)."""
    endpoint, server = hub
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HUB_OFFLINE": "0"}
    from huggingface_hub import hf_hub_download

    _hub_env(monkeypatch, env)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        hf_hub_download("acme/target", f)
    offline = _run(cli, monkeypatch, "--target", "acme/target", "--no-draft", env=dict(env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 2 and "is in the Hugging Face cache incomplete" in offline.stderr, offline.stderr
    # (a Hub that cannot be reached: huggingface_hub returns the incomplete snapshot; it was "has no safetensors weights")
    dead = _run(cli, monkeypatch, "--target", "acme/target", "--no-draft", env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
    assert dead.returncode == 2 and "cannot download model 'acme/target' from the Hugging Face Hub: the Hub cannot be " \
        "reached" in dead.stderr.strip().splitlines()[-1], dead.stderr
    assert "Retrying" not in dead.stderr, dead.stderr  # (answered at once: its file list was asked for 5 times, 23 s)
    assert ", and the Hugging Face cache holds it incomplete (" in dead.stderr, dead.stderr
    server.fetched.clear()
    got = _run(cli, monkeypatch, "--target", "acme/target", "--no-draft", env=env)
    assert got.returncode == 0, got.stderr
    assert "downloading acme/target" in got.stderr and "model.safetensors" in server.fetched
    assert json.loads(got.stdout)["token_ids"] == _local(cli, "--target", str(tiny_pair[0]), "--no-draft")


def test_a_cache_entry_that_lacks_files_loading_does_not_read_is_used(cli, monkeypatch, hub, tiny_pair, tmp_path):
    """huggingface_hub 2 keeps the repo's file list (``trees/COMMIT.json``) and refuses a
    snapshot that lacks one of them (IncompleteSnapshotError): a cache shared with tools that
    fetch a subset (``hf download --include``) lacks a README or merges.txt that loading never
    reads. It was "not in the Hugging Face cache" (offline) and "the Hub cannot be reached, and
    it is not in the Hugging Face cache"; it is used as it is now. One without the tokenizer files
    the list names is still completed by a download where it may be. A weight file its blob is
    gone from is named, as the same cache without the file list names it."""
    server = hub[1]
    env, repo, snapshot = _cached_from_hub(cli, monkeypatch, hub, tiny_pair, tmp_path, "notes",
                                           {"notes.txt": "not read by loading"})
    (snapshot / "notes.txt").unlink()
    want = _local(cli, "--target", str(tiny_pair[0]), "--no-draft")
    for changed in ({"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}):
        again = _run(cli, monkeypatch, "--target", "acme/notes", "--no-draft", env=dict(env, **changed))
        assert again.returncode == 0, again.stderr
        assert "downloading" not in again.stderr and json.loads(again.stdout)["token_ids"] == want
    # (without its tokenizer files, which the repo has: completed by a download, as before; offline, used as it is)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / file).unlink()
    offline = _run(cli, monkeypatch, "--target", "acme/notes", "--no-draft", env=dict(env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 2 and f"{snapshot} has no tokenizer files" in offline.stderr, offline.stderr
    assert offline.stderr.rstrip().endswith("; it is the snapshot of acme/notes in the Hugging Face cache; "
                                            "HF_HUB_OFFLINE is set, so nothing was downloaded (where its repo holds the "
                                            "files missing, loading acme/notes with it unset fetches them)"), \
        offline.stderr
    server.fetched.clear()
    again = _run(cli, monkeypatch, "--target", "acme/notes", "--no-draft", env=env)
    assert again.returncode == 0, again.stderr
    assert "downloading acme/notes" in again.stderr and json.loads(again.stdout)["token_ids"] == want
    assert "tokenizer.json" in server.fetched and "model.safetensors" not in server.fetched, server.fetched
    (snapshot / "model.safetensors").resolve().unlink()  # (its blob: the link is broken)
    broken = f"{snapshot}: model.safetensors is a broken link"
    offline = _run(cli, monkeypatch, "--target", "acme/notes", "--no-draft", env=dict(env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 2, offline.stderr
    assert f"model 'acme/notes' is in the Hugging Face cache incomplete ({broken}" in offline.stderr, offline.stderr
    dead = _run(cli, monkeypatch, "--target", "acme/notes", "--no-draft", env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
    assert dead.returncode == 2, dead.stderr
    assert "the Hub cannot be reached (ConnectError: " in dead.stderr, dead.stderr
    assert f", and the Hugging Face cache holds it incomplete ({broken}" in dead.stderr, dead.stderr


def test_a_cache_entry_without_its_tokenizer_json_is_completed_though_it_holds_its_tokenizer_config(
        cli, monkeypatch, hub, tiny_pair, tmp_path):
    """A cached snapshot that lacks tokenizer.json (or holds a broken link to it) but holds
    tokenizer_config.json, while the repo's kept file list names tokenizer.json, was used as it
    is (tokenizer_config.json counted as a tokenizer): loading then failed. It is completed by a
    download where the Hub may be reached; with the Hub out of reach, the error says what the
    cache holds it without."""
    server = hub[1]
    env, repo, snapshot = _cached_from_hub(cli, monkeypatch, hub, tiny_pair, tmp_path, "tok",
                                           {"notes.txt": "not read by loading"})
    want = _local(cli, "--target", str(repo), "--no-draft")
    (snapshot / "tokenizer.json").unlink()
    for lacking in ("tokenizer.json", "tokenizer.json (a broken link)"):
        dead = _run(cli, monkeypatch, "--target", "acme/tok", "--no-draft", env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
        assert dead.returncode == 2 and "downloading acme/tok" in dead.stderr, dead.stderr
        assert "the Hub cannot be reached (ConnectError" in dead.stderr, dead.stderr
        assert dead.stderr.rstrip().endswith(f", and the Hugging Face cache holds it incomplete ({snapshot} lacks "
                                             f"tokenizer files the repo has ({lacking}))"), dead.stderr
        server.fetched.clear()
        again = _run(cli, monkeypatch, "--target", "acme/tok", "--no-draft", env=env)
        assert again.returncode == 0 and json.loads(again.stdout)["token_ids"] == want, again.stderr
        assert "tokenizer.json" in server.fetched and "model.safetensors" not in server.fetched, server.fetched
        (snapshot / "tokenizer.json").resolve().unlink()  # (its blob: the link is broken)


def test_a_cache_entry_without_the_generation_config_its_repo_has_is_completed_or_used_with_a_warning(
        cli, monkeypatch, hub, tiny_pair, tmp_path):
    """A cached snapshot that lacks a generation config (or chat template) its repo's kept file
    list names was used as it is: without its EOS ids and defaults, or its template ("this
    model's tokenizer has no chat template"). It is completed by a download where the Hub may
    be reached, else used without it with a WARNING line naming the file; offline too (it was
    used with no WARNING), without trying the Hub. A broken link to one (its blob gone) is as
    missing: with the Hub out of reach it warned "used without", then failed ("is a broken
    link"), and offline it failed at once."""
    server = hub[1]
    env, repo, snapshot = _cached_from_hub(cli, monkeypatch, hub, tiny_pair, tmp_path, "gen", {
        "generation_config.json": json.dumps({"max_new_tokens": 12}), "notes.txt": "not read by loading"})
    want = _local(cli, "--target", str(repo), "--no-draft")
    (snapshot / "notes.txt").unlink()  # (so that huggingface_hub judges the snapshot incomplete, as a partial fetch)
    (snapshot / "generation_config.json").unlink()
    server.fetched.clear()
    again = _run(cli, monkeypatch, "--target", "acme/gen", "--no-draft", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["token_ids"] == want, again.stderr
    assert "generation_config.json" in server.fetched and "model.safetensors" not in server.fetched, server.fetched
    assert (snapshot / "generation_config.json").is_file()
    (snapshot / "generation_config.json").unlink()
    dead = _run(cli, monkeypatch, "--target", "acme/gen", "--no-draft", env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
    assert dead.returncode == 0, dead.stderr
    assert ("WARNING: the cached snapshot of acme/gen lacks generation_config.json, which the repo has, and it cannot "
            "be downloaded: it is used without (cannot download model 'acme/gen' from the Hugging Face Hub: the Hub "
            "cannot be reached") in dead.stderr, dead.stderr
    offline = _run(cli, monkeypatch, "--target", "acme/gen", "--no-draft", env=dict(env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 0 and json.loads(offline.stdout)["token_ids"] == want, offline.stderr
    assert ("WARNING: the cached snapshot of acme/gen lacks generation_config.json, which the repo has, and it cannot "
            "be downloaded: it is used without (model 'acme/gen' is in the Hugging Face cache incomplete (") \
        in offline.stderr and "HF_HUB_OFFLINE is set" in offline.stderr, offline.stderr
    assert "downloading" not in offline.stderr, offline.stderr
    # (a broken link to it: as missing, offline and with the Hub out of reach; completed where the Hub may be reached)
    server.fetched.clear()
    assert _run(cli, monkeypatch, "--target", "acme/gen", "--no-draft", env=env).returncode == 0
    assert "generation_config.json" in server.fetched
    link = snapshot / "generation_config.json"
    link.resolve().unlink()  # (its blob)
    for changed in ({"HF_ENDPOINT": "http://127.0.0.1:9"}, {"HF_HUB_OFFLINE": "1"}):
        broken = _run(cli, monkeypatch, "--target", "acme/gen", "--no-draft", env=dict(env, **changed))
        assert broken.returncode == 0 and json.loads(broken.stdout)["token_ids"] == want, broken.stderr
        assert ("WARNING: the cached snapshot of acme/gen lacks generation_config.json (a broken link), which the repo "
                "has, and it cannot be downloaded: it is used without (") in broken.stderr, broken.stderr
        assert "error" not in broken.stderr, broken.stderr
    server.fetched.clear()
    again = _run(cli, monkeypatch, "--target", "acme/gen", "--no-draft", env=env)
    assert again.returncode == 0 and "WARNING" not in again.stderr, again.stderr
    assert "generation_config.json" in server.fetched and link.is_file(), server.fetched


def test_ctrl_c_during_a_download_exits_at_once(hub, tiny_pair, tmp_path):
    """Ctrl-C while huggingface_hub downloads: the command ends with status 130 without waiting
    for the file being fetched (it waited for the whole file: minutes for a large model)."""
    endpoint, server = hub
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(tmp_path / "hub-cache"),
               HF_HUB_OFFLINE="0", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_DOWNLOAD_TIMEOUT="600")  # (huggingface_hub's own read timeout would end the held file first)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", "generate", "x", "--target", str(tiny_pair[0]),
                             "--draft", "acme/slow"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:  # (the download has begun)
            if "downloading acme/slow" in line:
                break
        while "model.safetensors" not in server.fetched:  # (its weights are being fetched: held by the server)
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130  # (the held file never ends: without the fix it waited for it)
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_the_python_api_takes_a_revision_from_the_cache(tiny_pair, tmp_path, monkeypatch):
    """``DFlashEngine.from_pretrained("ORG/NAME@REVISION")``: that branch's or commit's snapshot
    in the cache, not main's (offline: no network)."""
    from huggingface_hub import constants

    from dflash_torch import DFlashEngine
    from dflash_torch.checkpoint import resolve_model_dir

    repo = tmp_path / "hub" / "models--acme--tiny"
    main, v2 = (shutil.copytree(tiny_pair[0], repo / "snapshots" / sha) for sha in (COMMIT, V2_COMMIT))
    (repo / "refs" / "refs" / "pr").mkdir(parents=True)
    for ref, sha in (("main", COMMIT), ("v2", V2_COMMIT), ("refs/pr/3", V2_COMMIT)):
        (repo / "refs" / ref).write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert [resolve_model_dir(f"acme/tiny{r}") for r in ("", "@main", "@v2", "@refs/pr/3", f"@{V2_COMMIT}")] == \
        [main, main, v2, v2, v2]
    # (named as served, without the revision: clients that ask for acme/tiny go on working)
    assert DFlashEngine.from_pretrained(target="acme/tiny@v2", no_draft=True).name == "acme/tiny"


def test_mistyped_hub_ids_name_the_id_and_a_broken_link_or_offline_variable_is_said(tiny_pair, tmp_path, monkeypatch):
    """A Hub page's URL, an ``hf://`` path, ``ORG/NAME/`` with a trailing slash said only "model
    directory '...' does not exist": they name the id they mean, as the cache folder's name
    ``models--ORG--NAME`` does. A broken link at ``./ORG/NAME`` was passed over and the cached
    model loaded unsaid: refused, a local path coming before an id. ``TRANSFORMERS_OFFLINE=1``
    alone was said to be "HF_HUB_OFFLINE is set" (trial-284)."""
    from huggingface_hub import constants

    from dflash_torch.checkpoint import resolve_model_dir

    repo = tmp_path / "hub" / "models--acme--tiny"
    main = shutil.copytree(tiny_pair[0], repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    for given, meant in (("https://huggingface.co/acme/tiny", "acme/tiny"), ("hf://acme/tiny", "acme/tiny"),
                         ("acme/tiny/", "acme/tiny"), ("models--acme--tiny", "acme/tiny"),
                         ("https://huggingface.co/acme/tiny/tree/v2", "acme/tiny@v2")):
        with pytest.raises(DFlashError) as caught:
            resolve_model_dir(given)
        assert str(caught.value) == f"model directory {given!r} does not exist (a Hugging Face id is written ORG/NAME: " \
            f"{meant})", given
    with pytest.raises(DFlashError, match=r"^model directory 'models/my-target/x' does not exist$"):  # (a path: no id)
        resolve_model_dir("models/my-target/x")
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "tiny").symlink_to(tmp_path / "gone")
    with pytest.raises(DFlashError) as caught:
        resolve_model_dir("acme/tiny")
    assert str(caught.value).startswith(f"acme/tiny is a broken symbolic link (to {tmp_path / 'gone'}); a local path "
                                        "comes before a Hugging Face id"), caught.value
    monkeypatch.chdir(tmp_path / "hub")
    assert resolve_model_dir("acme/tiny") == main
    for env, named in (({"TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE"),
                       ({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, "HF_HUB_OFFLINE")):
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        with pytest.raises(DFlashError, match=rf"; {named} is set, so it is not downloaded$"):
            resolve_model_dir("acme/other")


def _tiny_cache(tiny_pair, tmp_path, monkeypatch, refs: dict[str, str]) -> tuple[Path, Path]:
    """A Hugging Face cache (offline, in this process) holding ``acme/tiny``: complete snapshots of
    :data:`COMMIT` and :data:`V2_COMMIT`, and ``refs`` (name -> commit): ``(repo folder, COMMIT's
    snapshot)``."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    main = shutil.copytree(tiny_pair[0], repo / "snapshots" / COMMIT)
    shutil.copytree(tiny_pair[0], repo / "snapshots" / V2_COMMIT)
    os.utime(repo / "snapshots" / V2_COMMIT, (0, 0))  # (older: COMMIT is the newest)
    (repo / "refs").mkdir()
    for ref, sha in refs.items():
        (repo / "refs" / ref).write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    return repo, main


def test_an_update_cut_short_names_the_complete_snapshots_the_cache_holds(tiny_pair, tmp_path, monkeypatch):
    """refs/main naming a commit with no snapshot (huggingface_hub writes the ref before the
    files), or with a partial one, while complete snapshots of other commits are cached: it said
    "is not in the Hugging Face cache" (false), or "incomplete", naming neither (trial-324 c).
    Now it says what refs/main names and which complete commits ORG/NAME@COMMIT loads."""
    from dflash_torch.checkpoint import resolve_model_dir

    new = "1234" + "0" * 36
    repo, main = _tiny_cache(tiny_pair, tmp_path, monkeypatch, {"main": new})
    with pytest.raises(DFlashError) as caught:
        resolve_model_dir("acme/tiny")
    assert str(caught.value) == (
        f"model 'acme/tiny' is in the Hugging Face cache incomplete (its refs/main names commit {new}, whose snapshot is "
        "not there: an update cut short?); HF_HUB_OFFLINE is set, so it is not downloaded; the cache holds complete "
        f"snapshots of other commits of it that no other branch or tag names ({COMMIT}, {V2_COMMIT}, an earlier main?): "
        f"acme/tiny@{COMMIT} loads the newest")
    assert resolve_model_dir(f"acme/tiny@{COMMIT}") == main
    # (a commit another ref names is that branch's: pasted, it loaded v2's weights, trial-328 b)
    (repo / "refs" / "v2").write_text(V2_COMMIT)
    with pytest.raises(DFlashError) as caught:
        resolve_model_dir("acme/tiny")
    assert str(caught.value).endswith(f"of it that no other branch or tag names ({COMMIT}, an earlier main?): "
                                      f"acme/tiny@{COMMIT} loads it"), caught.value
    (repo / "refs" / "v2").unlink()
    # (a refs file that is no text: a traceback, UnicodeDecodeError, trial-328 a)
    (repo / "refs" / "main").write_bytes(b"\xff\xfe\x00garbage")
    for given in ("acme/tiny", repo):
        with pytest.raises(DFlashError):
            resolve_model_dir(given)
    (repo / "refs" / "main").write_text(new)
    (repo / "snapshots" / new).mkdir()
    shutil.copy(main / "config.json", repo / "snapshots" / new / "config.json")
    shutil.rmtree(repo / "snapshots" / V2_COMMIT)
    with pytest.raises(DFlashError) as caught:
        resolve_model_dir("acme/tiny")
    assert str(caught.value).startswith(f"model 'acme/tiny' is in the Hugging Face cache incomplete ("
                                        f"{repo / 'snapshots' / new} has no safetensors weights"), caught.value
    assert str(caught.value).endswith(f"; the cache holds a complete snapshot of another commit of it that no other "
                                      f"branch or tag names ({COMMIT}, an earlier main?): acme/tiny@{COMMIT} loads it"), \
        caught.value
    with pytest.raises(DFlashError) as caught:  # (the cache's repo folder: refs/main's snapshot is partial, not named)
        resolve_model_dir(repo)
    assert str(caught.value).endswith("; it is the Hugging Face cache entry of acme/tiny: pass acme/tiny"), caught.value


def test_a_mistyped_hub_id_or_revision_names_what_the_cache_holds(tiny_pair, tmp_path, monkeypatch):
    """An id or revision that differs from a cached one in case, a close typo of a cached id, a
    commit's first digits: "not in the Hugging Face cache" and nothing more (trial-324 e). The
    cached one is suggested now; a path to the cache's repo folder names the id and a snapshot
    folder to pass (trial-324 f)."""
    from dflash_torch.checkpoint import resolve_model_dir

    repo, main = _tiny_cache(tiny_pair, tmp_path, monkeypatch, {"main": COMMIT, "v2": V2_COMMIT})
    for given, hint in (("acme/Tiny", "did you mean acme/tiny? (the Hugging Face cache holds acme/tiny)"),
                        ("acme/tinny", "did you mean acme/tiny? (the Hugging Face cache holds acme/tiny)"),
                        ("acme/Tiny@v2", "did you mean acme/tiny@v2? (the Hugging Face cache holds acme/tiny)"),
                        ("acme/tiny@V2", "did you mean acme/tiny@v2? (a branch or tag the cache holds)"),
                        ("acme/tiny@5ca1ab1e", f"did you mean acme/tiny@{V2_COMMIT}? (the commit the cache holds that "
                                               "'5ca1ab1e' begins)")):
        with pytest.raises(DFlashError) as caught:
            resolve_model_dir(given)
        assert str(caught.value).endswith(f"; HF_HUB_OFFLINE is set, so it is not downloaded; {hint}"), caught.value
    for given in ("zeta/other", "acme/tiny2"):  # (nothing near; digits that differ name another model: trial-328 c)
        with pytest.raises(DFlashError) as caught:
            resolve_model_dir(given)
        assert str(caught.value).endswith("HF_HUB_OFFLINE is set, so it is not downloaded"), caught.value
    with pytest.raises(DFlashError) as caught:  # (a revision the id meant does not hold: not suggested with it)
        resolve_model_dir("acme/tinny@v9")
    assert str(caught.value).endswith("did you mean acme/tiny? (the Hugging Face cache holds it, though not at 'v9')"), \
        caught.value
    for given in (repo, f"{repo}/"):
        with pytest.raises(DFlashError) as caught:
            resolve_model_dir(given)
        assert str(caught.value).endswith(f"; it is the Hugging Face cache entry of acme/tiny: pass acme/tiny, or its "
                                          f"snapshot folder {main}"), caught.value


def test_a_file_download_that_stalls_after_the_hub_answered_is_not_said_out_of_reach(hub, tiny_pair, tmp_path):
    """A Hub that answers the repo's file list but stalls on a file: its last line said "the Hub
    cannot be reached ... and is not in the Hugging Face cache" (it was reached, and the cache
    holds a partial snapshot), after 12 lines of huggingface_hub's retries (trial-324). One
    line now after "downloading": the file that timed out, HF_HUB_DOWNLOAD_TIMEOUT, the
    partial snapshot."""
    endpoint, server = hub
    server.repos["acme/stall"] = Path(tiny_pair[1])
    server.held.add("acme/stall")
    cache = tmp_path / "hub-cache"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "HF_HUB_DOWNLOAD_TIMEOUT": "1"}
    got = _generate("--target", str(tiny_pair[0]), "--draft", "acme/stall", env=env, timeout=120)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("dflash-torch: downloading acme/stall"), got.stderr
    assert lines[1] == ("dflash-torch: error: --draft: cannot download model 'acme/stall' from the Hugging Face Hub: the "
                        "Hub answered, but the download of model.safetensors timed out (no data for "
                        "HF_HUB_DOWNLOAD_TIMEOUT=1 seconds, tried again by huggingface_hub); the Hugging Face cache "
                        f"holds its snapshot without it ({cache / 'models--acme--stall' / 'snapshots' / COMMIT}): run "
                        "again to fetch the rest; on a slow link, set HF_HUB_DOWNLOAD_TIMEOUT to more seconds"), lines


def test_an_offline_snapshot_lacking_its_tokenizer_is_said_with_the_flag_id_and_offline_variable(
        tiny_pair, tmp_path, monkeypatch, capsys):
    """A cached snapshot without tokenizer.json (tokenizer_config.json there), or with a broken
    link to it, offline: "cannot load the tokenizer of PATH, ..." / "PATH: tokenizer.json is a
    broken link", without --target:, the id, or that HF_HUB_OFFLINE kept it from being completed,
    which its sibling error (no tokenizer files at all) has (trial-324 d)."""
    from dflash_torch.checkpoint import resolve_model_dir
    from dflash_torch.cli import main as cli_main
    from dflash_torch.tokenizer import load_tokenizer

    _, main = _tiny_cache(tiny_pair, tmp_path, monkeypatch, {"main": COMMIT})
    (main / "tokenizer.json").unlink()
    assert resolve_model_dir("acme/tiny") == main  # (offline: used as it is)
    tail = "; it is the snapshot of acme/tiny in the Hugging Face cache; HF_HUB_OFFLINE is set, so nothing was " \
           "downloaded (where its repo holds the files missing, loading acme/tiny with it unset fetches them)"
    with pytest.raises(DFlashError) as caught:
        load_tokenizer(main, None, "target")
    assert str(caught.value).startswith(f"target: cannot load the tokenizer of {main}, which has no tokenizer.json"), \
        caught.value
    assert str(caught.value).endswith(tail) and caught.value.name == "target", caught.value
    (main / "tokenizer.json").symlink_to(tmp_path / "gone-blob")
    capsys.readouterr()
    assert cli_main(["generate", "x", "--target", "acme/tiny", "--no-draft", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-torch: error: --target: {main}: tokenizer.json is a broken link (an interrupted download? download the "
        f"checkpoint again){tail}"]


def test_a_target_given_as_the_drafter_names_the_path_loaded_and_a_cached_id_it_shadows(tiny_pair, tmp_path,
                                                                                        monkeypatch, capsys):
    """``--draft acme/draft`` where ``./acme/draft`` (a target's copy) shadows the cached id:
    "the drafter checkpoint is not a DFlash drafter" named neither the flag nor the directory
    loaded (trial-324 b). It is led by ``--draft: PATH`` now, saying the local directory came
    before the cached id."""
    from dflash_torch.cli import main as cli_main

    _tiny_cache(tiny_pair, tmp_path, monkeypatch, {"main": COMMIT})
    shutil.copytree(tiny_pair[0], tmp_path / "acme" / "tiny")
    target = str(tiny_pair[0])
    with pytest.raises(OptionError) as caught:
        DFlashEngine.from_pretrained(target, "acme/tiny")
    assert str(caught.value).startswith(
        f"draft: {tmp_path / 'acme' / 'tiny'} (a local directory, which comes before the Hugging Face id acme/tiny that "
        "the cache holds: run from another directory, or pass the cached snapshot's path, to load that): the drafter "
        "checkpoint is not a DFlash drafter (architectures=['Qwen3ForCausalLM'])"), caught.value
    assert cli_main(["generate", "x", "--target", target, "--draft", target, "--max-new-tokens", "2"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"dflash-torch: error: --draft: {target}: the drafter checkpoint is "
                                                 "not a DFlash drafter"), said
    monkeypatch.chdir(tmp_path / "hub")  # (the cached id itself: its snapshot named with the id)
    with pytest.raises(OptionError, match=r"^draft: \S+/snapshots/c0ffee0+ \(the snapshot of acme/tiny in the "
                                          r"Hugging Face cache\): the drafter checkpoint is not a DFlash drafter"):
        DFlashEngine.from_pretrained(target, "acme/tiny")

