"""Every name in `lit_rlhf.__all__` says what it is on its docstring's first line and documents every argument
(Google style: an `Args:` or `Attributes:` section, or a docstring under a dataclass field), which is what the API
reference (docs/api.md) shows."""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import textwrap

import pytest

import lit_rlhf

SECTION = re.compile(r"(Args|Attributes):")
ENTRY = re.compile(r" {4}(\w+)(?: \([^)]*\))?: \S")


def section_names(doc: str) -> set[str]:
    """The names an `Args:` or `Attributes:` section of a cleaned docstring documents."""
    names: set[str] = set()
    inside = False
    for line in doc.splitlines():
        if SECTION.fullmatch(line):
            inside = True
        elif line and not line.startswith(" "):
            inside = False
        elif inside and (entry := ENTRY.match(line)):
            names.add(entry.group(1))
    return names


def field_docstring_names(cls: type) -> set[str]:
    """Fields of `cls` and its lit_rlhf bases followed by a docstring of their own."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lit_rlhf"):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for node, after in itertools.pairwise(body):
            doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and doc:
                names.add(node.target.id)
    return names


def documented(obj: object) -> set[str]:
    names = set()
    for klass in obj.__mro__ if inspect.isclass(obj) else [obj]:
        if getattr(klass, "__module__", "").startswith("lit_rlhf"):
            names |= section_names(inspect.getdoc(klass) or "")
    return names | (field_docstring_names(obj) if inspect.isclass(obj) else set())


def arguments(obj: object) -> list[str]:
    """The named parameters of a function, or of a class's own constructor (none for one it inherits from
    outside lit_rlhf, such as an exception's)."""
    if inspect.isclass(obj) and not getattr(obj.__init__, "__module__", "").startswith("lit_rlhf"):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in inspect.signature(obj).parameters.values() if p.kind not in kinds]  # type: ignore[arg-type]


def test_the_section_reader_finds_google_entries_only():
    doc = "A thing.\n\nArgs:\n    a: one.\n    b (int): two,\n        continued.\n\nReturns:\n    c: not an argument."
    assert section_names(doc) == {"a", "b"}


@pytest.mark.parametrize("name", lit_rlhf.__all__)
def test_a_public_name_says_what_it_is_and_documents_its_arguments(name):
    obj = getattr(lit_rlhf, name)
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    first = doc.splitlines()[0]
    assert len(first.split()) >= 4 and not first.startswith(("This ", "TODO")), f"{name}: {first!r}"
    missing = [argument for argument in arguments(obj) if argument not in documented(obj)]
    assert not missing, f"{name}: arguments without a Google-style entry: {missing}"
