"""A griffe extension for the API pages: docstrings read as unsplit writes them.

unsplit's docstrings (Google style) title their doctests ``Example:``; griffe reads only
``Examples:`` as examples (code with its output) and the singular as a note, whose ``>>>``
lines markdown would turn into quotes. They also name objects with Sphinx roles
(``:func:`unsplit.ids64```), which markdown shows as written: the site shows the name as code.
The docstrings stay as they are.
"""

import re

import griffe

SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):`~?([^`]+)`")


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = SINGULAR.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = ROLE.sub(r"`\1`", text)
