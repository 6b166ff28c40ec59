"""Harness adapters as files: the built-in TOML files are the catalog, the install pins and the teacher's versions;
a user's file is validated (a bad one names the key and the fix), added with ``clawstream harness add`` and found by
name; ``install = "pip:..."`` installs into a venv of its own, once (offline afterwards); a path is used as it is.

pip's index here is a directory holding a wheel the test writes (``PIP_NO_INDEX`` + ``PIP_FIND_LINKS``): what is
tested is the installer's bookkeeping, not PyPI.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from producers.harnesses.adapter_file import AdapterFileError, load_adapter
from producers.harnesses.base import LaunchContext, launch_spec
from producers.harnesses.catalog import ADAPTERS, BUILTIN_DIR, all_adapters, resolve, user_dir
from producers.harnesses.install import HARNESSES, MARKER, executable, install_harness, package_of, version_overrides
from schemas.events import Dialect

GOOD = """
name = "myagent"
description = "a user's agent"
dialect = "openai-chat"
install = "pip:myagent-cli==0.1.0"
bin = "myagent"
command = ["${exe}", "--base-url", "${base_url_v1}", "${prompt}"]

[env]
MYAGENT_KEY = "${secret}"

[[files]]
path = ".myagent/config.json"
content = '''{"model": "${model}"}'''
"""
CTX = LaunchContext(base_url="http://p/r/r1", secret="s3", workspace="/w", home="/h", prompt="do it", timeout_s=60)


def test_every_built_in_adapter_is_a_file_and_the_pins_and_teacher_versions_come_from_them() -> None:
    files = sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))
    assert files == sorted(ADAPTERS) and {"claude-code", "codex", "openclaw", "agentloop"} <= set(files)
    assert set(HARNESSES) == {n for n, a in ADAPTERS.items() if a.install}
    assert (
        HARNESSES["claude-code"].spec == "@anthropic-ai/claude-code@2.1.197"
        and HARNESSES["claude-code"].bin == "claude"
    )
    assert HARNESSES["openclaw"].needs_node24
    from warmstart.teacher import RECORDED_WITH, TOOLS

    assert set(RECORDED_WITH) == set(TOOLS)


def test_a_user_file_loads_and_launches(tmp_path: Path) -> None:
    path = tmp_path / "myagent.toml"
    path.write_text(GOOD)
    adapter = load_adapter(path)
    assert adapter.dialect is Dialect.OPENAI_CHAT
    spec = launch_spec(adapter, CTX)
    assert spec.argv[1:] == ["--base-url", "http://p/r/r1/v1", "do it"]
    assert spec.env == {"MYAGENT_KEY": "s3"} and spec.files == {"/h/.myagent/config.json": '{"model": "policy"}'}
    pkg = package_of(adapter)
    assert pkg is not None and (pkg.kind, pkg.spec, pkg.bin) == ("pip", "myagent-cli==0.1.0", "myagent")
    assert executable(pkg, tmp_path) == tmp_path / "myagent" / "bin" / "myagent"


@pytest.mark.parametrize(
    ("edit", "names"),
    [
        (lambda t: t + 'colour = "blue"\n', ["colour", "unknown key"]),
        (lambda t: t.replace('dialect = "openai-chat"', "dialect = 3"), ["dialect", "wrong type"]),
        (
            lambda t: t.replace('command = ["${exe}", "--base-url", "${base_url_v1}", "${prompt}"]', ""),
            ["command", "missing", "add it"],
        ),
        (lambda t: t.replace("openai-chat", "gemini-rest"), ["dialect", "unknown dialect", "openai-chat"]),
        (lambda t: t.replace("pip:myagent-cli==0.1.0", "pip:myagent-cli>=0.1"), ["install", "pip:package==version"]),
        (lambda t: t.replace("pip:myagent-cli==0.1.0", "npm:foo"), ["install", "npm:package@version"]),
        (lambda t: t.replace('MYAGENT_KEY = "${secret}"', "MYAGENT_KEY = 1"), ["env.MYAGENT_KEY", "wrong type"]),
        (lambda t: t.replace('"--base-url"', '"${base}"'), ["command", "base", "${base_url}"]),
        (lambda t: t.replace("[env]", "[env"), ["not valid TOML"]),
    ],
)
def test_a_bad_file_names_the_key_and_the_fix(tmp_path: Path, edit, names: list[str]) -> None:  # noqa: ANN001
    path = tmp_path / "bad.toml"
    path.write_text(edit(GOOD))
    with pytest.raises(AdapterFileError) as info:
        load_adapter(path)
    message = str(info.value)
    assert str(path) in message and all(n in message for n in names), message


def test_added_files_are_found_by_name_and_may_not_shadow_a_built_in(tmp_path: Path) -> None:
    home = tmp_path / "home"
    user_dir(home).mkdir(parents=True)
    (user_dir(home) / "myagent.toml").write_text(GOOD)
    assert "myagent" in all_adapters(home) and resolve("myagent", home).name == "myagent"
    assert resolve(str(user_dir(home) / "myagent.toml")).name == "myagent"
    (user_dir(home) / "codex.toml").write_text(GOOD.replace('"myagent"', '"codex"', 1))
    with pytest.raises(AdapterFileError, match="built-in harness; pick another name"):
        all_adapters(home)
    with pytest.raises(AdapterFileError, match="unknown harness 'nope'.*harness add FILE"):
        resolve("nope", tmp_path / "empty")


def test_harness_add_validates_copies_and_the_path_install_is_used_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawstream.cli import main

    monkeypatch.setenv("CLAWSTREAM_HOME", str(tmp_path / "home"))
    agent = tmp_path / "src" / "agent.sh"
    agent.parent.mkdir()
    agent.write_text("#!/bin/sh\necho hi\n")
    agent.chmod(agent.stat().st_mode | stat.S_IEXEC)
    src = tmp_path / "src" / "local-agent.toml"
    src.write_text(GOOD.replace('"myagent"', '"local-agent"', 1).replace('"pip:myagent-cli==0.1.0"', '"./agent.sh"'))
    result = CliRunner().invoke(main, ["harness", "add", str(src)])
    assert result.exit_code == 0, result.output
    copied = user_dir() / "local-agent.toml"
    assert load_adapter(copied).install == str(agent)  # the relative path made absolute in the copy
    assert install_harness("local-agent") == agent  # nothing installed: the executable itself
    listed = CliRunner().invoke(main, ["harness", "list"])
    assert "local-agent" in listed.output and str(agent) in listed.output
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD + "oops = 1\n")
    result = CliRunner().invoke(main, ["harness", "add", str(bad)])
    assert result.exit_code != 0 and "oops: unknown key" in (result.output + str(result.exception))


def _wheel(directory: Path, name: str, version: str, script: str) -> None:
    """A pure-Python wheel with one console script (what pip installs from a find-links directory)."""
    dist, mod = f"{name.replace('-', '_')}-{version}", name.replace("-", "_")
    files = {
        f"{mod}.py": "def main():\n    print('myagent ran')\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}.dist-info/entry_points.txt": f"[console_scripts]\n{script} = {mod}:main\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_a_pip_harness_installs_into_its_own_venv_once_then_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "myagent-cli", "0.1.0", "myagent")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    home = tmp_path / "home"
    user_dir(home).mkdir(parents=True)
    (user_dir(home) / "myagent.toml").write_text(GOOD)
    exe = install_harness("myagent", home=home)
    assert exe == home / "harnesses" / "myagent" / "bin" / "myagent" and os.access(exe, os.X_OK)
    marker = json.loads((home / "harnesses" / "myagent" / MARKER).read_text())
    assert marker["spec"] == "myagent-cli==0.1.0"
    (index / "myagent_cli-0.1.0-py3-none-any.whl").unlink()  # "offline": pip would fail now
    assert install_harness("myagent", home=home) == exe  # the cache is used, pip not asked
    monkeypatch.setenv("CLAWSTREAM_HOME", str(home))
    monkeypatch.setenv("CLAWSTREAM_HARNESS_VERSIONS", "myagent=0.2.0")
    assert version_overrides() == {"myagent": "0.2.0"}  # an added harness's pin is overridable too


def test_the_teacher_versions_are_the_built_in_pins() -> None:
    for name, adapter in ADAPTERS.items():
        if adapter.teacher_version:
            assert HARNESSES[name].version == adapter.teacher_version, name
