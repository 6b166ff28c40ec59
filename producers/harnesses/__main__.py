"""Print the built-in harness adapters (name, dialect, install package, description)."""

from producers.harnesses.catalog import ADAPTERS

for adapter in ADAPTERS.values():
    print(f"{adapter.name:20} {adapter.dialect.value:20} {adapter.install or '(built in)':12} {adapter.description}")
