"""Headless Chromium over the built HTML book (used by tests/test_book.py).

Debian's `chromium` and `chromium-driver` (apt-get install chromium chromium-driver; `make
test` installs them when missing), driven by selenium. The site is served on localhost and
every other host is unreachable (`--host-resolver-rules`), so the checks hold offline.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver",)
INSTALL = "apt-get install -y chromium chromium-driver  (as root; `make test` does it)"


def _first(paths):
    return next((p for p in paths if Path(p).exists()), None) or shutil.which(Path(paths[0]).name)


def browser_paths() -> tuple[str, str]:
    """The system Chromium and ChromeDriver; a clear error naming the packages if absent."""
    chromium, driver = _first(CHROMIUM), _first(CHROMEDRIVER)
    if not chromium or not driver:
        missing = [n for n, p in (("chromium", chromium), ("chromium-driver", driver)) if not p]
        raise RuntimeError(f"missing {', '.join(missing)}: {INSTALL}")
    return chromium, driver


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextmanager
def serve(directory: Path):
    """Serve `directory` on a free localhost port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def chromium(profile_dir: Path, width: int = 1280, height: int = 1000):
    """A headless Chromium session that logs the console and reaches localhost only."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        f"--user-data-dir={profile_dir}",
        f"--window-size={width},{height}",
        # any host but localhost fails to resolve: a page that needs the network shows it
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    session.set_page_load_timeout(60)
    session.set_script_timeout(60)
    try:
        yield session
    finally:
        session.quit()


# Waits for MathJax (if the page loads it) and for every image, eager or lazy, to settle;
# returns what the checks need about the page.
PAGE_STATE_JS = """
const done = arguments[arguments.length - 1];
const images = [...document.images];
images.forEach(img => { img.loading = "eager"; });
const settled = images.map(img => img.complete ? Promise.resolve() :
    new Promise(r => { img.addEventListener("load", r); img.addEventListener("error", r); }));
const math = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
Promise.all([math, ...settled]).then(() => done({
    mathjax: !!(window.MathJax && MathJax.version),
    mathjax_version: (window.MathJax && MathJax.version) || null,
    math_nodes: document.querySelectorAll(".math, span.math, div.math").length,
    rendered_math: document.querySelectorAll("mjx-container").length,
    math_errors: document.querySelectorAll("mjx-merror").length,
    broken_images: images.filter(img => !(img.naturalWidth > 0)).map(img => img.src),
    images: images.length,
    colab: [...document.querySelectorAll("a[href*='colab.research.google.com']")]
        .map(a => a.href),
}));
"""


def page_state(session, url: str) -> dict:
    session.get(url)
    return session.execute_async_script(PAGE_STATE_JS)


def console_errors(session) -> list[str]:
    return [e["message"] for e in session.get_log("browser") if e["level"] == "SEVERE"]
