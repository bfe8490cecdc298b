"""A griffe extension for the API pages: ``Example:`` sections render as examples.

unsplit's docstrings (Google style) title their doctests ``Example:``; griffe reads only
``Examples:`` as examples (code with its output) and the singular as a note, whose ``>>>``
lines markdown would turn into quotes. The docstrings stay as they are; the site reads both.
"""

import re

import griffe

SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SINGULAR.sub(r"\1Examples:", obj.docstring.value)
