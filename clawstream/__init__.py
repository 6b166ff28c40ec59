"""clawstream: black-box RL through real agent harnesses over Apache Kafka (ClawGym II, arXiv 2608.16798).

This small package holds what every service shares: the CLI, settings, errors and Kafka client plumbing.
The pipeline stages live in the top-level packages ``producers``, ``streams``, ``consumers`` and ``learner``;
the contracts in ``schemas``.
"""

__version__ = "0.1.0"
