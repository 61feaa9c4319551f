"""Headless Chromium over the built HTML book (used by tests/test_book.py, and by
_ext/book_pdf.py, which prints the pages into the book's PDF).

Debian's `chromium` and `chromium-driver` (apt-get install chromium chromium-driver; `make
test` installs them when missing), driven by selenium. The site is served on localhost and
every other host is unreachable (`--host-resolver-rules`), so the checks hold offline.
"""

from __future__ import annotations

import functools
import http.server
import io
import shutil
import threading
import time
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


def set_theme(session, theme: str, clicks: int = 3) -> bool:
    """Switch the page to the `theme` ("light" or "dark") with the theme's own button (it
    cycles auto, dark and light, and keeps the choice for the next pages); whether it did."""
    for _ in range(clicks + 1):
        if session.execute_script("return document.documentElement.dataset.theme;") == theme:
            return True
        buttons = session.find_elements("css selector", ".theme-switch-button")
        shown = [b for b in buttons if b.is_displayed()]
        if not shown:
            return False
        shown[0].click()
    return False


# Every figure of the page's text (an executed cell's image, a numbered figure, a widget
# explorer's static picture), with where to sample it once it is scrolled into view: a
# point of the picture itself (near its top-left corner: the figure's own background) and
# of the card around it (the middle of the image's left padding, where it has one).
FIGURES_JS = """
return [...document.querySelectorAll("article div.cell_output img, article figure img")]
    .filter(img => img.naturalWidth > 0 && img.checkVisibility())
    .map((img, i) => {
        const cell = img.closest(".cell");
        const source = cell && cell.querySelector(".cell_input");
        return {
            index: i,
            src: img.getAttribute("src"),
            explorer: !!source && /_explorer\\(/.test(source.textContent),
        };
    });
"""

FIGURE_POINTS_JS = """
const img = [...document.querySelectorAll("article div.cell_output img, article figure img")]
    .filter(img => img.naturalWidth > 0 && img.checkVisibility())[arguments[0]];
img.scrollIntoView({block: "center"});
const r = img.getBoundingClientRect(), s = getComputedStyle(img);
const px = v => parseFloat(v) || 0;
const left = r.left + px(s.borderLeftWidth), top = r.top + px(s.borderTopWidth);
const padded = px(s.paddingLeft) >= 3 && px(s.paddingTop) >= 3;
return {
    figure: [left + px(s.paddingLeft) + 2, top + px(s.paddingTop) + 2],
    card: padded ? [left + px(s.paddingLeft) / 2, r.top + r.height / 2] : null,
    scale: window.devicePixelRatio,
    page: getComputedStyle(document.body).backgroundColor,
};
"""


def figure_colours(session) -> list[dict]:
    """What the reader sees of each figure of the loaded page in its current theme: the
    colour (r, g, b) of the figure's own background and of its card as rendered (read from
    screenshots, so the theme's filters count), the page's background, whether it is a widget
    explorer's picture."""
    from PIL import Image

    colours = []
    for figure in session.execute_script(FIGURES_JS):
        points = session.execute_script(FIGURE_POINTS_JS, figure["index"])
        time.sleep(0.05)  # the scroll's repaint
        shot = Image.open(io.BytesIO(session.get_screenshot_as_png())).convert("RGB")
        pixel = {
            k: None
            if points[k] is None
            else shot.getpixel(tuple(int(c * points["scale"]) for c in points[k]))
            for k in ("figure", "card")
        }
        colours.append(
            {"src": figure["src"], "explorer": figure["explorer"], "page": points["page"], **pixel}
        )
    return colours


# Every block of code or output (pre) of the page's text, its details and dropdowns opened
# (a hidden cell's code, a solution), as laid out now: whether it scrolls sideways, and for a
# listing of the library's code (_ext/lsdl_listings.py) its font beside the page's other code.
BLOCKS_JS = """
const article = document.querySelector("article");
if (!article) return [];
article.querySelectorAll("details").forEach(d => { d.open = true; });
article.querySelectorAll(".toggle-hidden").forEach(e => e.classList.remove("toggle-hidden"));
const code = [...article.querySelectorAll("div.highlight pre")]
    .find(p => !p.closest(".lsdl-listing"));
const codeFont = code ? getComputedStyle(code).fontSize : null;
return [...article.querySelectorAll("pre")].filter(p => p.checkVisibility()).map(p => {
    const lines = p.textContent.split("\\n");
    const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), "");
    const listing = p.closest(".lsdl-listing");
    return {
        listing: !!listing,
        name: listing ? listing.querySelector(".caption-text").textContent.trim() : "",
        scroll: p.scrollWidth,
        client: p.clientWidth,
        font: getComputedStyle(p).fontSize,
        code_font: codeFont,
        longest: longest.length,
        line: longest.trim().slice(0, 60),
    };
});
"""


def code_blocks(session) -> list[dict]:
    """Each block of code or output of the loaded page's text (details and dropdowns opened):
    ``scroll`` and ``client`` widths (it scrolls sideways when the first is larger), its font
    size, ``code_font`` (that of the page's first other code block, a cell's code: the theme's
    code font), its longest line (length, start), whether it is a listing of the library's
    code and which."""
    return session.execute_script(BLOCKS_JS)


def sideways(block: dict) -> bool:
    """Whether a block of `code_blocks` scrolls sideways."""
    return block["scroll"] > block["client"]


def luminance(rgb) -> float:
    """WCAG's relative luminance of an sRGB colour (0-255 channels)."""

    def linear(c):
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a, b) -> float:
    """WCAG's contrast ratio of two colours, from 1 (none) to 21 (black on white)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def css_rgb(value: str) -> tuple[int, int, int]:
    """(r, g, b) of a computed CSS colour ("rgb(1, 2, 3)" or "rgba(1, 2, 3, 0.5)")."""
    inner = value[value.index("(") + 1 : value.index(")")]
    return tuple(int(float(c)) for c in inner.split(",")[:3])
