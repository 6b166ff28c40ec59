"""Print the harness adapters, built in and added (name, dialect, install, description)."""

from producers.harnesses.catalog import all_adapters

for adapter in all_adapters().values():
    print(f"{adapter.name:20} {adapter.dialect.value:20} {adapter.install or '(built in)':40} {adapter.description}")
