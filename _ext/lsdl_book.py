"""Sphinx hooks of the book's HTML, loaded through _config.yml's ``local_extensions``."""

from pathlib import PurePosixPath
from urllib.parse import urlsplit

from docutils import nodes

from lsdl_lab.student import Edition, pin_edition


def drop_launch_buttons_off_notebooks(app, pagename, templatename, context, doctree):
    """Keep the launch (Colab) buttons on the labs only.

    sphinx-book-theme puts them on every executed page, and a chapter is a MyST markdown
    file, which Colab cannot open; the labs are .ipynb files in the repository.
    """
    if pagename not in app.env.all_docs:
        return
    if str(app.env.doc2path(pagename)).endswith(".ipynb"):
        return
    buttons = context.get("header_buttons")
    if buttons:
        context["header_buttons"] = [b for b in buttons if b.get("label") != "launch-buttons"]


def repository_blob_prefix(theme_options):
    """``<repository url>/blob/<branch>/``: what a link to a file of the repository starts
    with, from _config.yml's ``repository`` (Jupyter Book hands it to the theme's options
    as ``repository_url`` and ``repository_branch``); None without a repository."""
    url = (theme_options or {}).get("repository_url")
    if not url:
        return None
    branch = theme_options.get("repository_branch") or "main"
    return f"{url.rstrip('/')}/blob/{branch}/"


def book_page_of(url, prefix, pages, path_to_docs=""):
    """(page, fragment) when `url` is ``prefix + <source file of a page of the book>`` (a
    chapter's .md, a lab's .ipynb), else None: other files (benchmark results, the library's
    sources) are read on GitHub. `pages` maps a page's source path, relative to the book's
    root, to its docname; `path_to_docs` is the book's root in the repository."""
    if not prefix or not url.startswith(prefix):
        return None
    parts = urlsplit(url[len(prefix) :])
    if parts.query:  # ?plain=1 and the like ask for GitHub's own view of the file
        return None
    path = PurePosixPath(parts.path)
    if path_to_docs.strip("/"):
        try:
            path = path.relative_to(path_to_docs.strip("/"))
        except ValueError:
            return None
    page = pages.get(str(path))
    return None if page is None else (page, parts.fragment)


def site_page_of(url, baseurls, docnames):
    """(page, fragment) when `url` is a published site's URL of a page of the book
    (``<base URL> + <docname>.html``, for one of `baseurls`: this build's ``html_baseurl``
    and, in an edition, the latest site the labs link), else None. A page of an edition kept
    under the latest site (``<site>v1/book/ch01.html``) is not a page of the latest."""
    for baseurl in baseurls:
        if not baseurl or not url.startswith(baseurl):
            continue
        parts = urlsplit(url[len(baseurl) :])
        if parts.query or not parts.path.endswith(".html"):
            continue
        page = parts.path.removesuffix(".html")
        if page in docnames:
            return page, parts.fragment
    return None


def edition_link(url, repository_url, source_branch, branch):
    """`url` as the edition of `branch` (a tag) links it: a link to a file of the repository
    on the branch the sources name (``<repository>/blob/<source_branch>/...``), or to Colab
    opening one (``https://colab.research.google.com/github/<owner>/<name>/blob/...``),
    names the build's `branch` instead; any other URL is returned as it is. The rule is the
    student versions' (:func:`lsdl_lab.student.pin_edition`), applied to one link."""
    if not repository_url or not branch or branch == source_branch:
        return url
    if urlsplit(repository_url).netloc != "github.com":
        return url
    edition = Edition(branch, repository_url.rstrip("/"), branch=source_branch)
    return pin_edition(url, edition)[0]


def link_book_pages_internally(app, doctree, docname):
    """Turn a link to a page on the published site, or to its source on GitHub, into a
    link to the page of this build.

    The labs link to chapters by the site's URL (a relative link opens nothing in Colab,
    which shows the notebook alone); on the built site, a preview or a local build
    included, the reader should stay on the site being read. In an edition (a build whose
    repository branch is a tag, _ext/book_config.py --edition), the links to the
    repository's files and Colab's name the tag rather than the branch the sources name.
    """
    if app.builder.format != "html":
        return
    options = app.config.html_theme_options or {}
    prefix = repository_blob_prefix(options)
    baseurls = [app.config.html_baseurl, app.config.lsdl_latest_site]
    env = app.env
    pages = {PurePosixPath(env.doc2path(d, base=False)).as_posix(): d for d in env.all_docs}
    for node in doctree.findall(nodes.reference):
        if "refuri" not in node:
            continue
        url = node["refuri"] = edition_link(
            node["refuri"],
            options.get("repository_url"),
            app.config.lsdl_source_branch,
            options.get("repository_branch"),
        )
        found = site_page_of(url, baseurls, env.all_docs) or book_page_of(
            url, prefix, pages, options.get("path_to_docs", "")
        )
        if found is None:
            continue
        page, fragment = found
        # a page's link to itself: relative_uri gives "", which would lose the page
        uri = (
            app.builder.get_relative_uri(docname, page)
            or PurePosixPath(app.builder.get_target_uri(page)).name
        )
        node["refuri"] = f"{uri}#{fragment}" if fragment else uri
        node["internal"] = True  # the HTML writer's class "reference internal"


def setup(app):
    # Set by _ext/book_config.py --edition: the latest site (whose pages the labs link, and
    # which an edition's pages are too) and the branch the sources' links to the repository
    # name (which an edition's links name its tag instead of).
    app.add_config_value("lsdl_latest_site", None, "env", [str, type(None)])
    app.add_config_value("lsdl_source_branch", "main", "env", [str])
    # after sphinx-book-theme's own html-page-context handler (priority 500) adds the buttons
    app.connect("html-page-context", drop_launch_buttons_off_notebooks, priority=900)
    app.connect("doctree-resolved", link_book_pages_internally)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
