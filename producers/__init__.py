"""Producers: everything that creates events from the outside world.

Subpackages, one per service or shared part: ``proxy`` (serving proxy: harness calls → call events),
``sandbox`` (sandbox worker: rollout requests → lifecycle + reward events), ``harnesses`` (adapters as data, the
built-in agent loop, npm installs), ``tasks`` (task model, suites, grading rules), ``scheduler`` (rollout
requests per training step; eval tables).
"""
