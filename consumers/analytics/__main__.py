"""``python -m consumers.analytics {tail,export} ...``: the event-log tools (same as ``clawstream tail|export``)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m consumers.analytics {tail,export} ...

  tail    print a topic's records as decoded JSON lines (--help for options)
  export  write a topic's records over an offset or time range to JSON lines or Parquet (--help for options)

The custom-consumer example: python -m consumers.analytics.examples.harness_report --help"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "tail":
        from consumers.analytics.tail import main as run
    elif command == "export":
        from consumers.analytics.export import main as run
    else:
        print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest, prog=f"python -m consumers.analytics {command}")


if __name__ == "__main__":
    sys.exit(main())
