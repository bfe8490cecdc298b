"""Where the documentation lives: messages and docstrings name a page by title and address.

The site is built from the ``docs`` folder (``./dev docs``); its ``bitwise.md`` is served at
``DOCS + "bitwise/"`` and a section at ``#its-heading-slug``. Errors call :func:`doc_ref`;
docstrings, which cannot call, write the address out (``links_test.py`` checks that every
page and section named anywhere in ``src/`` exists).
"""

#: The documentation site (pyproject.toml's ``[project.urls] Documentation``).
DOCS = "https://unsplit.readthedocs.io/en/latest/"

#: The guides, by file stem: their titles as the site's navigation shows them.
TITLES = {
    "rule": "The rule",
    "models": "Your model, your layout",
    "bitwise": "Bitwise mode",
    "coupled": "Losses that couple examples",
    "elastic": "Elastic runs",
    "dropout": "Dropout",
    "audit": "The audit",
    "checks": "What unsplit checks",
    "testing": "Testing on several processes",
    "demo": "The demo",
    "benchmarks": "Benchmarks",
    "architecture": "Architecture",
}


def doc_page(page: str, section: str = "") -> str:
    """The address of a guide (``docs/<page>.md``), or of one of its sections.

    Args:
        page: the guide's file stem, one of :data:`TITLES`.
        section: the section's anchor (its heading, lower case, spaces as ``-``).

    Example:
        >>> doc_page("bitwise")
        'https://unsplit.readthedocs.io/en/latest/bitwise/'
        >>> doc_page("bitwise", "accelerators-gpu-tpu")
        'https://unsplit.readthedocs.io/en/latest/bitwise/#accelerators-gpu-tpu'
    """
    if page not in TITLES:
        raise ValueError(f"doc_page: no guide {page!r}; expected one of {sorted(TITLES)}.")
    return f"{DOCS}{page}/" + (f"#{section}" if section else "")


def doc_ref(page: str, section: str = "") -> str:
    """A guide as a message names it: its title and address.

    Example:
        >>> doc_ref("bitwise")
        'the Bitwise mode guide (https://unsplit.readthedocs.io/en/latest/bitwise/)'
    """
    return f"the {TITLES[page]} guide ({doc_page(page, section)})"
