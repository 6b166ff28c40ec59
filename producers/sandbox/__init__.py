"""Sandbox worker: runs each rollout attempt of a harness on a task in a fresh sandbox and reports what happened.

Purpose: consume rollout requests, create a sandbox (``local_backend`` or ``docker_backend``; interface in
``base``), register the rollout with the proxy, launch the harness, seal, grade inside the sandbox (``run_grader``),
and publish lifecycle and reward events (``rollout`` is one attempt, ``worker`` the service, ``offsets`` the commit
bookkeeping for concurrent requests).

Topics: ``clawstream.rollout.requests`` in → ``clawstream.rollout.events``, ``clawstream.rewards``,
``clawstream.deadletter`` out.
Run: ``clawstream sandbox-worker [--concurrency N]`` or ``python -m producers.sandbox``.
"""
