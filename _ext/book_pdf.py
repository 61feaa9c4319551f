"""The book as one PDF: every page of the built site printed by the system Chromium, joined.

    python _ext/book_pdf.py _build/html -o _build/pdf/lsdl.pdf      (`make pdf`)

The site is served on localhost and each page opened in headless Chromium, in reading order
(the root page, then each page's "next" link), in the light theme. Once its math is typeset
by the site's own MathJax and its images have loaded, the page is printed (the DevTools
protocol's Page.printToPDF: A4, the page's title and page number in the footer) and the
pages are joined with pypdf, each page's title an entry of the outline. Links between pages
point to the published site (_config.yml's html.baseurl, the pages' canonical URL). Nothing
is downloaded: the browser is Debian's chromium and chromium-driver (`make browser`), driven
as the browser test drives it (tests/site_browser.py).
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # site_browser: the local server and the browser

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
    from site_browser import page_state

    session.get(f"{base}index.html")  # the root page, through the index's redirect
    deadline = time.monotonic() + 30
    while session.current_url.endswith("/index.html") and time.monotonic() < deadline:
        time.sleep(0.05)
    url, seen, printed, first = session.current_url.split("#")[0], set(), [], 0
    while url and url not in seen and (limit is None or len(printed) < limit):
        seen.add(url)
        state = page_state(session, url)
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


def build_pdf(html: Path, out: Path, profile: Path, limit: int | None = None) -> list[Printed]:
    """Print the built site in `html` (its first `limit` pages, if given) into the PDF `out`;
    `profile`: a folder for Chromium's profile. Returns what each page printed shows."""
    from site_browser import chromium, serve

    if limit is not None and limit < 1:
        raise ValueError(f"Invalid limit: {limit} (expected None or a whole number >= 1)")
    if not (html / "index.html").is_file():
        raise FileNotFoundError(f"no built site in {html} (index.html missing): run `make book`")
    with serve(html) as base, chromium(profile) as session:
        printed = print_pages(session, base, limit)
    join(printed, out)
    return [page for page, _ in printed]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, help="the built site (jupyter-book's _build/html)")
    parser.add_argument("-o", "--output", type=Path, default=Path("_build/pdf/lsdl.pdf"))
    parser.add_argument("--pages", type=int, default=None, help="only the first PAGES pages")
    args = parser.parse_args(argv)
    if args.pages is not None and args.pages < 1:
        parser.error(f"Invalid --pages: {args.pages} (expected a whole number >= 1)")
    with tempfile.TemporaryDirectory() as profile:
        printed = build_pdf(args.html, args.output, Path(profile), args.pages)
    total = sum(p.count for p in printed)
    shown = {k: sum(len(getattr(p, k)) for p in printed) for k in ("equations", "captions")}
    print(
        f"{args.output}: {total} pages from {len(printed)} pages of the site, "
        f"{shown['equations']} displayed equations, {shown['captions']} figures"
    )


if __name__ == "__main__":
    main()
