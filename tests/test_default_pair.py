"""The shipped default pair: present, small, in the published formats, and lossless."""

import json
import shutil
import subprocess
import sys

import pytest

from dflash_torch import DFlashEngine
from dflash_torch.engine import ASSETS, DEFAULT_DRAFTER, DEFAULT_TARGET


def test_shipped_files_are_small_and_in_published_formats():
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert total < 40 * 2**20, f"shipped assets take {total / 2**20:.1f} MiB"
    drafter_cfg = json.loads((DEFAULT_DRAFTER / "config.json").read_text())
    assert drafter_cfg["architectures"] == ["DFlash2DraftModel"]
    v1_cfg = json.loads((ASSETS / "drafter-dflash1" / "config.json").read_text())  # kept for comparison
    assert v1_cfg["architectures"] == ["DFlashDraftModel"]
    assert set(drafter_cfg["dflash_config"]) >= {"mask_token_id", "target_layer_ids"}
    target_cfg = json.loads((DEFAULT_TARGET / "config.json").read_text())
    assert target_cfg["model_type"] == "qwen3"
    assert drafter_cfg["num_target_layers"] == target_cfg["num_hidden_layers"]
    assert (ASSETS / "README.md").is_file()
    prompts = [json.loads(line) for line in (ASSETS / "prompts.jsonl").read_text().splitlines()]
    heldout = set((ASSETS / "heldout_modules.txt").read_text().split())
    assert len(prompts) >= 50 and all(p["module"].split(".")[0] in heldout for p in prompts)


def test_shipped_tokenizer_names_a_class_transformers_4_and_5_both_load():
    """transformers 5 saves ``TokenizersBackend``, a class transformers 4.x lacks (it cannot
    load such a tokenizer); ``PreTrainedTokenizerFast`` exists in both and loads this one
    (checked with 4.57.6 and 5.24: the same ids on the held-out prompts)."""
    import transformers
    from transformers import AutoTokenizer

    name = json.loads((DEFAULT_TARGET / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert name == "PreTrainedTokenizerFast" and hasattr(transformers, name)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    assert isinstance(tok, transformers.PreTrainedTokenizerFast) and len(tok) == 4096
    assert (tok.eos_token_id, tok.mask_token_id, tok.pad_token_id) == (0, 1, 0)


def test_default_pair_is_lossless_on_heldout_prompts():
    """The shipped DFlash 2 drafter (the default) and the DFlash (v1) one kept beside it."""
    base = DFlashEngine.from_pretrained(no_draft=True)
    prompts = [json.loads(line)["prompt"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()[:3]]
    for spec in (DFlashEngine.from_pretrained(), DFlashEngine.from_pretrained(draft=ASSETS / "drafter-dflash1")):
        for prompt in prompts:
            a = spec.generate(prompt, max_new_tokens=48, ignore_eos=True)
            b = base.generate(prompt, max_new_tokens=48, ignore_eos=True)
            assert a.token_ids == b.token_ids
            assert a.stats.block_size == 16 and len(a.stats.acceptance_lengths) >= 1


def test_a_chat_turn_reuses_the_last_reply_with_the_shipped_template():
    """The shipped chat template renders a past reply after a blank line, as its generation
    prompt opened it, so the next turn's prompt starts with the tokens the last turn read and
    generated and reuses their rows (its replies rendered "# assistant: ...": a second turn
    reused 10 of 66 tokens); the turn equals target-only decoding of the same messages."""
    engine, base = DFlashEngine.from_pretrained(), DFlashEngine.from_pretrained(no_draft=True, reuse_prefix=False)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    first = engine.generate(messages, max_new_tokens=24)
    assert engine.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": first.text}],
                                                tokenize=False) == "# user: def add(a, b):\n\n" + first.text + "\n"
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "class Stack:"}]
    second = engine.generate(messages, max_new_tokens=24)
    assert second.token_ids == base.generate(messages, max_new_tokens=24).token_ids
    read = len(engine.encode_prompt(messages[:1])) + len(first.token_ids)  # (the last turn's prompt and reply)
    assert second.stats.cached_prompt_tokens >= read - 2, (second.stats.cached_prompt_tokens, read)


