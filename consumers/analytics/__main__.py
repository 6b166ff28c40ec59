"""``python -m consumers.analytics {tail,export,audit} ...``: the event-log tools (``clawstream tail|export|audit``)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "tail": "consumers.analytics.tail",
    "export": "consumers.analytics.export",
    "audit": "consumers.analytics.audit",
}

USAGE = """usage: python -m consumers.analytics {tail,export,audit} ...

  tail    print a topic's records as decoded JSON lines (--help for options)
  export  write a topic's records over an offset or time range to JSON lines or Parquet (--help for options)
  audit   read a run's topics back and reconcile them: nothing lost, doubled or trained twice (--help)

The custom-consumer example: python -m consumers.analytics.examples.harness_report --help"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    run = importlib.import_module(COMMANDS[command]).main
    return run(rest, prog=f"python -m consumers.analytics {command}")


if __name__ == "__main__":
    sys.exit(main())
