"""The one error both regex writers raise when a constraint has no regex here.

``json_regex`` (a JSON schema as a regex) and ``continuation`` (the rest of a regular
constraint) refuse what they do not write with :class:`UnsupportedError`, whose message names
the construct or limit; the runtime reports it to the client (UNIMPLEMENTED at prepare time,
RESOURCE_EXHAUSTED when a rest outgrows ``max_grammar_bytes``)."""

from __future__ import annotations


class UnsupportedError(ValueError):
    """The constraint's rest cannot be written as a regex here; the message says why."""
