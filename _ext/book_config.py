"""The configuration a build of the book reads when it is not _config.yml itself.

    python _ext/book_config.py --cache -o _build/_config.cached.yml          (`make book-cached`)
    python _ext/book_config.py --cache --edition v3 -o _build/_config.v3.yml  (`make release`)
    python _ext/book_config.py --get html.baseurl                            (a value, printed)

A copy of _config.yml with:

* ``--cache``: the pages' executed notebooks kept by jupyter-cache (``execute_notebooks:
  cache``), so that a page whose code cells are unchanged is not run again;
* ``--edition vN``: the book as the edition of tag vN, kept under ``<site>vN/`` beside the
  latest (.github/workflows/release.yml): the repository's branch is the tag, so the Colab
  launch buttons and the links to the repository's files open the tag's files, and
  ``html.baseurl`` is the edition's URL, so the pages' canonical links and the PDF's links
  stay within the edition. Two settings of the book's hook (_ext/lsdl_book.py) say what the
  sources were written against: ``lsdl_latest_site`` (the latest site, whose pages the labs
  link) and ``lsdl_source_branch`` (the branch their links to the repository name);
* the local extensions' folders made absolute, as the copy is read from elsewhere.
"""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# What release.yml publishes and pages.yml keeps: tags v1, v2, ... (folders vN/ of the site).
EDITION = re.compile(r"v[0-9]+")


def book_config(
    config: dict, root: Path = ROOT, *, cache: bool = False, edition: str | None = None
) -> dict:
    """The configuration of a build: `config` (_config.yml's contents, left unchanged) with
    its local extensions under `root`, cached execution if `cache`, as the `edition` (a tag
    vN) if given."""
    config = copy.deepcopy(config)
    sphinx = config.setdefault("sphinx", {})
    extensions = sphinx.get("local_extensions") or {}
    sphinx["local_extensions"] = {k: str((root / v).resolve()) for k, v in extensions.items()}
    if cache:
        config.setdefault("execute", {})["execute_notebooks"] = "cache"
    if edition is not None:
        if not isinstance(edition, str) or not EDITION.fullmatch(edition):
            raise ValueError(
                f"Invalid edition: {edition!r} (expected a version tag v1, v2, ...: "
                "release.yml publishes those, and the site keeps them as vN/)"
            )
        site = config.get("html", {}).get("baseurl")
        if not site or not site.endswith("/"):
            raise ValueError(
                f"Invalid html.baseurl: {site!r} (expected the site's URL ending in '/': "
                "an edition is kept at <site>vN/)"
            )
        repository = config.setdefault("repository", {})
        source_branch = repository.get("branch") or "main"
        repository["branch"] = edition
        config["html"]["baseurl"] = f"{site}{edition}/"
        settings = sphinx.setdefault("config", {})
        settings["lsdl_latest_site"] = site
        settings["lsdl_source_branch"] = source_branch
    return config


def get(config: dict, key: str):
    """The value at the dotted `key` of `config` (``html.baseurl``); KeyError naming it."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"no {key} in the configuration (no {part!r})")
        value = value[part]
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "_config.yml")
    parser.add_argument("-o", "--output", type=Path, help="where to write the configuration")
    parser.add_argument("--cache", action="store_true", help="execute through jupyter-cache")
    parser.add_argument("--edition", help="the edition's tag, vN")
    parser.add_argument("--get", metavar="KEY", help="print one value (html.baseurl) and exit")
    args = parser.parse_args(argv)
    if (args.output is None) == (args.get is None):
        parser.error("give either -o (write a configuration) or --get (print a value)")
    original = yaml.safe_load(args.config.read_text())
    try:
        config = book_config(
            original, args.config.resolve().parent, cache=args.cache, edition=args.edition
        )
        if args.get is not None:
            print(get(config, args.get))
            return
    except (KeyError, ValueError) as exc:
        parser.error(str(exc).strip("'\""))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(yaml.safe_dump(config, sort_keys=False))


if __name__ == "__main__":
    main()
