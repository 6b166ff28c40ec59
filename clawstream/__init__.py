"""clawstream: the application shell — the ``clawstream`` command, the CPU quickstart and the supervised stack.

Black-box RL through real agent harnesses over Apache Kafka (ClawGym II, arXiv 2608.16798). This package is the
roof: ``cli`` (every command), ``demo`` (the quickstart), ``stack`` (services as supervised processes, evaluation).
It imports every stage; nothing imports it. The ground every service stands on is ``clawbase``; the stages are the
top-level packages ``producers``, ``streams``, ``consumers``, ``learner`` and ``warmstart``; the contracts ``schemas``.
"""

__version__ = "0.1.0"