def test_quickstart_command_prints_code():
    proc = subprocess.run([sys.executable, "-m", "dflash_torch", "generate", "def fibonacci(n):", "--max-new-tokens", "32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 0
    assert "mean tau" in proc.stderr


def test_the_shipped_target_named_by_its_path_gets_the_shipped_drafter(tmp_path, cli):
    """``--target`` naming the shipped target's directory (by any path to it) drafts with the
    shipped drafter, as when it is left out (it was refused: "this target needs draft"; bench:
    "the drafting modes ... need --draft"); a copy of it elsewhere is another target, which
    needs its drafter named."""
    from dflash_torch import DFlashError

    want = DFlashEngine.from_pretrained().generate("def f(x):", max_new_tokens=8, ignore_eos=True)
    (tmp_path / "link").symlink_to(ASSETS / "target")
    for target in (ASSETS / "target", str(ASSETS / "target") + "/", tmp_path / "link"):
        got = DFlashEngine.from_pretrained(target).generate("def f(x):", max_new_tokens=8, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.stats.acceptance_lengths == want.stats.acceptance_lengths
    bench = cli("bench", "--target", str(tmp_path / "link"), "--num-prompts", "1", "--max-new-tokens", "4", "--modes",
                "inject", "--sweep", "", "--out", str(tmp_path / "bench"), "--no-progress")
    assert bench.returncode == 0, bench.stderr
    copy = shutil.copytree(ASSETS / "target", tmp_path / "copy")
    with pytest.raises(DFlashError, match="^this target needs draft"):
        DFlashEngine.from_pretrained(copy)


def _strings(value):
    """Every string inside the JSON value ``value`` (keys left out)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_the_shipped_training_logs_hold_no_path_of_the_build_machine():
    """trial-319 (b): the shipped training_log.json files held the build machine's absolute
    paths (/work/main/dflash_torch/..., /tmp/s3/v2full, /root/.pyenv/...), which mean nothing
    on a user's. Now paths in the repository are relative to it, the stdlib under
    <sys.prefix>, the scratch files under $WORK (as scripts/make_default_pair.sh names them);
    the only absolute path is train_default_target.py's own default work dir."""
    from pathlib import Path

    script = (Path(__file__).resolve().parent.parent / "scripts" / "train_default_target.py").read_text()
    default_work = "/tmp/dflash_default_target_work"
    assert f'default=pathlib.Path("{default_work}")' in script
    logs = sorted(ASSETS.glob("*/training_log.json"))
    assert [p.parent.name for p in logs] == ["drafter", "drafter-dflash1", "target"]
    for path in logs:
        words = [w for s in _strings(json.loads(path.read_text())) for w in s.split()]
        absolute = {w for w in words if w.startswith(("/", "~")) and w != default_work}
        assert not absolute, (path, absolute)


def test_the_license_metadata_names_the_psf_licensed_assets_and_ships_their_license():
    """trial-319 (a): the wheel said only Apache-2.0 (License-File: LICENSE) while the shipped
    prompts.jsonl holds verbatim CPython stdlib excerpts, under the PSF License Agreement,
    whose notice the agreement asks derived copies to keep (only a URL was shipped). Now the
    expression names PSF-2.0 and CPython's license text ships beside the assets (package
    data) and as a license file of the distribution."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0 AND PSF-2.0"
    psf = ASSETS / "LICENSE-PSF.txt"
    assert project["license-files"] == ["LICENSE", psf.relative_to(root).as_posix()]
    text = psf.read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in text
    assert "2023 Python Software Foundation;\nAll Rights Reserved" in text  # (the notice, to 3.11.7's year)
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "assets/default/*" in package_data["dflash_torch"]  # (so the wheel ships it beside prompts.jsonl)
