"""The book as one PDF: every page of the built site printed by the system Chromium, joined.

    python _ext/book_pdf.py _build/html -o _build/pdf/lsdl.pdf      (`make pdf`)

The site is served on localhost and each page opened in headless Chromium, in reading order
(the root page, then each page's "next" link), in the light theme. Once its math is typeset
by the site's own MathJax and its images have loaded, the page is printed (the DevTools
protocol's Page.printToPDF: A4, the page's title and page number in the footer) and the
pages are joined with pypdf, each page's title an entry of the outline. Links between pages
point to the published site (_config.yml's html.baseurl, the pages' canonical URL). The pages
printed must be exactly those of _toc.yml, in its order (else no PDF is written). Nothing
is downloaded: the browser is Debian's chromium and chromium-driver (`make browser`), driven
as the browser test drives it (tests/site_browser.py).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    """The module at `path`, loaded by its path under `name` (not added to sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The local server and the browser, as the browser test has them (tests/ is no package).
site_browser = _load("lsdl_site_browser", ROOT / "tests" / "site_browser.py")

A4 = (8.27, 11.69)  # inches
MARGIN = 0.6  # inches
FOOTER = (
    '<div style="font-size: 7pt; color: #555; width: 100%; margin: 0 0.6in; display: flex;'
    ' justify-content: space-between"><span class="title"></span>'
    '<span><span class="pageNumber"></span> / <span class="totalPages"></span></span></div>'
)

# The page as it is printed: the light theme (the reader's stored mode may be dark), links to
# other pages of the site rewritten to the published site (the canonical URL's base); what
# the page shows, for the outline and the tests.
PREPARE_JS = """
const local = arguments[0];
document.documentElement.dataset.theme = "light";
document.documentElement.dataset.mode = "light";
const canonical = document.querySelector("link[rel=canonical]");
let site = null;
if (canonical) {
    const page = location.href.split("#")[0].slice(local.length);
    if (canonical.href.endsWith(page)) site = canonical.href.slice(0, -page.length);
}
const here = location.href.split("#")[0];
if (site) {  // a link within the page stays a jump within the PDF
    document.querySelectorAll("a[href]").forEach(a => {
        if (a.href.startsWith(local) && a.href.split("#")[0] !== here) {
            a.href = site + a.href.slice(local.length);
        }
    });
}
const h1 = document.querySelector("article h1") || document.querySelector("h1");
const title = h1 ? h1.textContent.replace(/[#¶]\\s*$/, "").trim() : document.title;
const next = document.querySelector("link[rel=next]");
const shown = sel => [...document.querySelectorAll(sel)].filter(e => e.checkVisibility());
return {
    title: title,
    next: next ? next.href : null,
    site: site,
    equations: shown("mjx-container[display=true]")
        .map(e => (e.querySelector("mjx-assistive-mml") || e).textContent),
    captions: shown("figcaption").map(e => {  // the words: the PDF's text has the math apart
        const words = e.cloneNode(true);
        words.querySelectorAll("mjx-container, a.headerlink").forEach(m => m.remove());
        return words.textContent.trim();
    }),
    citations: shown("span.bibtex-citation").map(e => e.textContent.trim()),
};
"""


@dataclass
class Printed:
    """One page of the site in the PDF: its title, URL, first page (from 0) and number of
    pages, and the text of what it shows: its displayed equations (MathJax's text of each),
    figure captions (their words, without their math) and citations."""

    title: str
    url: str
    first: int
    count: int
    equations: list[str]
    captions: list[str]
    citations: list[str]


def print_pages(session, base: str, limit: int | None = None) -> list[tuple[Printed, bytes]]:
    """Each page of the site at `base` printed, from its root page along the "next" links
    (the first `limit` pages only, if given): (what it shows, its PDF)."""
    from pypdf import PdfReader

    session.get(f"{base}index.html")  # the root page, through the index's redirect
    deadline = time.monotonic() + 30
    while session.current_url.endswith("/index.html") and time.monotonic() < deadline:
        time.sleep(0.05)
    url, seen, printed, first = session.current_url.split("#")[0], set(), [], 0
    while url and url not in seen and (limit is None or len(printed) < limit):
        seen.add(url)
        state = site_browser.page_state(session, url)
        if state["math_nodes"] and not (state["rendered_math"] and not state["math_errors"]):
            raise RuntimeError(f"{url}: the math did not render ({state})")
        if state["broken_images"]:
            raise RuntimeError(f"{url}: images did not load: {state['broken_images']}")
        page = session.execute_script(PREPARE_JS, base)
        session.execute_async_script("document.fonts.ready.then(arguments[0]);")
        pdf = base64.b64decode(
            session.execute_cdp_cmd(
                "Page.printToPDF",
                {
                    "paperWidth": A4[0],
                    "paperHeight": A4[1],
                    **{f"margin{side}": MARGIN for side in ("Top", "Bottom", "Left", "Right")},
                    "printBackground": True,
                    "displayHeaderFooter": True,
                    "headerTemplate": "<span></span>",
                    "footerTemplate": FOOTER,
                },
            )["data"]
        )
        count = len(PdfReader(io.BytesIO(pdf)).pages)
        fields = {k: page[k] for k in ("title", "equations", "captions", "citations")}
        printed.append((Printed(url=url, first=first, count=count, **fields), pdf))
        first += count
        url = page["next"] and page["next"].split("#")[0]
    return printed


def join(printed: list[tuple[Printed, bytes]], out: Path) -> None:
    """Write the pages' PDFs into one at `out`, with an outline entry for each."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter()
    for page, pdf in printed:
        writer.append(PdfReader(io.BytesIO(pdf)), import_outline=False)
        writer.add_outline_item(title=page.title, page_number=page.first)
    title = printed[0][0].title if printed else ""
    writer.add_metadata({"/Title": title, "/Creator": "_ext/book_pdf.py (Chromium)"})
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        writer.write(f)


def toc_pages(toc: Path) -> list[str]:
    """The book's pages in reading order, as _toc.yml `toc` lists them: its root, then each
    entry's ``file`` (parts' chapters and their sections, depth first)."""
    data = yaml.safe_load(Path(toc).read_text())
    pages = [data["root"]]

    def visit(entries):
        for entry in entries or []:
            if "glob" in entry:
                raise ValueError(f"{toc}: a glob entry ({entry['glob']!r}) has no fixed order")
            if "file" in entry:
                pages.append(entry["file"])
            visit(entry.get("sections"))

    for part in data.get("parts") or [{"chapters": data.get("chapters")}]:
        visit(part.get("chapters"))
    return [
        str(Path(page).with_suffix("")) if Path(page).suffix in {".md", ".ipynb"} else page
        for page in pages
    ]


def check_order(printed: list[str], expected: list[str]) -> None:
    """Raise RuntimeError unless the pages `printed` (paths without .html) are `expected`
    (_toc.yml's, or their first ones for a PDF of a few pages), in order, naming what is
    missing, extra or out of place."""
    if printed == expected:
        return
    missing = [p for p in expected if p not in printed]
    extra = [p for p in printed if p not in expected]
    first = next(i for i, (a, b) in enumerate(zip([*printed, None], [*expected, None])) if a != b)
    raise RuntimeError(
        f"the pages printed are not _toc.yml's in its order: {len(printed)} printed, "
        f"{len(expected)} expected; missing {missing}, unexpected {extra}; first "
        f"difference at page {first + 1}: printed {printed[first : first + 1]}, expected "
        f"{expected[first : first + 1]} (the pages are followed by their 'next' links: is the "
        "site built from this _toc.yml?)"
    )


def build_pdf(
    html: Path, out: Path, profile: Path, limit: int | None = None, toc: Path = ROOT / "_toc.yml"
) -> list[Printed]:
    """Print the built site in `html` (its first `limit` pages, if given) into the PDF `out`;
    `profile`: a folder for Chromium's profile. The pages printed must be those of the
    book's table of contents `toc` (its first `limit`), in its order; RuntimeError, and no
    PDF, otherwise. Returns what each page printed shows."""
    if limit is not None and limit < 1:
        raise ValueError(f"Invalid limit: {limit} (expected None or a whole number >= 1)")
    if not (html / "index.html").is_file():
        raise FileNotFoundError(f"no built site in {html} (index.html missing): run `make book`")
    expected = toc_pages(toc)[:limit]
    with site_browser.serve(html) as base, site_browser.chromium(profile) as session:
        printed = print_pages(session, base, limit)
        paths = [page.url.removeprefix(base).removesuffix(".html") for page, _ in printed]
    check_order(paths, expected)
    join(printed, out)
    return [page for page, _ in printed]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, help="the built site (jupyter-book's _build/html)")
    parser.add_argument("-o", "--output", type=Path, default=Path("_build/pdf/lsdl.pdf"))
    parser.add_argument("--pages", type=int, default=None, help="only the first PAGES pages")
    parser.add_argument(
        "--toc", type=Path, default=ROOT / "_toc.yml", help="the book's table of contents"
    )
    args = parser.parse_args(argv)
    if args.pages is not None and args.pages < 1:
        parser.error(f"Invalid --pages: {args.pages} (expected a whole number >= 1)")
    with tempfile.TemporaryDirectory() as profile:
        printed = build_pdf(args.html, args.output, Path(profile), args.pages, args.toc)
    total = sum(p.count for p in printed)
    shown = {k: sum(len(getattr(p, k)) for p in printed) for k in ("equations", "captions")}
    print(
        f"{args.output}: {total} pages from {len(printed)} pages of the site, "
        f"{shown['equations']} displayed equations, {shown['captions']} figures"
    )


if __name__ == "__main__":
    main()
