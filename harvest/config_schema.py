"""`harvest config-schema`: prints the JSON Schema of harvest.yaml, generated from the
settings' declarations (the copy in docs/harvest.schema.json is tested equal to it)."""

from __future__ import annotations

import json

HELP = "print the JSON Schema of harvest.yaml (for editors and CI checks)"


def add_arguments(parser) -> None:
    pass  # no options: the schema is a function of the code


def schema_text() -> str:
    from harvest.config import schema

    return json.dumps(schema(), indent=2) + "\n"


def run(args) -> int:
    print(schema_text(), end="")
    return 0
