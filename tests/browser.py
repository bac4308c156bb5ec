"""A real headless Chromium for the page tests, driven by selenium through Debian's `chromium` and
`chromium-driver` packages (`./setup` installs them): no browser is downloaded, no network is used."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

T = TypeVar("T")

# on PATH, or where macOS's casks put them (./setup looks in the same places)
BROWSERS = (
    "chromium",
    "chromium-browser",
    "google-chrome",
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
)


def chromium(profile: Path, width: int = 1280, height: int = 900) -> webdriver.Chrome:
    """A headless Chromium with a profile of its own under `profile` (its localStorage starts empty)."""
    driver = shutil.which("chromedriver")
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if driver is None or browser is None:
        raise RuntimeError(
            "the page tests need Chromium and its driver: ./setup installs them (Debian, Ubuntu) "
            "or says what to run"
        )
    options = Options()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox does not start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(arg)
    d = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    d.set_page_load_timeout(60)
    d.set_script_timeout(60)
    return d


def wait_for(
    what: Callable[[], T], timeout: float, message: str | Callable[[], str], every: float = 0.1
) -> T:
    """what()'s first truthy value within `timeout` seconds; AssertionError(message) after it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = what()
        except Exception:  # noqa: BLE001 - the page is still changing under the script: look again
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(every)


def page_state(d: webdriver.Chrome, name: str) -> Any:
    """A page's state object for scripts (window.swarmChat, window.swarmMap), as JSON values."""
    return d.execute_script(f"return window.{name} ? JSON.parse(JSON.stringify(window.{name})) : null")


def screenshot(d: webdriver.Chrome, path: Path, width: int = 1280) -> None:
    """The whole page as a PNG (the window grown to the page's height first)."""
    height = d.execute_script(
        "return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)"
    )
    want = max(600, min(int(height) + 20, 4000))
    d.set_window_size(width, want)
    inner = d.execute_script("return window.innerHeight")  # the window's own frame takes some of it
    if inner < want:
        d.set_window_size(width, 2 * want - int(inner))
    time.sleep(0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(path))
