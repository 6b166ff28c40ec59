"""A deadline on a blocking call that may hang past its own timeout: when it does, the process exits for a restart.

librdkafka's transactional calls take a timeout, yet after a broker restart mid-transaction
``send_offsets_to_transaction(…, 60)`` was seen blocked for minutes (tests/e2e/test_stack_kills.py, the single broker
stopped and started again). A process stuck there holds its transaction and trains nothing; exiting with
``RESTART_EXIT`` (75, EX_TEMPFAIL) lets its supervisor (the demo's stack, compose's restart policy) start it again,
and the restarted learner resumes from the log and its weight store. Imports nothing of the project.

Use: ``with deadline("commit_transaction", 90): producer.commit_transaction(60)``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

RESTART_EXIT = 75  # the stack's "restart me" (clawstream.stack.process.RESTART_EXIT; a unit test keeps them equal)
log = logging.getLogger("clawstream.watchdog")


def _expired(what: str, seconds: float) -> None:
    log.critical("%s did not return within %.0f s: exiting with %d for a restart", what, seconds, RESTART_EXIT)
    logging.shutdown()
    os._exit(RESTART_EXIT)


@contextmanager
def deadline(what: str, seconds: float) -> Iterator[None]:
    """Run the body; if it has not returned after ``seconds``, exit the process with ``RESTART_EXIT``."""
    timer = threading.Timer(seconds, _expired, args=(what, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
