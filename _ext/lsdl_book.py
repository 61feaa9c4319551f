"""Sphinx hooks of the book's HTML, loaded through _config.yml's ``local_extensions``."""


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


def setup(app):
    # after sphinx-book-theme's own html-page-context handler (priority 500) adds the buttons
    app.connect("html-page-context", drop_launch_buttons_off_notebooks, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
