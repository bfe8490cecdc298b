"""mkdocs hooks: the site's home page is README.md, its links rewritten for the site.

README.md links the guides as ``docs/x.md`` (right on GitHub); on the site they are ``x.md``,
and a link whose text is the path shows the guide's title.
Links from any page to a repository file outside docs/ (``.ci/fast_subset.py``,
``../benchmarks/README.md``) become their path in code, since the site has no copy of them.
"""

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _site_link(match: re.Match, in_readme: bool) -> str:
    text, target = match.groups()
    if re.match(r"[a-z]+:|#", target):
        return match.group(0)
    if in_readme:
        if target.startswith("docs/"):
            page = target.removeprefix("docs/")
            if text.startswith("docs/"):  # the path as text: the page's title instead
                text = _title(page.split("#")[0])
            return f"[{text}]({page})"
        outside = target
    elif target.startswith("../"):
        outside = target.removeprefix("../")
    else:
        return match.group(0)
    return text if text.startswith("`") else f"{text} (`{outside}`)"


def _title(page: str) -> str:
    """A guide's title: its first heading, without code marks."""
    heading = (ROOT / "docs" / page).read_text().split("\n", 1)[0]
    return heading.removeprefix("# ").replace("`", "")


def on_files(files, config):
    home = File.generated(config, "index.md", content=(ROOT / "README.md").read_text())
    files.append(home)
    return files


def on_page_markdown(markdown, page, config, files):
    in_readme = page.file.src_uri == "index.md"
    return LINK.sub(lambda m: _site_link(m, in_readme), markdown)
